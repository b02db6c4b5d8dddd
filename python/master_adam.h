// _core.master_adam_step (master_adam_cuda.cc; csrc/cuda/master_adam.h) and
// _core.HAVE_MASTER_ADAM: false where the module is built without CUDA.
#pragma once

namespace pybind11 {
class module_;
}

namespace hvdz {
void RegisterMasterAdam(pybind11::module_& m);
}
