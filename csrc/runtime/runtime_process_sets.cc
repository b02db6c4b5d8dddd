// The runtime's side of process sets (see [Note: process sets] in process_set.h):
// the checks of an entry against its set, and adding and removing sets at a
// global cycle every rank reaches together.
#include <algorithm>

#include "runtime/device_maps.h"
#include "runtime/runtime.h"

namespace hvdz {
namespace {

// The carriers' names: "hvd.process_set.add.<id>" and "hvd.process_set.remove.<id>".
constexpr char kChangePrefix[] = "hvd.process_set.";

std::string ChangeName(const char* what, int32_t id) { return std::string(kChangePrefix) + what + "." + std::to_string(id); }

}  // namespace

int Runtime::ProcessSetSize(int32_t id) const {
  std::shared_lock<std::shared_mutex> lk(sets_mu_);
  auto it = sets_.find(id);
  return it == sets_.end() ? -1 : it->second->size();
}

Status Runtime::Admit(Request* r) const {
  auto it = sets_.find(r->process_set);
  if (it == sets_.end()) {
    return Status::InvalidArgument(
        "Process set " + std::to_string(r->process_set) + " of tensor '" + r->name + "' does not exist: it was " +
        "removed (hvd.remove_process_set()), or never added. Register a set with hvd.init(process_sets=[...]) or "
        "hvd.add_process_set() before using it.");
  }
  const ProcessSet& ps = *it->second;
  if (!ps.included()) {
    return Status::InvalidArgument("Rank " + std::to_string(world_.rank) + " submitted the " + OpTypeName(r->op) +
                                   " of '" + r->name + "' on " + ps.scope().Name() + ", which it is not in. Only "
                                   "the set's ranks may call its collectives (test process_set.included() first).");
  }
  r->rank = ps.rank();
  if (r->op == OpType::kBroadcast) {
    const int root = ps.SetRankOf(r->root);
    if (root < 0) {
      return Status::InvalidArgument("root_rank " + std::to_string(r->root) + " of '" + r->name + "' is not in " +
                                     ps.scope().Name() + ". Pass the root's rank in the job (as hvd.rank() says "
                                     "on it), which must be one of the set's ranks.");
    }
    r->root = root;
  }
  return Status::OK();
}

Status Runtime::AddProcessSet(int32_t id, std::vector<int> world_ranks, std::unique_ptr<ControlPlane> control,
                              std::unique_ptr<Communicator> cpu_comm, const TensorDesc& carrier,
                              std::shared_ptr<void> keepalive, int64_t* handle) {
  if (id <= 0) return Status::InvalidArgument("Process set ids start at 1; 0 is the global set.");
  if (ProcessSetSize(id) >= 0) return Status::InvalidArgument("Process set " + std::to_string(id) + " exists already.");
  const bool sorted = std::adjacent_find(world_ranks.begin(), world_ranks.end(),
                                         [](int a, int b) { return a >= b; }) == world_ranks.end();
  if (world_ranks.empty() || !sorted || world_ranks.front() < 0 || world_ranks.back() >= world_.size) {
    return Status::InvalidArgument("A process set takes distinct ranks of the job, sorted, from 0 to " +
                                   std::to_string(world_.size - 1) + "; got " +
                                   ShapeString(std::vector<int64_t>(world_ranks.begin(), world_ranks.end())) + ".");
  }
  auto at = std::lower_bound(world_ranks.begin(), world_ranks.end(), world_.rank);
  const int set_rank = at != world_ranks.end() && *at == world_.rank ? static_cast<int>(at - world_ranks.begin()) : -1;
  const int set_size = static_cast<int>(world_ranks.size());
  if (set_rank >= 0 && !(control && cpu_comm && control->size() == set_size && control->rank() == set_rank)) {
    return Status::InvalidArgument("Process set " + std::to_string(id) + ": this rank is its rank " +
                                   std::to_string(set_rank) + " of " + std::to_string(set_size) +
                                   ", but its transports do not connect it so.");
  }
  auto ps = std::make_unique<ProcessSet>(id, std::move(world_ranks), world_.rank, params_, logger_,
                                         std::move(control), std::move(cpu_comm), *alloc_, timeline_, counters_);
  return EnqueueSetChange(ChangeName("add", id), SetChange{id, std::move(ps)}, carrier, std::move(keepalive), handle);
}

Status Runtime::RemoveProcessSet(int32_t id, const TensorDesc& carrier, std::shared_ptr<void> keepalive,
                                 int64_t* handle) {
  if (id == 0) return Status::InvalidArgument("The global process set cannot be removed.");
  if (ProcessSetSize(id) < 0) return Status::InvalidArgument("There is no process set " + std::to_string(id) + " to remove.");
  return EnqueueSetChange(ChangeName("remove", id), SetChange{id, nullptr}, carrier, std::move(keepalive), handle);
}

// The change waits under the carrier's name until its response arrives.
Status Runtime::EnqueueSetChange(const std::string& name, SetChange change, const TensorDesc& carrier,
                                 std::shared_ptr<void> keepalive, int64_t* handle) {
  if (carrier.dtype != DataType::kInt32 || carrier.numel() != 1 || carrier.device != kCpuDevice)
    return Status::InvalidArgument("A process set change is carried by a host int32 tensor of one element.");
  {
    std::lock_guard<std::mutex> lk(changes_mu_);
    if (!changes_.emplace(name, std::move(change)).second)
      return Status::InvalidArgument("'" + name + "' is in progress already; wait for it to finish.");
  }
  TensorEntry e;
  e.request.name = name;
  e.request.op = OpType::kBroadcast;
  e.request.dtype = e.request.out_dtype = DataType::kInt32;
  e.request.shape = carrier.shape;
  e.input = e.output = carrier;
  e.keepalive = std::move(keepalive);
  std::vector<TensorEntry> entries;
  entries.push_back(std::move(e));
  std::vector<int64_t> handles;
  Status s = Enqueue(std::move(entries), nullptr, &handles);
  if (!s.ok()) {
    std::lock_guard<std::mutex> lk(changes_mu_);
    changes_.erase(name);
    return s;
  }
  *handle = handles[0];
  return Status::OK();
}

// Before the global set's responses run: a set is there by the time its carrier
// completes, so the caller may use it as soon as add_process_set() returns.
void Runtime::ApplySetChanges(const CycleResult& result) {
  for (const auto& r : result.responses) {
    if (r.name.compare(0, sizeof(kChangePrefix) - 1, kChangePrefix) != 0) continue;
    SetChange change;
    {
      std::lock_guard<std::mutex> lk(changes_mu_);
      auto it = changes_.find(r.name);
      if (it == changes_.end()) continue;  // a tensor of the user's that happens to be named so
      change = std::move(it->second);
      changes_.erase(it);
    }
    if (!r.ok()) continue;  // the carrier fails with the coordinator's error, and nothing changes anywhere
    if (change.added) Activate(std::move(change.added));
    else Remove(change.id);
  }
}

void Runtime::Activate(std::unique_ptr<ProcessSet> ps) {
  ProcessSet& set = *ps;
  {
    std::unique_lock<std::shared_mutex> lk(sets_mu_);
    sets_[set.id()] = std::move(ps);
  }
  HVDZ_LOG(logger_, kDebug) << "Added " << set.scope().Name()
                            << (set.included() ? ", rank " + std::to_string(set.rank()) + " in it" : ", without this rank");
  SplitCudaContexts(set);
}

// Where the global set has a CUDA context, every rank is here in the same cycle, so
// the new set's NCCL communicator can be split from the global one (ncclCommSplit is
// collective over every rank of the global communicator). Otherwise, or where NCCL
// cannot split, the set creates its own on its first CUDA op (ContextFor).
void Runtime::SplitCudaContexts(ProcessSet& set) {
  if (!gpu_) return;
  // The global maps as the set's ranks see them, each split once: every rank computes
  // the same list, so every rank takes part in the same splits.
  std::vector<std::vector<int32_t>> split;
  for (const auto& m : global().cuda_maps()) {
    auto devices = ProjectDevices(m.devices, set.world_ranks());
    if (std::find(devices.begin(), devices.end(), -1) != devices.end() ||
        std::find(split.begin(), split.end(), devices) != split.end()) {
      continue;  // made while a member had joined, or another map's pairing: the set makes its own if used
    }
    split.push_back(devices);
    std::unique_ptr<DeviceContext> ctx;
    Status s = gpu_->SplitContext(*m.ctx, set.rank(), *alloc_, &ctx);
    if (!s.ok()) {
      HVDZ_LOG(logger_, kDebug) << "No NCCL communicator split for " << set.scope().Name() << " (" << s.reason()
                                << "); it creates its own on its first CUDA op";
      continue;
    }
    if (ctx) {
      HVDZ_LOG(logger_, kDebug) << "NCCL communicator of " << set.scope().Name() << " on cuda:" << m.device
                                << " split from the global one";
      set.AddCuda(std::move(devices), m.device, std::move(ctx));
    }
  }
}

void Runtime::Remove(int32_t id) {
  std::unique_ptr<ProcessSet> gone;
  {
    std::unique_lock<std::shared_mutex> lk(sets_mu_);
    auto it = sets_.find(id);
    if (it == sets_.end()) return;
    gone = std::move(it->second);
    sets_.erase(it);
  }
  // No entry of the set can be added any more (Enqueue holds the lock while it adds).
  queue_.FailSet(id, Status::Aborted(gone->scope().Name() + " was removed (hvd.remove_process_set()) before this "
                                     "op ran. Wait for a set's ops before removing it."));
  HVDZ_LOG(logger_, kDebug) << "Removed " << gone->scope().Name();
  gone.reset();  // drains its CUDA work, then closes its transports
}

bool Runtime::PendingElsewhere() {
  for (auto& kv : sets_)
    if (kv.first != 0 && kv.second->included() && kv.second->controller().HasPending()) return true;
  return false;
}

}  // namespace hvdz
