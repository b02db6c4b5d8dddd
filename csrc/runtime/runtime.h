// The Runtime owns every part of the core (queue, handles, process sets with
// their controllers, executors and device contexts, timeline, counters) and the
// background thread that alone talks to other ranks. Framework threads only
// enqueue and wait.
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <unordered_map>

#include "autotune/autotuner.h"
#include "autotune/tuned_values.h"
#include "common/logging.h"
#include "common/params.h"
#include "common/timeline.h"
#include "negotiation/controller.h"
#include "ops/counters.h"
#include "ops/device_context.h"
#include "ops/executor.h"
#include "ops/gpu_support.h"
#include "runtime/handle_table.h"
#include "runtime/process_set.h"
#include "runtime/tensor_queue.h"
#include "transport/communicator.h"
#include "transport/control_plane.h"

namespace hvdz {

struct WorldInfo {
  int rank = 0;
  int size = 1;
  int local_rank = 0;
  int local_size = 1;
  int cross_rank = 0;
  int cross_size = 1;
};

class Runtime {
 public:
  // `control` and `cpu_comm` connect every rank: the global process set's.
  Runtime(const WorldInfo& world, const Params& params, std::unique_ptr<ControlPlane> control,
          std::unique_ptr<Communicator> cpu_comm, std::unique_ptr<Allocator> alloc);
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  Status Start();
  // All entries or none are accepted; *handles gets one handle per entry.
  // `cuda_stream` is the producer stream of CUDA inputs (ignored for CPU ones).
  // Each request names its process set; its `root` is a world rank (a rank of the
  // set), which the runtime turns into the set's rank.
  Status Enqueue(std::vector<TensorEntry> entries, void* cuda_stream, std::vector<int64_t>* handles);
  // join(): this rank has no more data. The handle completes once every rank has
  // joined, after `last_joined` (an int32 scalar on the host) was set to the rank
  // that joined last; meanwhile this rank takes part in the others' allreduces with
  // zeros, made on `cuda_device` (>= 0) for CUDA ones. See [Note: join].
  Status EnqueueJoin(int cuda_device, const TensorDesc& last_joined, std::shared_ptr<void> keepalive,
                     int64_t* handle);
  HandleTable& handles() { return handles_; }

  // runtime_process_sets.cc, see [Note: process sets]. Collective over every rank
  // of the job: the handle completes once every rank has asked for the same change,
  // and from then on the set exists (or is gone) on every rank.
  // AddProcessSet: `world_ranks` sorted and distinct; on a member, `control` and
  // `cpu_comm` connect the set's ranks (null elsewhere).
  // `carrier`: a host int32 tensor of one element that the change's broadcast moves,
  // kept alive by `keepalive` (handed back by the handle, like an op's).
  Status AddProcessSet(int32_t id, std::vector<int> world_ranks, std::unique_ptr<ControlPlane> control,
                       std::unique_ptr<Communicator> cpu_comm, const TensorDesc& carrier,
                       std::shared_ptr<void> keepalive, int64_t* handle);
  Status RemoveProcessSet(int32_t id, const TensorDesc& carrier, std::shared_ptr<void> keepalive, int64_t* handle);
  // The set's size, or -1 when there is no such set.
  int ProcessSetSize(int32_t id) const;
  // hvd.start_timeline (a path) and stop_timeline (empty): rank 0 writes from the
  // next cycle on; returns once it does. Other ranks do nothing.
  Status SetTimeline(const std::string& path, bool mark_cycles);
  // Asks every rank to stop and waits for the background thread.
  void Shutdown();

  const WorldInfo& world() const { return world_; }
  const Params& params() const { return params_; }
  const Logger& logger() const { return logger_; }
  Counters& counters() { return counters_; }
  bool has_cuda() const { return gpu_ != nullptr; }
  // NCCL allgather windows held, see [Note: copy-engine allgather].
  int64_t gather_window_bytes() const { return gpu_ ? gpu_->window_bytes() : 0; }
  int gather_lanes() const { return gpu_ ? gpu_->gather_lanes() : 0; }
  uint64_t slow_path_cycles() const;  // the global set's
  int64_t cpu_fusion_buffer_bytes() const;  // every set's
  const char* control_plane_kind() const { return control_kind_; }
  // HOROVOD_AUTOTUNE: every setting announced so far; null without autotuning.
  const TunedHistory* tuned() const { return tuned_.get(); }
  // A ZeRO optimizer uses its bucket size / prefetch depth: rank 0's tuner may tune them.
  void UseZeroKnobs(bool bucket, bool prefetch);

 private:
  struct SetChange {
    int32_t id;
    std::unique_ptr<ProcessSet> added;  // null: remove set `id`
  };

  void Loop();
  // One cycle of every set this rank is in (see [Note: process sets]); *busy: any had work.
  Status RunCycles(std::vector<Request> fresh, bool* busy, CycleResult* g);
  void Execute(ProcessSet& ps, const CycleResult& result, Clock::time_point negotiated);
  void ExecuteGroup(ProcessSet& ps, const std::vector<const Response*>& group, bool joined,
                    Clock::time_point negotiated);
  ProcessSet& global() { return *sets_.at(0); }
  // runtime_process_sets.cc: the checks of an entry against its set, under a shared sets_mu_.
  Status Admit(Request* r) const;
  Status EnqueueSetChange(const std::string& name, SetChange change, const TensorDesc& carrier,
                          std::shared_ptr<void> keepalive, int64_t* handle);
  // The set changes whose carrier broadcast is in the global set's `result`.
  void ApplySetChanges(const CycleResult& result);
  void Activate(std::unique_ptr<ProcessSet> ps);
  void SplitCudaContexts(ProcessSet& ps);
  void Remove(int32_t id);
  // This rank waits on work in a set other than the global one.
  bool PendingElsewhere();
  // runtime_join.cc: this joined rank's zeros for an allreduce it did not submit,
  // and join()'s return.
  Status StandIn(const Response& r, int device, DeviceContext& ctx, TensorEntry* e);
  void CompleteJoin(int last_joined);
  // Why the loop stopped when other ranks asked it to.
  Status PeersLeft(const std::vector<int>& ranks);
  // How long to sleep after a cycle; `busy`: the cycle had work on any rank. Going
  // idle frees the CPU fusion buffer.
  // `peers_pending`: some rank waits on another process set's work.
  Clock::duration NextWait(bool busy, bool peers_pending, Clock::duration* idle_period);
  void LogGroup(const ProcessSet& ps, const std::vector<const Response*>& group) const;
  // The context that runs `r` on this rank, made with the set's other ranks for a new
  // device map (see [Note: model parallelism] in runtime/device_maps.h).
  Status ContextFor(ProcessSet& ps, const Response& r, int* device, DeviceContext** ctx);
  // This rank's device in a new map: its own in `r`, else (joined) one to stand in on.
  Status NewMapDevice(ProcessSet& ps, const Response& r, int* device) const;
  // One Enqueue's entries: CUDA support for CUDA tensors, and one device for them all.
  Status CheckDevices(const std::vector<TensorEntry>& entries);
  // Rank 0, with a timeline: each rank's submissions the cycle saw first ([Note: arrivals]).
  void MarkArrivals(const CycleResult& result);
  // runtime_autotune.cc, see [Note: autotuning]: rank 0's announcement put in force
  // on every rank (before the cycle's responses are fused), the tuner's view of the
  // work, and its decision after each loop iteration.
  void ApplyAnnouncement(const CycleResult& g);
  void ObserveWork(const ProcessSet& ps, const CycleResult& result);
  void TuneAfterCycle(Clock::time_point start);

  WorldInfo world_;
  Params params_;
  Logger logger_;
  Timeline timeline_;
  Counters counters_;
  const char* control_kind_;
  std::unique_ptr<Allocator> alloc_;
  std::unique_ptr<GpuSupport> gpu_;  // before the sets: their CUDA contexts use its streams
  TensorQueue queue_;
  HandleTable handles_;
  // By id, the global set (0) first. Changed only by the background thread, under
  // a unique lock; framework threads read it under a shared one.
  std::map<int32_t, std::unique_ptr<ProcessSet>> sets_;
  mutable std::shared_mutex sets_mu_;
  std::mutex changes_mu_;
  std::unordered_map<std::string, SetChange> changes_;  // by carrier name, until applied
  std::atomic<int> cuda_device_{-2};  // the first CUDA device this process used; -2: none yet
  std::atomic<int> join_device_{kCpuDevice};  // hvd.join(device=...) for CUDA zeros; -1: none given
  std::atomic<bool> shutdown_requested_{false};
  // The loop stopped on a communication failure (a peer died or timed out): Shutdown() aborts CUDA work.
  std::atomic<bool> failed_{false};
  // The fusion threshold and cycle time in force: the settings', or the tuner's.
  // Background thread only.
  int64_t fusion_threshold_bytes_;
  double cycle_time_ms_;
  std::unique_ptr<TunedHistory> tuned_;  // HOROVOD_AUTOTUNE only
  std::unique_ptr<Autotuner> tuner_;     // and on rank 0
  std::thread thread_;
};

}  // namespace hvdz
