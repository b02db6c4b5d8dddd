// _core.cpu_adam_step and _core.cpu_adam_isa (offload_adam.cc).
#pragma once

namespace pybind11 {
class module_;
}

namespace hvdz {
void RegisterOffloadAdam(pybind11::module_& m);
}
