// pybind11 module horovod_zero._core: torch tensors in, TensorDesc to the core,
// handles back, and the one place where a Status becomes a Python exception.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include "common/params.h"
#include "fusion/cpu_cast.h"
#include "negotiation/shm_control_plane.h"
#include "runtime/runtime.h"
#include "transport/gloo/gloo_transport.h"
#include "cuda_stream.h"
#include "master_adam.h"
#include "offload_adam.h"
#include "offload_aio.h"

namespace py = pybind11;

namespace hvdz {
namespace {

// Raises `s` in Python: bad arguments as ValueError, the rest as `internal_error`
// (the module's HorovodInternalError).
void ThrowIfError(const Status& s, const py::object& internal_error) {
  if (s.ok()) return;
  if (s.type() == StatusType::kInvalidArgument) throw py::value_error(s.reason());
  PyErr_SetString(internal_error.ptr(), s.reason().c_str());
  throw py::error_already_set();
}

bool ToDataType(at::ScalarType t, DataType* out) {
  switch (t) {
    case at::kByte: *out = DataType::kUInt8; return true;
    case at::kChar: *out = DataType::kInt8; return true;
    case at::kShort: *out = DataType::kInt16; return true;
    case at::kInt: *out = DataType::kInt32; return true;
    case at::kLong: *out = DataType::kInt64; return true;
    case at::kHalf: *out = DataType::kFloat16; return true;
    case at::kBFloat16: *out = DataType::kBFloat16; return true;
    case at::kFloat: *out = DataType::kFloat32; return true;
    case at::kDouble: *out = DataType::kFloat64; return true;
    default: return false;
  }
}

at::ScalarType ToScalar(DataType t) {
  static const at::ScalarType kMap[kNumDataTypes] = {at::kByte,     at::kChar,  at::kInt,    at::kLong, at::kHalf,
                                                     at::kBFloat16, at::kFloat, at::kDouble, at::kShort};
  return kMap[static_cast<int>(t)];
}

TensorDesc Describe(const at::Tensor& t, DataType dt) {
  TensorDesc d;
  d.data = t.data_ptr();
  d.dtype = dt;
  d.shape.assign(t.sizes().begin(), t.sizes().end());
  d.device = t.is_cuda() ? t.device().index() : kCpuDevice;
  return d;
}

Status CheckTensor(const at::Tensor& t, const std::string& name, const char* role, DataType* dt) {
  if (!t.defined()) return Status::InvalidArgument("The " + std::string(role) + " of '" + name + "' is None.");
  if (!ToDataType(t.scalar_type(), dt))
    return Status::InvalidArgument("Tensor '" + name + "' has dtype " + std::string(c10::toString(t.scalar_type())) +
                                   "; supported: float32, float16, bfloat16, float64, int64, int32, int16, int8, uint8.");
  if (!t.is_cpu() && !t.is_cuda())
    return Status::InvalidArgument("Tensor '" + name + "' is on " + t.device().str() + "; only CPU and CUDA tensors are supported.");
  if (!t.is_contiguous())
    return Status::InvalidArgument("Tensor '" + name + "' is not contiguous; pass tensor.contiguous().");
  if (t.is_sparse()) return Status::InvalidArgument("Tensor '" + name + "' is sparse; pass a dense tensor.");
  return Status::OK();
}

// Memory from torch's allocators, so that fusion buffers and outputs show up in
// torch.cuda.memory_allocated() like every other tensor.
class TorchAllocator : public Allocator {
 public:
  Status Allocate(int device, DataType dtype, const std::vector<int64_t>& shape, TensorDesc* out,
                  std::shared_ptr<void>* holder) override {
    return Make(device, dtype, shape, /*zeros=*/false, out, holder);
  }
  Status AllocateOnStream(int device, int64_t bytes, void* stream, TensorDesc* out,
                          std::shared_ptr<void>* holder) override {
    auto scope = device == kCpuDevice || stream == nullptr ? nullptr : UseCudaStream(device, stream);
    return Allocate(device, DataType::kUInt8, {bytes}, out, holder);
  }
  // On CUDA the fill runs on `stream`, ahead of the collective that reads it.
  Status AllocateZeros(int device, DataType dtype, const std::vector<int64_t>& shape, void* stream, TensorDesc* out,
                       std::shared_ptr<void>* holder) override {
    auto scope = device == kCpuDevice || stream == nullptr ? nullptr : UseCudaStream(device, stream);
    return Make(device, dtype, shape, /*zeros=*/true, out, holder);
  }

 private:
  static Status Make(int device, DataType dtype, const std::vector<int64_t>& shape, bool zeros, TensorDesc* out,
                     std::shared_ptr<void>* holder) {
    try {
      auto opts = at::TensorOptions().dtype(ToScalar(dtype));
      opts = device == kCpuDevice ? opts.device(at::kCPU) : opts.device(at::Device(at::kCUDA, device));
      auto t = std::make_shared<at::Tensor>(zeros ? at::zeros(shape, opts) : at::empty(shape, opts));
      *out = Describe(*t, dtype);
      *holder = t;
      return Status::OK();
    } catch (const std::exception& e) {
      return Status::Error(std::string("Allocation failed: ") + e.what());
    }
  }
};

// What an entry keeps alive: the input, and the output once allocated. An
// alltoall also returns the rows received from each rank, as a tensor with
// `splits_options` made on the caller's thread.
struct Kept {
  at::Tensor input;
  at::Tensor output;
  void* stream = nullptr;  // the caller's CUDA stream at enqueue
  std::optional<at::TensorOptions> splits_options;
  std::vector<int64_t> received_splits;
};

struct OpArgs {
  int op;
  int reduce_op;
  double prescale;
  double postscale;
  int root;  // a rank of the job, in the process set
  std::optional<at::ScalarType> output_dtype;
  int process_set = 0;
};

Status Validate(const OpArgs& a, const std::string& name, DataType dt, DataType out_dt, const at::Tensor& t, int size) {
  const auto op = static_cast<OpType>(a.op);
  const bool reduces = op == OpType::kAllreduce || op == OpType::kReducescatter;
  if (reduces && !IsReducible(dt))
    return Status::InvalidArgument("Tensor '" + name + "' is " + DataTypeName(dt) + ", which can be gathered, broadcast "
                                   "and sent with alltoall but not reduced: neither NCCL nor Gloo has " +
                                   DataTypeName(dt) + " arithmetic (Horovod refuses it too). Reduce tensor.int() instead.");
  if (out_dt != dt && !(IsFloatingPoint(dt) && IsFloatingPoint(out_dt)))
    return Status::InvalidArgument("output_dtype casts between floating-point dtypes only (tensor '" + name + "').");
  if ((op == OpType::kAllgather || op == OpType::kReducescatter || op == OpType::kAlltoall) && t.dim() == 0)
    return Status::InvalidArgument(std::string(OpTypeName(op)) + " of '" + name + "' needs a tensor with at least one dimension.");
  if (op == OpType::kBroadcast && (a.root < 0 || a.root >= size))
    return Status::InvalidArgument("root_rank " + std::to_string(a.root) + " of '" + name + "' is not a rank of this job of size " + std::to_string(size) + ".");
  return Status::OK();
}

class PyRuntime {
 public:
  // `shm_name` non-empty: every rank is on this host, negotiate through shared memory.
  // `p`: the settings horovod_zero/settings.py read and validated.
  PyRuntime(py::object internal_error, GlooBackend backend, int rank, int size, int local_rank, int local_size,
            int cross_rank, int cross_size, const std::string& shm_name, const Params& p)
      : internal_error_(std::move(internal_error)) {
    std::string warnings;
    WorldInfo w{rank, size, local_rank, local_size, cross_rank, cross_size};
    std::unique_ptr<ControlPlane> control;
    if (!shm_name.empty()) {
      std::unique_ptr<ShmControlPlane> shm;
      Status s;
      {
        py::gil_scoped_release nogil;  // waits for the other ranks to attach
        s = ShmControlPlane::Create(shm_name, rank, size, p.transport_timeout_seconds, &shm);
      }
      if (s.ok()) control = std::move(shm);
      else warnings += "Negotiating over Gloo instead of shared memory: " + s.reason() + " ";
    }
    if (!control) control = MakeGlooControlPlane(backend, p.transport_timeout_seconds);
    rt_ = std::make_unique<Runtime>(w, p, std::move(control), MakeGlooCommunicator(backend, p.transport_timeout_seconds),
                                    std::make_unique<TorchAllocator>());
    if (!warnings.empty()) HVDZ_LOG(rt_->logger(), kWarning) << warnings;
    Check(rt_->Start());
  }

  // One call for single and grouped ops: the entries are accepted together or not at all.
  std::vector<int64_t> Enqueue(const OpArgs& a, const std::vector<at::Tensor>& inputs,
                               const std::vector<std::optional<at::Tensor>>& outputs,
                               const std::vector<std::string>& names) {
    if (inputs.size() != outputs.size() || inputs.size() != names.size())
      Check(Status::InvalidArgument("inputs, outputs and names must have the same length."));
    void* stream = nullptr;
    for (const auto& in : inputs)
      if (in.is_cuda()) {
        stream = CurrentCudaStream(in.device().index());
        break;
      }
    std::vector<TensorEntry> entries(inputs.size());
    for (size_t i = 0; i < inputs.size(); ++i)
      Check(MakeEntry(a, inputs[i], outputs[i], names[i], stream, &entries[i]));
    std::vector<int64_t> handles;
    Check(rt_->Enqueue(std::move(entries), stream, &handles));
    return handles;
  }

  int64_t EnqueueOne(const OpArgs& a, const at::Tensor& input, const std::optional<at::Tensor>& output,
                     const std::string& name) {
    void* stream = input.is_cuda() ? CurrentCudaStream(input.device().index()) : nullptr;
    std::vector<TensorEntry> entries(1);
    Check(MakeEntry(a, input, output, name, stream, &entries[0]));
    std::vector<int64_t> handles;
    Check(rt_->Enqueue(std::move(entries), stream, &handles));
    return handles[0];
  }

  py::object Wait(int64_t h) {
    Status s = WaitInterruptibly({h}).front();
    py::object out = TakeOutput(h);
    Check(s);
    return out;
  }

  // [Note: stream-ordered waits]
  // Waits only until the op is queued on the GPU, then makes the caller's current stream
  // on `device` wait for it there: the caller's later kernels read its outputs in order,
  // and the CPU keeps running ahead of the GPU instead of waiting for the op to run.
  // The handle stays valid: synchronize() still releases it and reports a later
  // failure. An op already done (every CPU op) needs no wait; one that failed before
  // launching raises here, and its handle still waits for synchronize().
  //
  // `let_go`: the handle stops holding the op's input and output, so that they are freed
  // when the caller drops them instead of at synchronize(); that is safe once the caller's
  // stream waits for the op, for memory the caching allocator hands out again on that
  // stream. Memory the caller may reuse on another stream (enqueued from one stream,
  // waited for from another) is recorded on the waiting stream first.
  void WaitStream(int64_t h, int device, bool let_go) {
    constexpr std::chrono::milliseconds kSlice(50);
    std::shared_ptr<void> event;
    Status s;
    while (true) {
      bool ready = false;
      {
        py::gil_scoped_release nogil;
        s = rt_->handles().WaitLaunchedUntil(h, std::chrono::steady_clock::now() + kSlice, &ready, &event);
      }
      if (ready) break;
      if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    }
    Check(s);
    if (event) CurrentStreamWaitEvent(device, event.get());
    if (let_go) LetGo(h, device, event != nullptr);
  }

  // WaitStream of many handles for one release of the GIL, and one stream wait per
  // distinct event: the tensors of one fused collective share its event. Every handle is
  // ordered (and let go) before the first failure, in order, is raised.
  void WaitStreamAll(const std::vector<int64_t>& hs, int device, bool let_go) {
    constexpr std::chrono::milliseconds kSlice(50);
    std::vector<std::shared_ptr<void>> events(hs.size());
    std::vector<Status> st(hs.size());
    size_t i = 0;
    while (i < hs.size()) {
      {
        py::gil_scoped_release nogil;
        const auto until = std::chrono::steady_clock::now() + kSlice;
        for (; i < hs.size(); ++i) {
          bool ready = false;
          st[i] = rt_->handles().WaitLaunchedUntil(hs[i], until, &ready, &events[i]);
          if (!ready) break;
        }
      }
      if (i < hs.size() && PyErr_CheckSignals() != 0) throw py::error_already_set();
    }
    const void* last = nullptr;
    for (size_t i = 0; i < hs.size(); ++i) {
      if (!st[i].ok()) continue;
      if (events[i] && events[i].get() != last) CurrentStreamWaitEvent(device, events[i].get());
      if (events[i]) last = events[i].get();
      if (let_go) LetGo(hs[i], device, events[i] != nullptr);
    }
    for (const auto& s : st) Check(s);
  }

  // WaitStream without waiting: orders the current stream after the op only if it is
  // queued on the GPU (or done) already, and says whether it did. ZeRO's overlap_step
  // asks at each gradient bucket, so that backward never waits for the runtime.
  bool TryWaitStream(int64_t h, int device) {
    std::shared_ptr<void> event;
    bool ready = false;
    Status s = rt_->handles().WaitLaunchedUntil(h, std::chrono::steady_clock::now(), &ready, &event);
    if (!ready) return false;
    Check(s);
    if (event) CurrentStreamWaitEvent(device, event.get());
    return true;
  }

  // [Note: letting go once queued]
  // For each op already queued on the GPU: the caller's current stream (a side stream it
  // keeps for this, so its compute stream never waits) waits for the op there, and the
  // handle lets go of its tensors, recorded on that stream. Dropped by the caller too, they
  // count as freed at once, and the caching allocator hands their memory out again only
  // once the op has run. ZeRO lets go of each reduce-scatter's full gradient this way: held
  // until the CPU saw the op finish, the gradients of every unit the CPU had queued ahead of
  // the GPU stayed allocated together. Returns, per handle, whether it is settled: let go,
  // failed (its failure waits for synchronize()) or released already; an op not queued yet
  // is left as it was. `stream` (a cudaStream_t; 0: the current one) is current for the call:
  // cheaper than torch.cuda.stream() around it, at every gradient bucket.
  std::vector<bool> TryLetGoAll(const std::vector<int64_t>& hs, int device, uintptr_t stream) {
    auto current = device >= 0 && stream != 0 ? UseCudaStream(device, reinterpret_cast<void*>(stream)) : nullptr;
    std::vector<bool> settled(hs.size(), false);
    const void* last = nullptr;
    for (size_t i = 0; i < hs.size(); ++i) {
      std::shared_ptr<void> event;
      bool ready = false;
      Status s = rt_->handles().WaitLaunchedUntil(hs[i], std::chrono::steady_clock::now(), &ready, &event);
      if (!ready) continue;
      settled[i] = true;
      if (!s.ok()) continue;
      if (event && event.get() != last) CurrentStreamWaitEvent(device, event.get());
      if (event) last = event.get();
      LetGo(hs[i], device, event != nullptr);
    }
    return settled;
  }

  // Many handles for few releases of the GIL. Every handle is waited for and
  // released before the first failure (in order) is raised, so none is left behind;
  // an interrupt (Ctrl-C) releases none of them.
  std::vector<py::object> WaitAll(const std::vector<int64_t>& hs) {
    std::vector<Status> st = WaitInterruptibly(hs);
    std::vector<py::object> out;
    out.reserve(hs.size());
    for (auto h : hs) out.push_back(TakeOutput(h));
    for (const auto& s : st) Check(s);
    return out;
  }

  // Alltoall: `splits[q]` rows of dim 0 go to rank q. The handle's result is
  // (output, received splits), the splits made like `splits_like` (int32 on the
  // host when None).
  int64_t EnqueueAlltoall(const at::Tensor& input, const std::vector<int64_t>& splits, const std::string& name,
                          const std::optional<at::Tensor>& splits_like, int process_set) {
    const OpArgs args{static_cast<int>(OpType::kAlltoall), static_cast<int>(ReduceOp::kSum), 1.0, 1.0, 0, std::nullopt,
                      process_set};
    void* stream = input.is_cuda() ? CurrentCudaStream(input.device().index()) : nullptr;
    std::vector<TensorEntry> entries(1);
    TensorEntry& e = entries[0];
    Check(MakeEntry(args, input, std::nullopt, name, stream, &e));
    Check(CheckSplits(splits, name, input.size(0), process_set));
    e.request.splits = splits;
    auto kept = std::static_pointer_cast<Kept>(e.keepalive);
    kept->splits_options = splits_like ? splits_like->options() : at::TensorOptions().dtype(at::kInt);
    std::weak_ptr<Kept> weak = kept;
    e.received_splits = [weak](const std::vector<int64_t>& received) {
      if (auto k = weak.lock()) k->received_splits = received;
    };
    std::vector<int64_t> handles;
    Check(rt_->Enqueue(std::move(entries), stream, &handles));
    return handles[0];
  }

  // join(): returns a handle whose result is the rank that joined last.
  int64_t Join(int device) {
    auto kept = std::make_shared<Kept>();
    kept->output = at::full({}, -1, at::TensorOptions().dtype(at::kInt));
    const TensorDesc out = Describe(kept->output, DataType::kInt32);
    int64_t h = 0;
    Check(rt_->EnqueueJoin(device, out, std::move(kept), &h));
    return h;
  }

  // Process sets (see [Note: process sets]); collective over every rank. On a
  // member, `backend` is a Gloo group of the set's ranks (rank = its place in the
  // set) and `shm_name` non-empty says to negotiate through shared memory. Returns
  // the handle of the change.
  int64_t AddProcessSet(int id, const std::vector<int>& ranks, const std::optional<GlooBackend>& backend,
                        const std::string& shm_name) {
    std::unique_ptr<ControlPlane> control;
    std::unique_ptr<Communicator> comm;
    if (backend) {
      const double timeout = rt_->params().transport_timeout_seconds;
      if (!shm_name.empty()) {
        std::unique_ptr<ShmControlPlane> shm;
        Status s;
        {
          py::gil_scoped_release nogil;  // waits for the set's other ranks to attach
          s = ShmControlPlane::Create(shm_name, (*backend)->getRank(), (*backend)->getSize(), timeout, &shm);
        }
        if (s.ok()) control = std::move(shm);
        else HVDZ_LOG(rt_->logger(), kWarning) << "Process set " << id << " negotiates over Gloo instead of shared memory: " << s.reason();
      }
      if (!control) control = MakeGlooControlPlane(*backend, timeout);
      comm = MakeGlooCommunicator(*backend, timeout);
    }
    auto kept = Carrier();
    int64_t h = 0;
    Check(rt_->AddProcessSet(id, ranks, std::move(control), std::move(comm), Describe(kept->output, DataType::kInt32),
                             kept, &h));
    return h;
  }

  int64_t RemoveProcessSet(int id) {
    auto kept = Carrier();
    int64_t h = 0;
    Check(rt_->RemoveProcessSet(id, Describe(kept->output, DataType::kInt32), kept, &h));
    return h;
  }

  bool Poll(int64_t h) {
    bool done = false;
    Check(rt_->handles().Poll(h, &done));
    return done;
  }

  void Shutdown() {
    py::gil_scoped_release nogil;
    rt_->Shutdown();
  }

  // hvd.start_timeline (a path) / stop_timeline (empty).
  void SetTimeline(const std::string& path, bool mark_cycles) {
    Status s;
    {
      py::gil_scoped_release nogil;  // until the background thread has switched
      s = rt_->SetTimeline(path, mark_cycles);
    }
    Check(s);
  }

  py::list Stats() {
    py::list out;
    for (const auto& kv : rt_->counters().Snapshot()) {
      py::dict d;
      d["process_set"] = std::get<0>(kv.first);
      d["op"] = OpTypeName(std::get<1>(kv.first));
      d["device"] = std::get<2>(kv.first) ? "cuda" : "cpu";
      d["dtype"] = DataTypeName(std::get<3>(kv.first));
      d["collectives"] = kv.second.collectives;
      d["tensors"] = kv.second.tensors;
      d["bytes"] = kv.second.bytes;
      out.append(d);
    }
    return out;
  }

  void ResetStats() { rt_->counters().Reset(); }

  // HOROVOD_AUTOTUNE: the settings of `generation` (-1: the newest this rank has), or
  // None without autotuning or before this rank has reached that generation.
  py::object Tuned(int64_t generation) {
    const TunedHistory* h = rt_->tuned();
    TunedValues v;
    if (h == nullptr || (generation >= 0 && !h->At(generation, &v))) return py::none();
    if (generation < 0) v = h->Latest(&generation);
    py::dict d;
    d["generation"] = generation;
    d["tuning"] = v.tuning;
    d["fusion_threshold"] = v.fusion_threshold_bytes;
    d["cycle_time_ms"] = v.cycle_time_ms;
    d["zero_bucket_bytes"] = v.zero_bucket_bytes;
    d["zero_prefetch"] = v.zero_prefetch;
    return d;
  }

  void UseZeroKnobs(bool bucket, bool prefetch) { rt_->UseZeroKnobs(bucket, prefetch); }

  py::dict Info() {
    const Params& p = rt_->params();
    py::dict d;
    py::object tuned = Tuned(-1);
    d["autotune"] = tuned;  // None without HOROVOD_AUTOTUNE
    // The settings in force: the tuner's, while it runs.
    d["fusion_threshold"] = p.fusion_threshold_bytes;
    d["cycle_time_ms"] = p.cycle_time_ms;
    if (!tuned.is_none()) {
      d["fusion_threshold"] = tuned["fusion_threshold"];
      d["cycle_time_ms"] = tuned["cycle_time_ms"];
    }
    d["cache_capacity"] = p.cache_capacity;
    d["timeline"] = p.timeline_path;
    d["timeline_mark_cycles"] = p.timeline_mark_cycles;
    d["stall_check_seconds"] = p.stall_check_seconds;
    d["stall_shutdown_seconds"] = p.stall_shutdown_seconds;
    d["gloo_timeout_seconds"] = p.transport_timeout_seconds;
    d["log_level"] = LogLevelName(p.log_level);
    d["direct_max_tensors"] = p.direct_max_tensors;
    d["copy_stream_bytes"] = p.copy_stream_bytes;
    d["ce_allgather_bytes"] = p.ce_allgather_bytes;
    d["gather_stream"] = p.gather_stream;
    d["thread_cpus"] = p.thread_cpus;  // HOROVOD_THREAD_AFFINITY, this rank's entry; empty: unpinned
    d["gather_lanes"] = rt_->gather_lanes();
    d["gather_window_bytes"] = rt_->gather_window_bytes();
    d["cuda"] = rt_->has_cuda();
    d["slow_path_cycles"] = rt_->slow_path_cycles();
    d["cpu_fusion_buffer_bytes"] = rt_->cpu_fusion_buffer_bytes();
    d["control_plane"] = rt_->control_plane_kind();
    return d;
  }

 private:
  // `stream`: the caller's current CUDA stream (nullptr for CPU inputs, and for the default stream).
  Status MakeEntry(const OpArgs& a, const at::Tensor& in, const std::optional<at::Tensor>& output,
                   const std::string& name, void* stream, TensorEntry* entry) {
    DataType dt;
    HVDZ_RETURN_IF_ERROR(CheckTensor(in, name, "input", &dt));
    DataType out_dt = dt;
    if (a.output_dtype && !ToDataType(*a.output_dtype, &out_dt))
      return Status::InvalidArgument("Unsupported output_dtype for '" + name + "'.");
    HVDZ_RETURN_IF_ERROR(Validate(a, name, dt, out_dt, in, rt_->world().size));
    TensorEntry& e = *entry;
    e.request.name = name;
    e.request.op = static_cast<OpType>(a.op);
    e.request.reduce_op = static_cast<ReduceOp>(a.reduce_op);
    e.request.dtype = dt;
    e.request.out_dtype = out_dt;
    e.request.device = in.is_cuda() ? in.device().index() : kCpuDevice;
    e.request.root = a.root;
    e.request.prescale = a.prescale;
    e.request.postscale = a.postscale;
    e.request.process_set = a.process_set;
    e.request.shape.assign(in.sizes().begin(), in.sizes().end());
    e.input = Describe(in, dt);
    // The input and the output live until the collective is done; then the handle
    // holds them until Wait takes the output (see HandleTable).
    auto kept = std::make_shared<Kept>();
    kept->input = in;
    kept->stream = stream;
    if (output) {
      DataType odt;
      HVDZ_RETURN_IF_ERROR(CheckTensor(*output, name, "output", &odt));
      if (output->device() != in.device() || odt != out_dt)
        return Status::InvalidArgument("The output of '" + name + "' must match the input's device and dtype.");
      kept->output = *output;
      e.output = Describe(kept->output, out_dt);
    } else {
      auto opts = in.options().dtype(ToScalar(out_dt));
      // A weak reference: the entry (and this function) may be destroyed on the
      // background thread, which must not drop the last reference to a tensor.
      std::weak_ptr<Kept> weak = kept;
      e.allocate_output = [weak, opts, out_dt, stream](const std::vector<int64_t>& shape, void* writer,
                                                        TensorDesc* out) {
        auto k = weak.lock();
        if (!k) return Status::Error("Output allocation after the op finished.");
        try {
          // [Note: output memory]
          // Allocated on the background thread, after the caller's ready event was
          // recorded, so memory tied to the caller's stream could be a block the caller
          // freed meanwhile with kernels still reading it. Tying it to the writer's stream
          // (the NCCL stream) gives only memory that stream's earlier work is done with;
          // recording the caller's stream keeps it from being reused, once the caller
          // frees it, before the caller's work queued by then has run.
          // (The caller's stream may be the default one, whose handle is nullptr.)
          const bool cuda = opts.device().is_cuda();
          auto scope = cuda ? UseCudaStream(opts.device().index(), writer) : nullptr;
          k->output = at::empty(shape, opts);
          if (cuda) RecordStream(k->output, stream);
        } catch (const std::exception& ex) {
          return Status::Error(std::string("Output allocation failed: ") + ex.what());
        }
        *out = Describe(k->output, out_dt);
        return Status::OK();
      };
    }
    e.keepalive = std::move(kept);
    return Status::OK();
  }

  // The one-element tensor a process set change moves (see Runtime::AddProcessSet).
  static std::shared_ptr<Kept> Carrier() {
    auto kept = std::make_shared<Kept>();
    kept->output = at::zeros({1}, at::TensorOptions().dtype(at::kInt));
    return kept;
  }

  Status CheckSplits(const std::vector<int64_t>& splits, const std::string& name, int64_t dim0, int process_set) const {
    // A set that does not exist is refused by Enqueue, with a message that says so.
    const int size = rt_->ProcessSetSize(process_set);
    int64_t sum = 0;
    for (auto s : splits) {
      if (s < 0) return Status::InvalidArgument("alltoall of '" + name + "': splits " + ShapeString(splits) + " has a negative count.");
      sum += s;
    }
    if (size >= 0 && static_cast<int>(splits.size()) != size)
      return Status::InvalidArgument("alltoall of '" + name + "': splits " + ShapeString(splits) + " has " +
                                     std::to_string(splits.size()) + " counts; pass one per rank (" + std::to_string(size) +
                                     (process_set == 0 ? std::string() : " in process set " + std::to_string(process_set)) + ").");
    if (sum != dim0)
      return Status::InvalidArgument("alltoall of '" + name + "': splits " + ShapeString(splits) + " add up to " +
                                     std::to_string(sum) + " rows, but the tensor has " + std::to_string(dim0) +
                                     " in dim 0; they must add up to dim 0.");
    return Status::OK();
  }

  // [Note: interruptible waits]
  // A wait releases the GIL, so Python cannot run its signal handlers meanwhile:
  // waiting in one piece would ignore Ctrl-C until the op finished or timed out.
  // Waiting in slices, with the GIL held between them to run the handlers, lets
  // KeyboardInterrupt (or any exception a handler raises) out within a slice. The
  // op itself goes on, and its handle stays valid for a later synchronize().
  std::vector<Status> WaitInterruptibly(const std::vector<int64_t>& hs) {
    constexpr std::chrono::milliseconds kSlice(50);
    std::vector<Status> st(hs.size());
    size_t next = 0;  // handles before it are done
    while (true) {
      {
        py::gil_scoped_release nogil;
        const auto deadline = std::chrono::steady_clock::now() + kSlice;
        while (next < hs.size()) {
          bool done = false;
          st[next] = rt_->handles().WaitUntil(hs[next], deadline, &done);
          if (!done) break;
          ++next;
        }
      }
      if (next == hs.size()) return st;
      if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    }
  }

  // After the launch (the background thread no longer touches the tensors), with the GIL.
  void LetGo(int64_t h, int device, bool running) {
    auto kept = std::static_pointer_cast<Kept>(rt_->handles().Keepalive(h));
    if (!kept) return;
    // Memory of another GPU than the waiting stream's cannot be recorded on that stream:
    // it stays held until synchronize().
    for (const at::Tensor* t : {&kept->input, &kept->output})
      if (t->defined() && t->is_cuda() && t->device().index() != device) return;
    void* waiting = device >= 0 ? CurrentCudaStream(device) : nullptr;
    if (running && waiting != kept->stream)
      for (const at::Tensor* t : {&kept->input, &kept->output})
        if (t->defined() && t->is_cuda()) RecordStream(*t, waiting);
    kept->input = at::Tensor();
    kept->output = at::Tensor();
  }

  // Called with the GIL held: the input and output may be dropped here for the last time.
  py::object TakeOutput(int64_t h) {
    auto kept = std::static_pointer_cast<Kept>(rt_->handles().Release(h));
    if (!kept) return py::none();
    if (!kept->splits_options) return py::cast(kept->output);
    at::Tensor received = at::tensor(kept->received_splits, at::TensorOptions().dtype(at::kLong));
    return py::make_tuple(kept->output, received.to(*kept->splits_options));
  }

  void Check(const Status& s) const { ThrowIfError(s, internal_error_); }

  py::object internal_error_;
  std::unique_ptr<Runtime> rt_;
};

// Test hook: the CPU cast kernel on a whole tensor, to compare with torch's .to().
at::Tensor CpuCast(const at::Tensor& t, at::ScalarType to, double scale) {
  DataType s, d;
  if (!ToDataType(t.scalar_type(), &s) || !ToDataType(to, &d)) throw py::value_error("unsupported dtype");
  at::Tensor src = t.contiguous();
  at::Tensor out = at::empty(src.sizes(), src.options().dtype(to));
  CpuBatchedCopy({{src.data_ptr(), out.data_ptr(), src.numel()}}, s, d, scale);
  return out;
}

}  // namespace
}  // namespace hvdz

PYBIND11_MODULE(_core, m) {
  using namespace hvdz;
  m.doc() = "horovod_zero C++ core";
  // The module holds its exception class as an attribute, and every Runtime a
  // reference to it: no process-wide state outlives or precedes the module.
  py::object internal_error = py::exception<std::runtime_error>(m, "HorovodInternalError", PyExc_RuntimeError);

  py::class_<OpArgs>(m, "OpArgs")
      .def(py::init<int, int, double, double, int, std::optional<at::ScalarType>, int>(), py::arg("op"),
           py::arg("reduce_op"), py::arg("prescale"), py::arg("postscale"), py::arg("root"),
           py::arg("output_dtype"), py::arg("process_set") = 0);

  // Filled by horovod_zero/settings.py: core_params(), which names these fields.
  py::class_<Params>(m, "Params")
      .def(py::init<>())
      .def_readwrite("fusion_threshold_bytes", &Params::fusion_threshold_bytes)
      .def_readwrite("cycle_time_ms", &Params::cycle_time_ms)
      .def_readwrite("cache_capacity", &Params::cache_capacity)
      .def_readwrite("timeline_path", &Params::timeline_path)
      .def_readwrite("timeline_mark_cycles", &Params::timeline_mark_cycles)
      .def_property(
          "log_level", [](const Params& p) { return std::string(LogLevelName(p.log_level)); },
          [](Params& p, const std::string& s) {
            if (!ParseLogLevel(s, &p.log_level)) throw py::value_error("Unknown log level '" + s + "'.");
          })
      .def_readwrite("stall_check_seconds", &Params::stall_check_seconds)
      .def_readwrite("stall_shutdown_seconds", &Params::stall_shutdown_seconds)
      .def_readwrite("transport_timeout_seconds", &Params::transport_timeout_seconds)
      .def_readwrite("direct_max_tensors", &Params::direct_max_tensors)
      .def_readwrite("copy_stream_bytes", &Params::copy_stream_bytes)
      .def_readwrite("ce_allgather_bytes", &Params::ce_allgather_bytes)
      .def_readwrite("gather_stream", &Params::gather_stream)
      .def_readwrite("thread_cpus", &Params::thread_cpus)
      .def_readwrite("autotune", &Params::autotune)
      .def_readwrite("autotune_log", &Params::autotune_log)
      .def_readwrite("autotune_warmup_samples", &Params::autotune_warmup_samples)
      .def_readwrite("autotune_steps_per_sample", &Params::autotune_steps_per_sample)
      .def_readwrite("autotune_max_samples", &Params::autotune_max_samples)
      .def_readwrite("autotune_noise", &Params::autotune_noise)
      .def_readwrite("autotune_confirm_rounds", &Params::autotune_confirm_rounds)
      .def_readwrite("zero_bucket_bytes", &Params::zero_bucket_bytes)
      .def_readwrite("zero_prefetch", &Params::zero_prefetch)
      .def_readwrite("fixed_fusion_threshold", &Params::fixed_fusion_threshold)
      .def_readwrite("fixed_cycle_time", &Params::fixed_cycle_time)
      .def_readwrite("fixed_zero_bucket", &Params::fixed_zero_bucket)
      .def_readwrite("fixed_zero_prefetch", &Params::fixed_zero_prefetch);

  py::class_<PyRuntime>(m, "Runtime")
      .def(py::init([internal_error](GlooBackend backend, int rank, int size, int local_rank, int local_size,
                                     int cross_rank, int cross_size, const std::string& shm_name, const Params& p) {
             return std::make_unique<PyRuntime>(internal_error, std::move(backend), rank, size, local_rank, local_size,
                                                cross_rank, cross_size, shm_name, p);
           }),
           py::arg("backend"),
           py::arg("rank"), py::arg("size"), py::arg("local_rank"), py::arg("local_size"), py::arg("cross_rank"),
           py::arg("cross_size"), py::arg("shm_name"), py::arg("params"))
      .def("enqueue", &PyRuntime::Enqueue)
      .def("enqueue_one", &PyRuntime::EnqueueOne)
      .def("enqueue_alltoall", &PyRuntime::EnqueueAlltoall, py::arg("tensor"), py::arg("splits"), py::arg("name"),
           py::arg("splits_like") = std::nullopt, py::arg("process_set") = 0)
      .def("add_process_set", &PyRuntime::AddProcessSet, py::arg("id"), py::arg("ranks"), py::arg("backend"),
           py::arg("shm_name"))
      .def("remove_process_set", &PyRuntime::RemoveProcessSet, py::arg("id"))
      .def("join", &PyRuntime::Join, py::arg("device"))
      .def("wait", &PyRuntime::Wait)
      .def("wait_stream", &PyRuntime::WaitStream, py::arg("handle"), py::arg("device"), py::arg("let_go") = false)
      .def("wait_stream_all", &PyRuntime::WaitStreamAll, py::arg("handles"), py::arg("device"),
           py::arg("let_go") = false)
      .def("try_wait_stream", &PyRuntime::TryWaitStream, py::arg("handle"), py::arg("device"))
      .def("try_let_go_all", &PyRuntime::TryLetGoAll, py::arg("handles"), py::arg("device"), py::arg("stream") = 0)
      .def("wait_all", &PyRuntime::WaitAll)
      .def("poll", &PyRuntime::Poll)
      .def("shutdown", &PyRuntime::Shutdown)
      .def("set_timeline", &PyRuntime::SetTimeline, py::arg("path"), py::arg("mark_cycles"))
      .def("stats", &PyRuntime::Stats)
      .def("reset_stats", &PyRuntime::ResetStats)
      .def("info", &PyRuntime::Info)
      .def("tuned", &PyRuntime::Tuned, py::arg("generation") = -1)
      .def("use_zero_knobs", &PyRuntime::UseZeroKnobs, py::arg("bucket"), py::arg("prefetch"));

  m.def("cpu_cast", &CpuCast, py::arg("tensor"), py::arg("dtype"), py::arg("scale") = 1.0);
  RegisterOffloadAdam(m);
  RegisterMasterAdam(m);
  m.attr("OP_ALLREDUCE") = static_cast<int>(OpType::kAllreduce);
  m.attr("OP_ALLGATHER") = static_cast<int>(OpType::kAllgather);
  m.attr("OP_REDUCESCATTER") = static_cast<int>(OpType::kReducescatter);
  m.attr("OP_BROADCAST") = static_cast<int>(OpType::kBroadcast);
  m.attr("OP_ALLTOALL") = static_cast<int>(OpType::kAlltoall);
  m.attr("SUM") = static_cast<int>(ReduceOp::kSum);
  m.attr("AVERAGE") = static_cast<int>(ReduceOp::kAverage);
  m.attr("MIN") = static_cast<int>(ReduceOp::kMin);
  m.attr("MAX") = static_cast<int>(ReduceOp::kMax);
  m.attr("PRODUCT") = static_cast<int>(ReduceOp::kProduct);
  RegisterOffloadAio(m);
}
