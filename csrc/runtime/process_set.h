// A process set: a subset of the job's ranks that runs collectives of its own, with
// Horovod's semantics (hvd.ProcessSet). The job's ranks as a whole are the global
// process set, id 0.
//
// [Note: process sets]
// Each set owns what negotiation and execution need, so that nothing is shared
// between sets but the queue and the handles: its control plane and CPU
// communicator (Gloo, a group of its own ranks), its Controller (response cache,
// coordinator at its rank 0, stall inspector naming its world ranks), its
// Executor (its rank and size) and its device contexts (one NCCL communicator per
// device map, see [Note: model parallelism] in runtime/device_maps.h). A tensor is named by its set and its name, so the same name in two
// sets is two tensors, and fusion never mixes sets: each set fuses its own
// response list.
//
// Ordering. One background thread runs every set. Each iteration it runs one
// cycle of the global set, then one of every other set this rank is in, in id
// order, and after each cycle executes what it negotiated. Every exchange and
// every collective of a set involves exactly its members, and every rank meets
// them in the same global order (iteration, then set id), so no two ranks can
// each wait for the other: the lowest pending exchange in that order has all its
// members at it. Sets that overlap therefore run in the same iteration, one after
// the other on the ranks they share, and disjoint ones at the same time. On a GPU
// every set's NCCL communicator uses the device's one collective stream, so the
// kernels run in the order they were issued, which is that same order (NCCL warns
// that communicators whose kernels run concurrently can deadlock).
//
// Every rank takes part in every global cycle, so a rank that is in no busy set
// still paces the others: a set's exchange waits for its members' global exchange,
// which waits for every rank. So a rank with new or waiting work in a set says so
// in its global header, and while any rank does, every rank cycles again within
// 50 us, like a rank with work of its own; and while the job has sets besides the
// global one the idle period stops at 10 ms instead of 250 ms (Runtime::NextWait),
// which bounds how long a set's first op after an idle spell waits for the others
// to wake.
//
// Adding and removing sets. The set table must change on every rank at the same
// point of that order, or members would wait in a set's exchange that another
// member does not run yet. hvd.add_process_set() and remove_process_set() are
// collective over all ranks (as in Horovod): the Python layer first checks with an
// allgather that every rank asks for the same change, members then build the
// set's transports, and the change itself rides on a one-element broadcast in the
// global set named "hvd.process_set.add.<id>" (or ".remove."). Every rank reaches
// that response in the same global cycle and applies the change there, before the
// broadcast completes, so a set is usable as soon as add_process_set() returns.
// Removal fails the set's pending ops and drops its transports. (A broadcast, not
// an allreduce: a joined rank stands in for missing allreduces, and a set change
// must not happen without a rank.)
//
// A rank outside a set that calls a collective on it is refused at the call.
// hvd.join() concerns the global set only.
#pragma once

#include <cstdint>
#include <memory>
#include <unordered_map>
#include <vector>

#include "common/logging.h"
#include "common/params.h"
#include "common/set_scope.h"
#include "common/timeline.h"
#include "negotiation/controller.h"
#include "ops/counters.h"
#include "ops/device_context.h"
#include "ops/executor.h"
#include "runtime/device_maps.h"
#include "transport/communicator.h"
#include "transport/control_plane.h"

namespace hvdz {

class ProcessSet {
 public:
  // `world_ranks`: sorted, distinct. On a member, `control` and `cpu_comm` connect
  // the set's ranks; elsewhere they are null and the set only answers questions.
  ProcessSet(int32_t id, std::vector<int> world_ranks, int world_rank, const Params& params, const Logger& log,
             std::unique_ptr<ControlPlane> control, std::unique_ptr<Communicator> cpu_comm, Allocator& alloc,
             Timeline& timeline, Counters& counters);
  ~ProcessSet();
  ProcessSet(const ProcessSet&) = delete;
  ProcessSet& operator=(const ProcessSet&) = delete;

  int32_t id() const { return scope_.id; }
  const std::vector<int>& world_ranks() const { return world_ranks_; }
  const SetScope& scope() const { return scope_; }
  bool included() const { return rank_ >= 0; }
  int rank() const { return rank_; }  // this process's rank in the set; -1 outside it
  int size() const { return static_cast<int>(world_ranks_.size()); }
  // The set rank of `world_rank`; -1 when it is not in the set.
  int SetRankOf(int world_rank) const;

  // Members only.
  ControlPlane& control() { return *control_; }
  Controller& controller() { return *controller_; }
  Executor& executor() { return *executor_; }
  CpuContext& cpu() { return *cpu_ctx_; }
  // The CUDA communicator that `devices` (a response's) runs on, or nullptr when it
  // needs a new one (see [Note: model parallelism] in runtime/device_maps.h).
  DeviceMap* FindCuda(const std::vector<int32_t>& devices);
  void AddCuda(std::vector<int32_t> devices, int device, std::unique_ptr<DeviceContext> ctx);
  const std::vector<DeviceMap>& cuda_maps() const { return cuda_; }
  // Drains and drops the CUDA contexts (in-flight work finishes first).
  void DropCuda() { cuda_.clear(); }
  // After a peer failed: in-flight CUDA work is ended, not waited for (DropCuda then returns at once).
  void AbortCuda() {
    for (auto& m : cuda_) m.ctx->Abort();
  }

 private:
  std::vector<int> world_ranks_;
  SetScope scope_;
  int rank_;
  std::unique_ptr<ControlPlane> control_;
  std::unique_ptr<Communicator> cpu_comm_;
  std::unique_ptr<Controller> controller_;
  std::unique_ptr<Executor> executor_;
  std::unique_ptr<CpuContext> cpu_ctx_;
  std::vector<DeviceMap> cuda_;  // in the order they were made, the same on every rank
};

}  // namespace hvdz
