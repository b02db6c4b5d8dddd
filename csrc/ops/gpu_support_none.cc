#include "ops/gpu_support.h"

namespace hvdz {

std::unique_ptr<GpuSupport> MakeGpuSupport(const Params&, const Logger&) { return nullptr; }

}  // namespace hvdz
