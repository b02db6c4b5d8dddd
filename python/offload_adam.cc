// _core.cpu_adam_step: the CPU Adam kernel (csrc/offload/cpu_adam.h) on torch
// tensors, split over ATen's threads (torch.set_num_threads) or a given number,
// with the GIL released; _core.cpu_adam_isa: the ISA a step would use.
#include "offload_adam.h"

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include <atomic>
#include <cmath>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "offload/cpu_adam.h"

namespace py = pybind11;

namespace hvdz {
namespace {

// Threads take whole blocks, so that each one's range starts on a cache line
// of a 64-byte-aligned buffer (none shares a line being written) and runs on
// contiguous memory for the prefetchers.
constexpr int64_t kBlock = 4096;

bool FloatType(at::ScalarType t, DataType* out) {
  switch (t) {
    case at::kFloat: *out = DataType::kFloat32; return true;
    case at::kBFloat16: *out = DataType::kBFloat16; return true;
    case at::kHalf: *out = DataType::kFloat16; return true;
    default: return false;
  }
}

// A contiguous CPU tensor of `numel` elements; fp32 unless `any_float`.
Status CheckTensor(const at::Tensor& t, const std::string& name, int64_t numel, bool any_float, DataType* dt) {
  if (!t.defined()) return Status::InvalidArgument("cpu_adam_step: " + name + " is None.");
  if (!t.is_cpu() || t.is_sparse())
    return Status::InvalidArgument("cpu_adam_step: " + name + " is on " + t.device().str() +
                                   "; the CPU Adam steps dense CPU tensors (move it with .cpu()).");
  const bool ok_type = FloatType(t.scalar_type(), dt) && (any_float || *dt == DataType::kFloat32);
  if (!ok_type)
    return Status::InvalidArgument("cpu_adam_step: " + name + " is " + std::string(c10::toString(t.scalar_type())) +
                                   (any_float ? "; it must be float32, bfloat16 or float16." : "; it must be float32."));
  if (!t.is_contiguous())
    return Status::InvalidArgument("cpu_adam_step: " + name + " is not contiguous; pass " + name + ".contiguous().");
  if (t.numel() != numel)
    return Status::InvalidArgument("cpu_adam_step: " + name + " has " + std::to_string(t.numel()) +
                                   " elements and param " + std::to_string(numel) + "; they must match.");
  return Status::OK();
}

// Overlapping buffers would make the result depend on the order of the writes.
Status CheckNoOverlap(const std::vector<std::pair<const at::Tensor*, const char*>>& ts) {
  for (size_t i = 0; i < ts.size(); ++i)
    for (size_t j = i + 1; j < ts.size(); ++j)
      if (ts[i].first->numel() > 0 && at::get_overlap_status(*ts[i].first, *ts[j].first) != at::MemOverlapStatus::No)
        return Status::InvalidArgument(std::string("cpu_adam_step: ") + ts[i].second + " and " + ts[j].second +
                                       " share memory; each needs its own buffer.");
  return Status::OK();
}

Status Prepare(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq,
               const std::optional<at::Tensor>& out, AdamTensors* t) {
  DataType dt;
  const int64_t n = param.defined() ? param.numel() : 0;
  HVDZ_RETURN_IF_ERROR(CheckTensor(param, "param", n, false, &dt));
  HVDZ_RETURN_IF_ERROR(CheckTensor(grad, "grad", n, true, &t->grad_type));
  HVDZ_RETURN_IF_ERROR(CheckTensor(exp_avg, "exp_avg", n, false, &dt));
  HVDZ_RETURN_IF_ERROR(CheckTensor(exp_avg_sq, "exp_avg_sq", n, false, &dt));
  std::vector<std::pair<const at::Tensor*, const char*>> all = {
      {&param, "param"}, {&grad, "grad"}, {&exp_avg, "exp_avg"}, {&exp_avg_sq, "exp_avg_sq"}};
  if (out) {
    HVDZ_RETURN_IF_ERROR(CheckTensor(*out, "out", n, true, &t->out_type));
    all.push_back({&*out, "out"});
    t->out = out->data_ptr();
  }
  HVDZ_RETURN_IF_ERROR(CheckNoOverlap(all));
  t->param = param.data_ptr<float>();
  t->exp_avg = exp_avg.data_ptr<float>();
  t->exp_avg_sq = exp_avg_sq.data_ptr<float>();
  t->grad = grad.data_ptr();
  t->numel = n;
  return Status::OK();
}

void ThrowIfError(const Status& s) {
  if (!s.ok()) throw py::value_error(s.reason());
}

// The work as units of at most kUnitBlocks blocks of one item, taken by the threads
// one at a time: a thread the scheduler takes off a core (for the threads that launch
// backward's kernels) holds up one unit, not a fixed share of the work, and a batch of
// shards is one parallel region instead of one per shard. A shard of one unit or less
// stays on one thread, where waking others would cost more than it saves.
constexpr int64_t kUnitBlocks = 16;  // 64K elements: about 2 MB of traffic

struct Unit {
  size_t item;
  int64_t begin, end;  // elements
};

std::vector<Unit> CutUnits(const std::vector<std::pair<AdamCoeffs, AdamTensors>>& work) {
  std::vector<Unit> units;
  for (size_t i = 0; i < work.size(); ++i)
    for (int64_t b = 0; b < work[i].second.numel; b += kUnitBlocks * kBlock)
      units.push_back({i, b, std::min(work[i].second.numel, b + kUnitBlocks * kBlock)});
  return units;
}

// Runs fn(unit) for each of [0, units): on torch's intra-op threads (a static split)
// when threads == 0, else on that many threads, each taking the next unit not taken.
template <typename Fn>
void ForUnits(int64_t units, int64_t threads, const Fn& fn) {
  if (threads <= 0) {
    at::parallel_for(0, units, 1, [&](int64_t b, int64_t e) {
      for (int64_t u = b; u < e; ++u) fn(u);
    });
    return;
  }
  const int64_t n = std::max<int64_t>(1, std::min(threads, units));
#ifdef _OPENMP
  if (n > 1 && !omp_in_parallel()) {
    std::atomic<int64_t> next{0};
#pragma omp parallel num_threads(static_cast<int>(n))
    for (int64_t u = next.fetch_add(1, std::memory_order_relaxed); u < units;
         u = next.fetch_add(1, std::memory_order_relaxed))
      fn(u);
    return;
  }
#endif
  for (int64_t u = 0; u < units; ++u) fn(u);
}

// Steps every item of `work` (checked already), with the GIL released.
void StepWork(CpuAdamIsa isa, const std::vector<std::pair<AdamCoeffs, AdamTensors>>& work, int64_t threads) {
  py::gil_scoped_release nogil;
  const std::vector<Unit> units = CutUnits(work);
  ForUnits(static_cast<int64_t>(units.size()), threads, [&](int64_t u) {
    const auto& [c, t] = work[units[u].item];
    CpuAdamStep(isa, c, t, units[u].begin, units[u].end);
  });
}

void CpuAdamStepPy(const at::Tensor& param, const at::Tensor& grad, const at::Tensor& exp_avg,
                   const at::Tensor& exp_avg_sq, const std::optional<at::Tensor>& out, double lr, double beta1,
                   double beta2, double eps, double weight_decay, int64_t step, bool decoupled, bool maximize,
                   double grad_scale, const std::string& isa_name, int64_t threads) {
  AdamHyper h{lr, beta1, beta2, eps, weight_decay, step, decoupled, maximize, grad_scale};
  AdamCoeffs c;
  AdamTensors t;
  CpuAdamIsa isa;
  ThrowIfError(MakeAdamCoeffs(h, &c));
  ThrowIfError(Prepare(param, grad, exp_avg, exp_avg_sq, out, &t));
  ThrowIfError(ResolveCpuAdamIsa(isa_name, &isa));
  StepWork(isa, {{c, t}}, threads);
  // As torch's in-place ops do: autograd sees these tensors changed.
  for (const at::Tensor* w : {&param, &exp_avg, &exp_avg_sq}) w->unsafeGetTensorImpl()->bump_version();
  if (out) out->unsafeGetTensorImpl()->bump_version();
}

// Many shards in one call (the offload worker's batch): everything is checked first,
// then the GIL is released once. A thread that takes the GIL back between shards waits
// behind a training thread busy in Python, up to the interpreter's switch interval
// (5 ms) each time; per shard, that was most of the worker's time.
// Each item: (param, grad, exp_avg, exp_avg_sq, out or None, lr, beta1, beta2, eps,
// weight_decay, step, decoupled, maximize, grad_scale), where `step` is torch's state
// tensor (the steps taken, 0-dim fp32/fp64): the item takes step + 1, and the tensor is
// incremented after, without a torch op (each op would hand the GIL over again).
void CpuAdamStepBatchPy(const std::vector<py::tuple>& items, const std::string& isa_name, int64_t threads) {
  CpuAdamIsa isa;
  ThrowIfError(ResolveCpuAdamIsa(isa_name, &isa));
  std::vector<at::Tensor> held;  // param, exp_avg, exp_avg_sq, out: versions bumped after
  std::vector<std::pair<AdamCoeffs, AdamTensors>> work(items.size());
  std::vector<at::Tensor> counts(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    const py::tuple& it = items[i];
    if (it.size() != 14) throw py::value_error("cpu_adam_step_batch: each item has 14 fields; see the docstring.");
    auto param = it[0].cast<at::Tensor>(), grad = it[1].cast<at::Tensor>();
    auto m = it[2].cast<at::Tensor>(), v = it[3].cast<at::Tensor>();
    auto out = it[4].is_none() ? std::nullopt : std::optional<at::Tensor>(it[4].cast<at::Tensor>());
    counts[i] = it[10].cast<at::Tensor>();
    const at::Tensor& count = counts[i];
    if (!count.is_cpu() || count.dim() != 0 || (count.scalar_type() != at::kFloat && count.scalar_type() != at::kDouble))
      throw py::value_error("cpu_adam_step_batch: an item's step is not torch's 0-dim fp32/fp64 CPU step tensor.");
    const double taken = count.scalar_type() == at::kFloat ? *count.data_ptr<float>() : *count.data_ptr<double>();
    AdamHyper h{it[5].cast<double>(), it[6].cast<double>(), it[7].cast<double>(), it[8].cast<double>(),
                it[9].cast<double>(), std::llround(taken) + 1, it[11].cast<bool>(), it[12].cast<bool>(),
                it[13].cast<double>()};
    ThrowIfError(MakeAdamCoeffs(h, &work[i].first));
    ThrowIfError(Prepare(param, grad, m, v, out, &work[i].second));
    held.insert(held.end(), {param, m, v});
    if (out) held.push_back(*out);
  }
  StepWork(isa, work, threads);
  for (const at::Tensor& w : held) w.unsafeGetTensorImpl()->bump_version();
  for (at::Tensor& count : counts) {
    if (count.scalar_type() == at::kFloat) *count.data_ptr<float>() += 1.0f;
    else *count.data_ptr<double>() += 1.0;
    count.unsafeGetTensorImpl()->bump_version();
  }
}

std::string CpuAdamIsaPy(const std::string& requested) {
  CpuAdamIsa isa;
  ThrowIfError(ResolveCpuAdamIsa(requested, &isa));
  return CpuAdamIsaName(isa);
}

}  // namespace

void RegisterOffloadAdam(py::module_& m) {
  m.def("cpu_adam_step", &CpuAdamStepPy, py::arg("param"), py::arg("grad"), py::arg("exp_avg"),
        py::arg("exp_avg_sq"), py::arg("out"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("step"), py::arg("decoupled"), py::arg("maximize"), py::arg("grad_scale"),
        py::arg("isa") = "auto", py::arg("threads") = 0,
        "One Adam (decoupled=False) or AdamW step in place on contiguous CPU tensors of equal numel: fp32 param, "
        "exp_avg, exp_avg_sq; grad in fp32/bf16/fp16; `out` (None or fp32/bf16/fp16) receives the new param. "
        "`step` counts from 1; g = grad * grad_scale. Runs with the GIL released on torch's intra-op threads "
        "(threads=0) or on `threads` threads.");
  m.def("cpu_adam_step_batch", &CpuAdamStepBatchPy, py::arg("items"), py::arg("isa") = "auto", py::arg("threads") = 0,
        "cpu_adam_step on each item (param, grad, exp_avg, exp_avg_sq, out or None, lr, beta1, beta2, eps, "
        "weight_decay, step, decoupled, maximize, grad_scale), in order, releasing the GIL once; `step` is the "
        "optimizer's 0-dim state['step'] tensor, incremented after. Every item is checked before any is stepped.");
  m.def("cpu_adam_isa", &CpuAdamIsaPy, py::arg("requested") = "auto",
        "The ISA cpu_adam_step uses for `requested` (auto, avx512, avx2 or scalar); ValueError if this CPU lacks it.");
}

}  // namespace hvdz
