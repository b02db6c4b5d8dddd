#include "runtime/process_set.h"

#include <algorithm>

namespace hvdz {

ProcessSet::ProcessSet(int32_t id, std::vector<int> world_ranks, int world_rank, const Params& params,
                       const Logger& log, std::unique_ptr<ControlPlane> control,
                       std::unique_ptr<Communicator> cpu_comm, Allocator& alloc, Timeline& timeline,
                       Counters& counters)
    : world_ranks_(std::move(world_ranks)),
      rank_(-1),
      control_(std::move(control)),
      cpu_comm_(std::move(cpu_comm)) {
  scope_.id = id;
  if (id != 0) scope_.world_ranks = world_ranks_;  // the global set's ranks are the world's
  rank_ = SetRankOf(world_rank);
  if (rank_ < 0) return;
  controller_ = std::make_unique<Controller>(*control_, params, log, scope_);
  executor_ = std::make_unique<Executor>(rank_, size(), params.direct_max_tensors, timeline, counters, id);
  // The CPU buffer grows to what ops ask for and is kept up to this size (a fused
  // reduce-scatter needs its threshold plus one segment: twice that), then freed when idle.
  cpu_ctx_ = std::make_unique<CpuContext>(*cpu_comm_, alloc, 2 * std::max<int64_t>(params.fusion_threshold_bytes, 8 << 20));
}

// The contexts go first: they drain CUDA work that may still use the communicators.
ProcessSet::~ProcessSet() { DropCuda(); }

int ProcessSet::SetRankOf(int world_rank) const {
  auto it = std::lower_bound(world_ranks_.begin(), world_ranks_.end(), world_rank);
  return it != world_ranks_.end() && *it == world_rank ? static_cast<int>(it - world_ranks_.begin()) : -1;
}

DeviceMap* ProcessSet::FindCuda(const std::vector<int32_t>& devices) {
  const int i = FindDeviceMap(cuda_, devices);
  return i < 0 ? nullptr : &cuda_[i];
}

void ProcessSet::AddCuda(std::vector<int32_t> devices, int device, std::unique_ptr<DeviceContext> ctx) {
  cuda_.push_back({std::move(devices), device, std::move(ctx)});
}

}  // namespace hvdz
