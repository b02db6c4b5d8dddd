#include "cuda_stream.h"

namespace hvdz {
void* CurrentCudaStream(int) { return nullptr; }
std::shared_ptr<void> UseCudaStream(int, void*) { return nullptr; }
void RecordStream(const at::Tensor&, void*) {}
}  // namespace hvdz
