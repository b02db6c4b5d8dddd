// The core's own small vocabulary of dtypes, ops and tensors, so that only the
// binding adapter and the Gloo transport ever include torch headers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace hvdz {

enum class DataType : uint8_t {
  kUInt8 = 0,
  kInt8,
  kInt32,
  kInt64,
  kFloat16,
  kBFloat16,
  kFloat32,
  kFloat64,
  kInt16,  // last so that the earlier values keep their numbers
};
constexpr int kNumDataTypes = 9;

size_t DataTypeSize(DataType t);
const char* DataTypeName(DataType t);
bool IsFloatingPoint(DataType t);
// Whether NCCL and Gloo can reduce this dtype: neither has int16 arithmetic, so
// int16 tensors are only moved (allgather, broadcast, alltoall), as bytes.
bool IsReducible(DataType t);

enum class ReduceOp : uint8_t { kSum = 0, kAverage, kMin, kMax, kProduct };
const char* ReduceOpName(ReduceOp op);

// kJoin is a request only (this rank called join()); it is never negotiated as a
// response: see [Note: join] in negotiation/join_tracker.h.
enum class OpType : uint8_t { kAllreduce = 0, kAllgather, kReducescatter, kBroadcast, kAlltoall, kJoin };
const char* OpTypeName(OpType op);

// -1 is the CPU; >= 0 is a CUDA device index.
constexpr int kCpuDevice = -1;

std::string ShapeString(const std::vector<int64_t>& shape);
int64_t NumElements(const std::vector<int64_t>& shape);

// A tensor as the core sees it: memory it does not own, described.
struct TensorDesc {
  void* data = nullptr;
  DataType dtype = DataType::kFloat32;
  std::vector<int64_t> shape;
  int device = kCpuDevice;

  int64_t numel() const { return NumElements(shape); }
  size_t bytes() const { return static_cast<size_t>(numel()) * DataTypeSize(dtype); }
};

}  // namespace hvdz
