// Describes how one fused group runs, as a Program (see [Note: executor programs]):
// a lone tensor where it lies (plan_in_place.cc), a direct group of calls
// (plan_direct.cc, [Note: direct groups]), or one fusion buffer (plan_fused.cc,
// [Note: rank-major layout]). Planning takes the fusion buffer a program uses and
// nothing else: no copy and no call has run when it returns.
#pragma once

#include <vector>

#include "common/message.h"
#include "common/tensor_entry.h"
#include "ops/device_context.h"
#include "ops/program.h"

namespace hvdz {

class Planner {
 public:
  // `direct_max_tensors` < 0: chosen from `size`, see [Note: direct groups].
  Planner(int rank, int size, int direct_max_tensors);
  static int DefaultDirectMaxTensors(int size);

  // `entries[i]` belongs to `group[i]`, outputs allocated.
  Status Plan(DeviceContext& ctx, const std::vector<const Response*>& group,
              const std::vector<TensorEntry>& entries, Program* p) const;

 private:
  struct Group {
    const std::vector<const Response*>& responses;
    const std::vector<TensorEntry>& entries;
    const Response& head() const { return *responses.front(); }
  };
  // plan_in_place.cc: one tensor's copies and call without a fusion buffer.
  // `gather_in_place`: an allgather copies its input into its own slot of the output
  // even without a cast. `scaled_send`: where a reducescatter's prescaled input goes.
  bool LoneInPlace(const Group& g) const;
  void AppendInPlace(const Group& g, const TensorEntry& e, bool gather_in_place, char* scaled_send,
                     Program* p) const;
  // plan_fused.cc: entries `idx` through one fusion buffer and one call; `window`: an
  // allgather's buffer is the context's window instead.
  Status AppendFused(DeviceContext& ctx, const Group& g, const std::vector<size_t>& idx, Program* p,
                     bool window = false) const;
  // plan_direct.cc: large tensors in place, one grouped communicator launch.
  bool UseDirect(DeviceContext& ctx, const Group& g) const;
  Status PlanDirect(DeviceContext& ctx, const Group& g, Program* p) const;

  int rank_;
  int size_;
  int direct_max_tensors_;
};

// Whether every rank's part of `r` has the same size and dtype (allgather: equal
// dim 0 everywhere; reducescatter: dim 0 splits evenly, no cast), so the tensor can
// be the communicator's buffer itself.
bool EvenSplit(const Response& r, int size);

}  // namespace hvdz
