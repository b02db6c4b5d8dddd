// NVMe offload's file I/O in the module: offload_aio.cc where liburing was found,
// offload_aio_none.cc (HAVE_LIBURING = False, no AioFile) where it was not.
#pragma once

#include <pybind11/pybind11.h>

namespace hvdz {

void RegisterOffloadAio(pybind11::module_& m);

}  // namespace hvdz
