# Finds NCCL, preferring the copy that torch loads (the nvidia-nccl wheel next to
# torch), so that one libnccl.so.2 serves both. Hints: NCCL_ROOT, NCCL_PYTHON_ROOT.
#   NCCL_FOUND, NCCL_INCLUDE_DIR, NCCL_LIBRARY, target NCCL::NCCL
set(_nccl_hints ${NCCL_ROOT} $ENV{NCCL_ROOT} ${NCCL_PYTHON_ROOT})
find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${_nccl_hints} PATH_SUFFIXES include
          PATHS ${CUDAToolkit_INCLUDE_DIRS} /usr/include /usr/local/cuda/include)
find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 HINTS ${_nccl_hints} PATH_SUFFIXES lib lib64
             PATHS /usr/lib/x86_64-linux-gnu /usr/local/cuda/lib64)
include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(NCCL DEFAULT_MSG NCCL_INCLUDE_DIR NCCL_LIBRARY)
if(NCCL_FOUND AND NOT TARGET NCCL::NCCL)
  add_library(NCCL::NCCL UNKNOWN IMPORTED)
  set_target_properties(NCCL::NCCL PROPERTIES IMPORTED_LOCATION ${NCCL_LIBRARY}
                        INTERFACE_INCLUDE_DIRECTORIES ${NCCL_INCLUDE_DIR})
endif()
