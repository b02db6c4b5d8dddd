#include "runtime/runtime.h"

#include <algorithm>
#include <chrono>

#include "common/thread_affinity.h"
#include "common/thread_timing.h"
#include "fusion/fusion_plan.h"
#include "runtime/device_maps.h"

namespace hvdz {

Runtime::Runtime(const WorldInfo& world, const Params& params, std::unique_ptr<ControlPlane> control,
                 std::unique_ptr<Communicator> cpu_comm, std::unique_ptr<Allocator> alloc)
    : world_(world),
      params_(params),
      logger_(params.log_level, world.rank),
      control_kind_(control->kind()),
      alloc_(std::move(alloc)),
      gpu_(MakeGpuSupport(params_, logger_)),
      fusion_threshold_bytes_(params.fusion_threshold_bytes),
      cycle_time_ms_(params.cycle_time_ms) {
  if (params.autotune) {
    tuned_ = std::make_unique<TunedHistory>(StartingValues(params));
    if (world.rank == 0) tuner_ = std::make_unique<Autotuner>(params_, logger_);
  }
  std::vector<int> everyone(world.size);
  for (int r = 0; r < world.size; ++r) everyone[r] = r;
  sets_[0] = std::make_unique<ProcessSet>(0, std::move(everyone), world.rank, params_, logger_, std::move(control),
                                          std::move(cpu_comm), *alloc_, timeline_, counters_);
}

uint64_t Runtime::slow_path_cycles() const {
  std::shared_lock<std::shared_mutex> lk(sets_mu_);
  return sets_.at(0)->controller().slow_path_cycles();
}

int64_t Runtime::cpu_fusion_buffer_bytes() const {
  std::shared_lock<std::shared_mutex> lk(sets_mu_);
  int64_t bytes = 0;
  for (const auto& kv : sets_)
    if (kv.second->included()) bytes += kv.second->cpu().buffer_bytes();
  return bytes;
}

Runtime::~Runtime() { Shutdown(); }

Status Runtime::Start() {
  // Like Horovod, rank 0 writes the timeline: one file, the coordinator's view.
  if (world_.rank == 0 && !timeline_.Open(params_.timeline_path, world_.rank, params_.timeline_mark_cycles))
    return Status::InvalidArgument("Cannot open HOROVOD_TIMELINE file '" + params_.timeline_path + "'.");
  if (tuner_) HVDZ_RETURN_IF_ERROR(tuner_->Open());
  thread_ = std::thread([this] {
    UseFineTimerSlack();
    // Pinned before it is named: a thread seen under its name is already where it runs.
    WarnIfUnpinned(PinThisThread(params_.thread_cpus), "hvdz-cycle", params_.thread_cpus, logger_);
    NameThisThread("hvdz-cycle");
    Loop();
  });
  return Status::OK();
}

void Runtime::Shutdown() {
  shutdown_requested_ = true;
  queue_.Wake();
  if (thread_.joinable()) thread_.join();
  // After a communication failure, collectives in flight may wait for a dead peer until the
  // transport timeout: they are aborted, so that shutdown() (and the peers waiting on this
  // rank's transport) go on at once, as hvd.elastic's reset needs.
  if (failed_)
    for (auto& kv : sets_) kv.second->AbortCuda();
  for (auto& kv : sets_) kv.second->DropCuda();  // drains in-flight CUDA work before the communicators go
  timeline_.Close();
}

// See [Note: timeline at run time]. Like Horovod, only rank 0 writes a timeline.
Status Runtime::SetTimeline(const std::string& path, bool mark_cycles) {
  if (world_.rank != 0) return Status::OK();
  // A cycle may wait on the other ranks up to the transport timeout.
  const auto timeout = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(params_.transport_timeout_seconds + 5.0));
  return timeline_.Switch(path, mark_cycles, [this] { queue_.Wake(); }, timeout);
}

namespace {

std::string DeviceName(const Request& r) { return r.on_cuda() ? "cuda:" + std::to_string(r.device) : "cpu"; }

}  // namespace

// One grouped op is negotiated as one, but its host tensors would go to Gloo and its
// device tensors to NCCL, and one ready event orders only one device's stream: so a
// group holds the tensors of one device. Checked before CUDA's availability, so that
// the refusal is the same on every machine.
Status Runtime::CheckDevices(const std::vector<TensorEntry>& entries) {
  if (entries.empty()) return Status::OK();
  const Request& first = entries.front().request;
  for (const auto& e : entries) {
    if (e.request.device == first.device) continue;
    return Status::InvalidArgument("Tensors '" + first.name + "' (" + DeviceName(first) + ") and '" + e.request.name +
                                   "' (" + DeviceName(e.request) + ") are in one grouped op. Group the tensors of "
                                   "each device separately.");
  }
  if (!first.on_cuda()) return Status::OK();
  if (!gpu_) {
    return Status::InvalidArgument("Tensor '" + first.name +
                                   "' is on CUDA, but this process has no CUDA support: horovod_zero was built "
                                   "without CUDA, or no GPU is visible. Rebuild on a machine with the CUDA "
                                   "toolkit and NCCL, or move the tensor to the CPU.");
  }
  int expected = -2;
  cuda_device_.compare_exchange_strong(expected, first.device);
  return Status::OK();
}

Status Runtime::Enqueue(std::vector<TensorEntry> entries, void* cuda_stream, std::vector<int64_t>* handles) {
  auto now = Clock::now();
  std::shared_ptr<void> ready;
  HVDZ_RETURN_IF_ERROR(CheckDevices(entries));
  for (auto& e : entries) {
    if (e.request.on_cuda() && !ready) HVDZ_RETURN_IF_ERROR(gpu_->RecordReadyEvent(e.request.device, cuda_stream, &ready));
  }
  // Held until the entries are queued, so that a set removed meanwhile fails them
  // (Remove takes the lock) rather than leaving them waiting for nothing.
  std::shared_lock<std::shared_mutex> sets_lock(sets_mu_);
  for (auto& e : entries) HVDZ_RETURN_IF_ERROR(Admit(&e.request));
  std::vector<int64_t> hs;
  for (auto& e : entries) {
    int64_t h = handles_.Allocate(e.keepalive);
    hs.push_back(h);
    e.enqueued = now;
    if (e.request.on_cuda()) e.ready_event = ready;
    e.callback = [this, h](const Status& s, std::shared_ptr<void> keep) { handles_.MarkDone(h, s, std::move(keep)); };
    if (e.request.on_cuda()) e.launched = [this, h](std::shared_ptr<void> ev) { handles_.MarkLaunched(h, std::move(ev)); };
  }
  // A stopped runtime refuses everything: say which tensor was refused.
  const std::string first = entries.empty() ? std::string() : entries.front().request.name;
  Status s = queue_.Add(std::move(entries));
  if (!s.ok()) {
    for (auto h : hs) handles_.Release(h);
    return s.type() == StatusType::kAborted ? Status::Aborted("Cannot submit '" + first + "': " + s.reason()) : s;
  }
  *handles = std::move(hs);
  return Status::OK();
}

Status Runtime::ContextFor(ProcessSet& ps, const Response& r, int* device, DeviceContext** ctx) {
  *device = kCpuDevice;
  if (!r.on_cuda) {
    *ctx = &ps.cpu();
    return Status::OK();
  }
  if (auto* m = ps.FindCuda(r.devices)) {
    *device = m->device;
    *ctx = m->ctx.get();
    return Status::OK();
  }
  // A new device map, which all the set's ranks reach at the same point.
  Status can = NewMapDevice(ps, r, device);
  // Every rank says whether it can take part, so that none waits in the NCCL id's
  // broadcast for one that cannot: they all fail together instead.
  std::vector<uint8_t> all;
  HVDZ_RETURN_IF_ERROR(ps.control().Allgather({static_cast<uint8_t>(can.ok())}, &all));
  if (!can.ok()) return can;
  std::vector<int> cannot;
  for (size_t q = 0; q < all.size(); ++q)
    if (all[q] == 0) cannot.push_back(ps.scope().World(static_cast<int>(q)));
  if (!cannot.empty()) {
    return Status::PreconditionError("The CUDA " + std::string(OpTypeName(r.op)) + " of '" + r.name + "'" +
                                     ps.scope().Where() + " cannot run: ranks " + RankList(cannot) + " cannot take "
                                     "part on a GPU (their own error says why).");
  }
  std::unique_ptr<DeviceContext> c;
  HVDZ_RETURN_IF_ERROR(gpu_->CreateContext(*device, ps.control(), *alloc_, &c));
  HVDZ_LOG(logger_, kDebug) << "NCCL communicator of " << ps.scope().Name() << " on cuda:" << *device
                            << " created, for devices " << ShapeString(std::vector<int64_t>(r.devices.begin(), r.devices.end()));
  *ctx = c.get();
  ps.AddCuda(r.devices, *device, std::move(c));
  return Status::OK();
}

Status Runtime::NewMapDevice(ProcessSet& ps, const Response& r, int* device) const {
  if (!gpu_) {
    return Status::Error("Rank " + std::to_string(world_.rank) + " cannot run the CUDA " + OpTypeName(r.op) +
                         " of '" + r.name + "'" + ps.scope().Where() + ": this process has no CUDA support.");
  }
  const int mine = ps.rank() < static_cast<int>(r.devices.size()) ? r.devices[ps.rank()] : -1;
  if (mine >= 0) {
    *device = mine;
    return Status::OK();
  }
  // This rank joined and did not submit the tensor: it stands in on a GPU of its own.
  std::vector<int> preferred{join_device_.load()};
  for (const auto& m : ps.cuda_maps()) preferred.push_back(m.device);
  preferred.push_back(cuda_device_.load());
  preferred.push_back(world_.local_rank % std::max(1, gpu_->device_count()));  // hvd.device()
  *device = StandInDevice(r.devices, preferred, world_.local_size == world_.size, gpu_->device_count());
  if (*device < 0) {
    return Status::Error("Rank " + std::to_string(world_.rank) + " joined and has no GPU to add its zeros to the "
                         "allreduce of '" + r.name + "'" + ps.scope().Where() + " that the other ranks do not use: "
                         "pass hvd.join(device=...).");
  }
  return Status::OK();
}

// Which tensors run as one collective, and on which transport.
void Runtime::LogGroup(const ProcessSet& ps, const std::vector<const Response*>& group) const {
  const Response& r = *group.front();
  int64_t elems = 0;
  for (const Response* g : group) {
    int64_t n = 1;
    for (auto d : g->shape) n *= d;
    elems += n;
  }
  HVDZ_LOG(logger_, kDebug) << "Fusion group: " << OpTypeName(r.op) << " of " << group.size() << " tensor(s) ("
                            << NameList(group, [](const Response* g) { return g->name; }) << "), " << elems
                            << " " << DataTypeName(r.out_dtype) << " elements (rank 0's shapes), over "
                            << (r.on_cuda ? "NCCL (CUDA)" : "Gloo (CPU)") << ps.scope().Where();
}

void Runtime::ExecuteGroup(ProcessSet& ps, const std::vector<const Response*>& group, bool joined,
                           Clock::time_point negotiated) {
  // Every rank resolves the group's device map, a joined one too: a new map is collective.
  int device = kCpuDevice;
  DeviceContext* ctx = nullptr;
  const Status ctx_status = ContextFor(ps, *group.front(), &device, &ctx);
  std::vector<TensorEntry> entries;
  std::vector<const Response*> mine;
  auto now = Clock::now();
  for (const Response* r : group) {
    TensorEntry e;
    if (!queue_.Take(ps.id(), r->name, &e)) {
      // A joined rank has no entry for the others' allreduces: it adds zeros.
      Status s = !joined || r->op != OpType::kAllreduce
                     ? Status::Error("Response for '" + r->name + "', which this rank never submitted.")
                     : !ctx_status.ok() ? ctx_status
                                        : StandIn(*r, device, *ctx, &e);
      if (!s.ok()) {
        HVDZ_LOG(logger_, kError) << s.reason();
        continue;
      }
    }
    if (timeline_.enabled()) {
      // NEGOTIATE: until every rank had it; QUEUE: behind earlier groups of this cycle.
      timeline_.Span(r->name, "NEGOTIATE", e.enqueued, negotiated);
      timeline_.Span(r->name, "QUEUE", negotiated, now);
    }
    entries.push_back(std::move(e));
    mine.push_back(r);
  }
  if (entries.empty()) return;
  if (logger_.Enabled(LogLevel::kDebug)) LogGroup(ps, mine);
  if (!ctx_status.ok()) {
    for (auto& e : entries) Complete(e, ctx_status);
    return;
  }
  ps.executor().Execute(*ctx, mine, std::move(entries));
}

void Runtime::Execute(ProcessSet& ps, const CycleResult& result, Clock::time_point negotiated) {
  const std::vector<Response>& responses = result.responses;
  for (const auto& r : responses) {
    if (r.ok()) continue;
    TensorEntry e;
    HVDZ_LOG(logger_, kDebug) << "Failing '" << r.name << "'" << ps.scope().Where() << ": " << r.error;
    if (queue_.Take(ps.id(), r.name, &e)) Complete(e, Status::PreconditionError(r.error));
  }
  // Each set fuses its own responses: tensors of two sets never share a collective.
  for (const auto& idx : PlanFusion(responses, fusion_threshold_bytes_)) {
    std::vector<const Response*> group;
    for (auto i : idx) group.push_back(&responses[i]);
    ExecuteGroup(ps, group, result.self_joined, negotiated);
  }
  if (result.join_done) CompleteJoin(result.last_joined);
}

Status Runtime::PeersLeft(const std::vector<int>& ranks) {
  const std::string who = ranks.size() == 1 ? "rank " + std::to_string(ranks[0]) : "ranks " + RankList(ranks);
  std::string waiting;
  for (const auto& name : queue_.PendingNames()) waiting += (waiting.empty() ? "'" : ", '") + name + "'";
  return Status::Aborted(
      "horovod_zero stopped: " + who + " shut down (called hvd.shutdown() or exited) while this rank " +
      (waiting.empty() ? std::string("had nothing waiting on it") : "was waiting on it for " + waiting) +
      ". Every rank must submit the same collectives. If ranks have different numbers of batches, call "
      "hvd.join() on each rank once it runs out of data: a joined rank takes part in the others' allreduces "
      "with zeros until every rank has joined.");
}

// [Note: idle backoff]
// A cycle costs every rank an exchange on the control plane (tens of microseconds
// of CPU, more over Gloo), so cycling every HOROVOD_CYCLE_TIME while nothing happens
// kept an idle rank at 5-25% of a core. While there is no work anywhere the idle
// period doubles from the cycle time up to kMaxIdlePeriod, and any work brings it
// back. This costs no latency: a rank wakes at once for its own new work, and an op
// cannot complete before its last rank submits it; the earlier ranks already wait
// in the exchange (the shared-memory plane sleeps on a futex there, see
// [Note: sleeping in a round]; Gloo waits in a blocking receive) and the last one
// joins them as soon as it submits. The exception, a rank that has joined and
// stands in for tensors it will never submit, counts as pending and never backs
// off (Controller::HasPending). A peer's idle sleep only delays what needs no new
// work from it: shutdown and stall reports, by at most kMaxIdlePeriod, a quarter of
// the shortest transport timeout (1 s) a waiting rank allows. At 250 ms an idle
// rank costs 0.3-0.8% of a core, most of it Gloo's own TCP loop; at 100 ms it was
// 0.5-2.8% (2 ranks, examples/bench_idle.py).
namespace {
constexpr std::chrono::milliseconds kMaxIdlePeriod(250);
// With process sets besides the global one: see [Note: process sets].
constexpr std::chrono::milliseconds kMaxIdlePeriodWithSets(10);
}  // namespace

Clock::duration Runtime::NextWait(bool busy, bool peers_pending, Clock::duration* idle_period) {
  const auto cycle = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double, std::milli>(cycle_time_ms_));
  // A rank whose tensors wait on other ranks cycles again within 50 us: they are
  // about to meet it in the next exchange. So does every rank while some rank waits
  // on another process set's work: that rank meets the others in every global cycle.
  bool pending = peers_pending;
  for (auto& kv : sets_) pending = pending || (kv.second->included() && kv.second->controller().HasPending());
  if (pending) return std::min<Clock::duration>(std::chrono::microseconds(50), cycle);
  if (busy) {
    *idle_period = Clock::duration::zero();
    return cycle;
  }
  const auto longest = sets_.size() > 1 ? kMaxIdlePeriodWithSets : kMaxIdlePeriod;
  const bool backing_off = *idle_period < longest;
  const auto wait = std::max(*idle_period, cycle);
  *idle_period = std::max<Clock::duration>(cycle, std::min<Clock::duration>(2 * wait, longest));
  if (backing_off && *idle_period >= longest) {
    HVDZ_LOG(logger_, kDebug) << "Idle: cycling every " << std::chrono::duration_cast<std::chrono::milliseconds>(longest).count()
                              << " ms until new work; freeing the CPU fusion buffers (" << cpu_fusion_buffer_bytes()
                              << " bytes)";
    // An idle job holds no buffer; the next op allocates what it needs.
    for (auto& kv : sets_)
      if (kv.second->included()) kv.second->cpu().Release();
  }
  return wait;
}

void Runtime::Loop() {
  Status stopped = Status::Aborted(
      "horovod_zero has been shut down: call hvd.init() again before submitting more collectives.");
  Clock::duration idle_period = Clock::duration::zero();
  while (true) {
    auto start = Clock::now();
    timeline_.StartCycle();
    CycleResult result;
    bool busy = false;
    Status s = RunCycles(queue_.PopNewRequests(), &busy, &result);
    if (!s.ok()) {
      failed_ = true;
      HVDZ_LOG(logger_, kError) << "Negotiation failed: " << s.reason();
      stopped = Status::Aborted("horovod_zero stopped after a communication failure (a peer may have "
                                "died or timed out after HOROVOD_GLOO_TIMEOUT_SECONDS=" +
                                std::to_string(static_cast<int>(params_.transport_timeout_seconds)) +
                                "): " + s.reason());
      break;
    }
    if (result.shutdown) {
      if (!shutdown_requested_) stopped = PeersLeft(result.shutdown_ranks);
      break;
    }
    if (tuner_) TuneAfterCycle(start);
    // New work starts a cycle at once (WaitForWork returns); see [Note: idle backoff].
    queue_.WaitForWork(start + NextWait(busy, result.peers_pending, &idle_period));
  }
  queue_.Close(stopped);
  timeline_.Orphan();
}

// [Note: arrivals] in negotiation/controller.h: each rank's submission, on the tensor's track.
void Runtime::MarkArrivals(const CycleResult& result) {
  for (const auto& a : result.arrivals) timeline_.RankReady(a.name, a.rank);
}

// See [Note: process sets]: the global set first (it carries shutdown, join and the
// set table's changes), then the other sets this rank is in, in id order.
Status Runtime::RunCycles(std::vector<Request> fresh, bool* busy, CycleResult* g) {
  *busy = !fresh.empty();
  std::map<int32_t, std::vector<Request>> by_set;
  bool elsewhere = PendingElsewhere();
  for (auto& r : fresh) {
    elsewhere = elsewhere || r.process_set != 0;
    by_set[r.process_set].push_back(std::move(r));
  }
  global().controller().TrackArrivals(timeline_.enabled());
  HVDZ_RETURN_IF_ERROR(global().controller().RunCycle(by_set[0], shutdown_requested_.load(), g, elsewhere));
  MarkArrivals(*g);
  ApplySetChanges(*g);
  if (!g->announcement.empty()) ApplyAnnouncement(*g);
  Execute(global(), *g, Clock::now());
  ObserveWork(global(), *g);
  *busy = *busy || g->slow_path || !g->responses.empty();
  if (g->shutdown) return Status::OK();
  for (auto& kv : sets_) {
    ProcessSet& ps = *kv.second;
    if (ps.id() == 0 || !ps.included()) continue;
    CycleResult result;
    ps.controller().TrackArrivals(timeline_.enabled());
    HVDZ_RETURN_IF_ERROR(ps.controller().RunCycle(by_set[ps.id()], false, &result));
    MarkArrivals(result);
    Execute(ps, result, Clock::now());
    ObserveWork(ps, result);
    *busy = *busy || result.slow_path || !result.responses.empty();
  }
  return Status::OK();
}

}  // namespace hvdz
