# Finds liburing (io_uring's user-space library), preferring the static liburing.a
# so that the extension needs nothing from it at run time. HVDZ_LIBURING_ROOT (a
# CMake variable or an environment variable) names a directory with include/ and
# lib/, searched before the system: test/gpu/liburing_deps.sh fills one for machines
# without a package manager.
#   Liburing_FOUND, LIBURING_INCLUDE_DIR, LIBURING_LIBRARY, target Liburing::Liburing
set(_uring_hints ${HVDZ_LIBURING_ROOT} $ENV{HVDZ_LIBURING_ROOT})
if(_uring_hints)
  find_path(LIBURING_INCLUDE_DIR liburing.h HINTS ${_uring_hints} PATH_SUFFIXES include usr/include NO_DEFAULT_PATH)
  find_library(LIBURING_LIBRARY NAMES liburing.a uring NAMES_PER_DIR HINTS ${_uring_hints}
               PATH_SUFFIXES lib lib64 usr/lib/x86_64-linux-gnu NO_DEFAULT_PATH)
endif()
find_path(LIBURING_INCLUDE_DIR liburing.h)
find_library(LIBURING_LIBRARY NAMES liburing.a uring NAMES_PER_DIR)
include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(Liburing DEFAULT_MSG LIBURING_INCLUDE_DIR LIBURING_LIBRARY)
if(Liburing_FOUND AND NOT TARGET Liburing::Liburing)
  add_library(Liburing::Liburing UNKNOWN IMPORTED)
  set_target_properties(Liburing::Liburing PROPERTIES IMPORTED_LOCATION ${LIBURING_LIBRARY}
                        INTERFACE_INCLUDE_DIRECTORIES ${LIBURING_INCLUDE_DIR})
endif()
