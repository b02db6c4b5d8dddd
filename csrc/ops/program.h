// [Note: executor programs]
// Every way the executor runs a group (a lone tensor where it lies, one fusion
// buffer, a direct group of calls) is first described as a Program: the copies in,
// the collective calls, the copies out, and the buffer size the counters report.
// The planner (planner.h) writes it; Executor runs every Program the same way:
// copy in, calls, count, copy out, with one timeline span per phase that has work.
// So the order of the phases, the counters and the spans are written once, and a
// new way of running a group is a new description, not a new sequence of steps.
#pragma once

#include <cstdint>
#include <vector>

#include "common/copy_desc.h"
#include "common/types.h"

namespace hvdz {

// The copies of one phase share source dtype, destination dtype and scale, so a
// device runs them as one batched launch.
struct CopyBatch {
  std::vector<CopyDesc> descs;
  DataType src = DataType::kFloat32;
  DataType dst = DataType::kFloat32;
  double scale = 1.0;
};

// One call into the communicator. count: per rank for allgather (sent) and
// reducescatter (received), the whole tensor otherwise; allreduce and broadcast
// work in `recv`. Alltoall: elements to and from each rank instead.
struct CollectiveCall {
  const void* send;
  void* recv;
  int64_t count;
  std::vector<int64_t> send_counts = {};
  std::vector<int64_t> recv_counts = {};
};

struct Program {
  OpType op = OpType::kAllreduce;
  ReduceOp reduce_op = ReduceOp::kSum;  // Average only where [Note: scale arithmetic] keeps it
  DataType wire = DataType::kFloat32;   // the dtype of every call
  int root = 0;                         // broadcast only
  bool on_cuda = false;                 // for the counters
  CopyBatch in;                         // before the calls: casts, prescale, into a buffer
  std::vector<CollectiveCall> calls;
  bool grouped = false;                 // the calls go inside one GroupStart/GroupEnd
  CopyBatch out;                        // after them: out of a buffer, postscale
  int64_t elems = 0;                    // elements the calls move (all ranks' segments), for the counters
};

// Address of element `elems` of a buffer of dtype `t`.
inline char* At(void* base, int64_t elems, DataType t) {
  return static_cast<char*>(base) + elems * static_cast<int64_t>(DataTypeSize(t));
}

}  // namespace hvdz
