// Runs one fused group: allocate outputs, wait for the inputs, have the planner
// describe the work as a Program, run it (see [Note: executor programs]), then
// hand the entries back.
#pragma once

#include <vector>

#include "common/message.h"
#include "common/tensor_entry.h"
#include "common/timeline.h"
#include "ops/counters.h"
#include "ops/device_context.h"
#include "ops/planner.h"
#include "ops/program.h"

namespace hvdz {

class Executor {
 public:
  // `direct_max_tensors` < 0: chosen from `size`, see [Note: direct groups].
  // `set_id`: the process set whose collectives it runs (counted under that id).
  Executor(int rank, int size, int direct_max_tensors, Timeline& timeline, Counters& counters, int set_id = 0)
      : rank_(rank), size_(size), set_id_(set_id), planner_(rank, size, direct_max_tensors), timeline_(timeline),
        counters_(counters) {}

  // `entries[i]` belongs to `group[i]`.
  void Execute(DeviceContext& ctx, const std::vector<const Response*>& group,
               std::vector<TensorEntry> entries);

 private:
  Status Run(DeviceContext& ctx, const std::vector<const Response*>& group, std::vector<TensorEntry>& entries);
  Status AllocateOutputs(DeviceContext& ctx, const std::vector<const Response*>& group,
                         std::vector<TensorEntry>& entries);
  // Copy in, calls, count, copy out; `start`: when the op's first phase began.
  Status RunProgram(DeviceContext& ctx, const Program& p, const std::vector<TensorEntry>& entries,
                    Clock::time_point start);
  void Mark(const std::vector<TensorEntry>& entries, const char* phase, Clock::time_point start);

  int rank_;
  int size_;
  int set_id_;
  Planner planner_;
  Timeline& timeline_;
  Counters& counters_;
};

}  // namespace hvdz
