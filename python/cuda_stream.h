// The framework's current CUDA stream on `device` (nullptr without CUDA): the
// stream whose work must finish before a collective may read its input.
#pragma once

#include <memory>

namespace at {
class Tensor;
}

namespace hvdz {
void* CurrentCudaStream(int device);
// Makes `stream` the current CUDA stream of `device` until the result is dropped, so
// that torch's caching allocator ties what is allocated meanwhile to that stream.
std::shared_ptr<void> UseCudaStream(int device, void* stream);
// Keeps the caching allocator from reusing `t`'s memory, once it is freed, before the
// work queued on `stream` by then has run (torch's Tensor.record_stream).
void RecordStream(const at::Tensor& t, void* stream);
// Makes the current CUDA stream of `device` wait, on the GPU, for `event` (a cudaEvent_t).
void CurrentStreamWaitEvent(int device, void* event);
}
