// A communicator for runtimes of size 1: every collective leaves the data where it
// is (allgather and reducescatter copy between distinct buffers).
#pragma once

#include <cstring>
#include <vector>

#include "transport/communicator.h"

namespace hvdz {
namespace testing {

class LocalCommunicator : public Communicator {
 public:
  Status Allreduce(void*, int64_t, DataType, ReduceOp) override { return Status::OK(); }
  Status Allgather(const void* in, void* out, int64_t n, DataType t) override {
    if (in != out) std::memmove(out, in, n * DataTypeSize(t));
    return Status::OK();
  }
  Status ReduceScatter(const void* in, void* out, int64_t n, DataType t, ReduceOp) override {
    if (in != out) std::memmove(out, in, n * DataTypeSize(t));
    return Status::OK();
  }
  Status Broadcast(void*, int64_t, DataType, int) override { return Status::OK(); }
  Status Alltoall(const void* in, void* out, const std::vector<int64_t>& send, const std::vector<int64_t>&,
                  DataType t) override {
    if (in != out) std::memmove(out, in, send[0] * DataTypeSize(t));
    return Status::OK();
  }
};

}  // namespace testing
}  // namespace hvdz
