# Finds NCCL, preferring the copy that torch loads (the nvidia-nccl wheel next to
# torch, given as NCCL_PYTHON_ROOT), so that one libnccl.so.2 and its own nccl.h
# serve both. Otherwise NCCL_ROOT, then the system.
#   NCCL_FOUND, NCCL_INCLUDE_DIR, NCCL_LIBRARY, target NCCL::NCCL
if(NCCL_PYTHON_ROOT)
  # The wheel has only libnccl.so.2 (no libnccl.so), so name it first and look nowhere else.
  find_path(NCCL_INCLUDE_DIR nccl.h PATHS ${NCCL_PYTHON_ROOT}/include NO_DEFAULT_PATH)
  find_library(NCCL_LIBRARY NAMES libnccl.so.2 nccl PATHS ${NCCL_PYTHON_ROOT}/lib NO_DEFAULT_PATH)
endif()
set(_nccl_hints ${NCCL_ROOT} $ENV{NCCL_ROOT})
find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${_nccl_hints} PATH_SUFFIXES include
          PATHS ${CUDAToolkit_INCLUDE_DIRS} /usr/include /usr/local/cuda/include)
find_library(NCCL_LIBRARY NAMES nccl libnccl.so.2 NAMES_PER_DIR HINTS ${_nccl_hints} PATH_SUFFIXES lib lib64
             PATHS /usr/lib/x86_64-linux-gnu /usr/local/cuda/lib64)
include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(NCCL DEFAULT_MSG NCCL_INCLUDE_DIR NCCL_LIBRARY)
if(NCCL_FOUND AND NOT TARGET NCCL::NCCL)
  add_library(NCCL::NCCL UNKNOWN IMPORTED)
  set_target_properties(NCCL::NCCL PROPERTIES IMPORTED_LOCATION ${NCCL_LIBRARY}
                        INTERFACE_INCLUDE_DIRECTORIES ${NCCL_INCLUDE_DIR})
endif()
