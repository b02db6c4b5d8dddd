// The Runtime owns every part of the core (queue, handles, controller, executor,
// device contexts, timeline, counters) and the background thread that alone
// talks to other ranks. Framework threads only enqueue and wait.
#pragma once

#include <atomic>
#include <memory>
#include <thread>
#include <unordered_map>

#include "common/logging.h"
#include "common/params.h"
#include "common/timeline.h"
#include "negotiation/controller.h"
#include "ops/counters.h"
#include "ops/device_context.h"
#include "ops/executor.h"
#include "ops/gpu_support.h"
#include "runtime/handle_table.h"
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
  Runtime(const WorldInfo& world, const Params& params, std::unique_ptr<ControlPlane> control,
          std::unique_ptr<Communicator> cpu_comm, std::unique_ptr<Allocator> alloc);
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  Status Start();
  // All entries or none are accepted; *handles gets one handle per entry.
  // `cuda_stream` is the producer stream of CUDA inputs (ignored for CPU ones).
  Status Enqueue(std::vector<TensorEntry> entries, void* cuda_stream, std::vector<int64_t>* handles);
  // join(): this rank has no more data. The handle completes once every rank has
  // joined, after `last_joined` (an int32 scalar on the host) was set to the rank
  // that joined last; meanwhile this rank takes part in the others' allreduces with
  // zeros, made on `cuda_device` (>= 0) for CUDA ones. See [Note: join].
  Status EnqueueJoin(int cuda_device, const TensorDesc& last_joined, std::shared_ptr<void> keepalive,
                     int64_t* handle);
  HandleTable& handles() { return handles_; }
  // Asks every rank to stop and waits for the background thread.
  void Shutdown();

  const WorldInfo& world() const { return world_; }
  const Params& params() const { return params_; }
  const Logger& logger() const { return logger_; }
  Counters& counters() { return counters_; }
  bool has_cuda() const { return gpu_ != nullptr; }
  uint64_t slow_path_cycles() const { return controller_.slow_path_cycles(); }
  int64_t cpu_fusion_buffer_bytes() const { return cpu_ctx_.buffer_bytes(); }
  const char* control_plane_kind() const { return control_->kind(); }

 private:
  void Loop();
  void Execute(const CycleResult& result, Clock::time_point negotiated);
  void ExecuteGroup(const std::vector<const Response*>& group, bool joined, Clock::time_point negotiated);
  // runtime_join.cc: this joined rank's zeros for an allreduce it did not submit,
  // and join()'s return.
  Status StandIn(const Response& r, TensorEntry* e);
  void CompleteJoin(int last_joined);
  // Why the loop stopped when other ranks asked it to.
  Status PeersLeft(const std::vector<int>& ranks);
  // How long to sleep after a cycle; `busy`: the cycle had work on any rank. Going
  // idle frees the CPU fusion buffer.
  Clock::duration NextWait(bool busy, Clock::duration* idle_period);
  void LogGroup(const std::vector<const Response*>& group) const;
  Status ContextFor(const TensorEntry& e, DeviceContext** ctx);
  Status CheckDevice(const TensorEntry& e);

  WorldInfo world_;
  Params params_;
  Logger logger_;
  Timeline timeline_;
  Counters counters_;
  std::unique_ptr<ControlPlane> control_;
  std::unique_ptr<Communicator> cpu_comm_;
  std::unique_ptr<Allocator> alloc_;
  std::unique_ptr<GpuSupport> gpu_;
  TensorQueue queue_;
  HandleTable handles_;
  Controller controller_;
  Executor executor_;
  CpuContext cpu_ctx_;
  std::unordered_map<int, std::unique_ptr<DeviceContext>> cuda_ctx_;
  std::atomic<int> cuda_device_{-2};  // the one CUDA device this process uses; -2: none yet
  std::atomic<int> join_device_{kCpuDevice};  // join()'s device for CUDA zeros
  std::atomic<bool> shutdown_requested_{false};
  std::thread thread_;
};

}  // namespace hvdz
