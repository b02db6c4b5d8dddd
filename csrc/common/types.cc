#include "common/types.h"

#include <sstream>

namespace hvdz {

size_t DataTypeSize(DataType t) {
  switch (t) {
    case DataType::kUInt8:
    case DataType::kInt8: return 1;
    case DataType::kInt16:
    case DataType::kFloat16:
    case DataType::kBFloat16: return 2;
    case DataType::kInt32:
    case DataType::kFloat32: return 4;
    case DataType::kInt64:
    case DataType::kFloat64: return 8;
  }
  return 0;
}

const char* DataTypeName(DataType t) {
  static const char* kNames[kNumDataTypes] = {"uint8",   "int8",     "int32",   "int64", "float16",
                                              "bfloat16", "float32", "float64", "int16"};
  auto i = static_cast<int>(t);
  return i < kNumDataTypes ? kNames[i] : "unknown";
}

bool IsFloatingPoint(DataType t) {
  return t == DataType::kFloat16 || t == DataType::kBFloat16 || t == DataType::kFloat32 ||
         t == DataType::kFloat64;
}

bool IsReducible(DataType t) { return t != DataType::kInt16; }

const char* ReduceOpName(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "Sum";
    case ReduceOp::kAverage: return "Average";
    case ReduceOp::kMin: return "Min";
    case ReduceOp::kMax: return "Max";
    case ReduceOp::kProduct: return "Product";
  }
  return "unknown";
}

const char* OpTypeName(OpType op) {
  switch (op) {
    case OpType::kAllreduce: return "allreduce";
    case OpType::kAllgather: return "allgather";
    case OpType::kReducescatter: return "reducescatter";
    case OpType::kBroadcast: return "broadcast";
    case OpType::kAlltoall: return "alltoall";
    case OpType::kJoin: return "join";
  }
  return "unknown";
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::ostringstream os;
  os << "[";
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << "]";
  return os.str();
}

int64_t NumElements(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return n;
}

}  // namespace hvdz
