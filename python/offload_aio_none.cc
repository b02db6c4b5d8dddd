// Built where liburing is missing: no AioFile, and horovod_zero/torch/zero/offload/nvme.py
// tells whoever asks for NVMe offload what to install.
#include "offload_aio.h"

namespace hvdz {

void RegisterOffloadAio(pybind11::module_& m) { m.attr("HAVE_LIBURING") = false; }

}  // namespace hvdz
