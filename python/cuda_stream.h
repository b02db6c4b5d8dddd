// The framework's current CUDA stream on `device` (nullptr without CUDA): the
// stream whose work must finish before a collective may read its input.
#pragma once

namespace hvdz {
void* CurrentCudaStream(int device);
}
