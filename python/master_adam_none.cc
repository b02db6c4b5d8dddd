// Built without CUDA: no master_adam_step; horovod_zero/torch/zero/core/master_adam.py
// then steps with torch's own kernel after casting the gradients.
#include "master_adam.h"

#include <pybind11/pybind11.h>

namespace hvdz {

void RegisterMasterAdam(pybind11::module_& m) { m.attr("HAVE_MASTER_ADAM") = false; }

}  // namespace hvdz
