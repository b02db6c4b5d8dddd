// The core's buffers as ATen tensors (views, nothing copied), for the Gloo
// transport's calls into torch. Included only by the Gloo transport's files.
#pragma once

#include <ATen/ATen.h>

#include "common/types.h"

namespace hvdz {

inline at::ScalarType ToScalar(DataType t) {
  switch (t) {
    case DataType::kUInt8: return at::kByte;
    case DataType::kInt8: return at::kChar;
    case DataType::kInt32: return at::kInt;
    case DataType::kInt64: return at::kLong;
    case DataType::kFloat16: return at::kHalf;
    case DataType::kBFloat16: return at::kBFloat16;
    case DataType::kFloat32: return at::kFloat;
    case DataType::kFloat64: return at::kDouble;
    case DataType::kInt16: return at::kShort;
  }
  return at::kFloat;
}

inline at::Tensor Wrap(const void* p, int64_t count, DataType t) {
  return at::from_blob(const_cast<void*>(p), {count}, at::TensorOptions().dtype(ToScalar(t)));
}

}  // namespace hvdz
