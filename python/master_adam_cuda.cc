// _core.master_adam_step: csrc/cuda/master_adam.h on torch tensors, queued on the
// current CUDA stream of their device. `add_step`: adds 1 to each `step` first, as torch's
// fused Adam does before its kernel, once every tensor has passed the checks (a refused
// call changes nothing); without it the caller has done so. `copies` (optional, one per
// param, bf16 or fp16): where each new parameter is also written in that dtype.
#include "master_adam.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/utils/pybind.h>

#include <string>
#include <vector>

#include "cuda/master_adam.h"
#include "cuda_stream.h"

namespace py = pybind11;

namespace hvdz {
namespace {

void Check(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("master_adam_step: " + what);
}

DataType GradType(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DataType::kFloat32;
    case at::kBFloat16: return DataType::kBFloat16;
    case at::kHalf: return DataType::kFloat16;
    default: throw std::invalid_argument(std::string("master_adam_step: a gradient is ") + c10::toString(t) +
                                         "; it must be float32, bfloat16 or float16.");
  }
}

void Step(const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& grads,
          const std::vector<at::Tensor>& exp_avgs, const std::vector<at::Tensor>& exp_avg_sqs,
          const std::vector<at::Tensor>& steps, double lr, double beta1, double beta2, double eps,
          double weight_decay, bool decoupled, bool maximize, double grad_scale,
          const std::vector<at::Tensor>& copies, bool add_step) {
  const size_t n = params.size();
  Check(grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && steps.size() == n,
        "params, grads, exp_avgs, exp_avg_sqs and steps must be lists of the same length.");
  Check(copies.empty() || copies.size() == n, "copies must be empty or one per param.");
  if (n == 0) return;
  const at::Device device = params[0].device();
  Check(device.is_cuda(), "the tensors are on " + device.str() + "; it steps CUDA tensors.");
  const DataType grad_type = GradType(grads[0].scalar_type());
  DataType copy_type = DataType::kBFloat16;
  if (!copies.empty()) {
    Check(copies[0].scalar_type() == at::kBFloat16 || copies[0].scalar_type() == at::kHalf,
          "copies must be bfloat16 or float16.");
    copy_type = copies[0].scalar_type() == at::kHalf ? DataType::kFloat16 : DataType::kBFloat16;
  }
  std::vector<MasterAdamDesc> descs(n);
  for (size_t i = 0; i < n; ++i) {
    // The message is built only for a refusal: this loop runs for every shard at each step.
    const auto check = [i](bool ok, const char* what) {
      if (!ok) Check(false, std::string(what) + " (tensor " + std::to_string(i) + ").");
    };
    const int64_t count = params[i].numel();
    for (const at::Tensor* t : {&params[i], &exp_avgs[i], &exp_avg_sqs[i], &grads[i]}) {
      if (t->device() != device)
        Check(false, "the tensors must all be on " + device.str() + " (tensor " + std::to_string(i) + ").");
      check(t->is_contiguous() && t->numel() == count, "every tensor must be contiguous, with its param's numel");
    }
    check(params[i].scalar_type() == at::kFloat && exp_avgs[i].scalar_type() == at::kFloat &&
              exp_avg_sqs[i].scalar_type() == at::kFloat,
          "params, exp_avgs and exp_avg_sqs must be float32");
    check(GradType(grads[i].scalar_type()) == grad_type, "the gradients must share one dtype");
    check(steps[i].device() == device && steps[i].scalar_type() == at::kFloat && steps[i].numel() == 1,
          "each step must be one float32 on the params' device");
    descs[i] = MasterAdamDesc{params[i].data_ptr<float>(), grads[i].data_ptr(), exp_avgs[i].data_ptr<float>(),
                              exp_avg_sqs[i].data_ptr<float>(), steps[i].data_ptr<float>(), count};
    if (!copies.empty()) {
      const at::Tensor& c = copies[i];
      if (c.device() != device || !c.is_contiguous() || c.numel() != count)
        Check(false, "each copy must be contiguous on " + device.str() + ", with its param's numel (tensor " +
                         std::to_string(i) + ").");
      check(c.scalar_type() == copies[0].scalar_type(), "the copies must share one dtype");
      descs[i].copy = c.data_ptr();
    }
  }
  const MasterAdamHyper h{static_cast<float>(lr),   static_cast<float>(beta1),        static_cast<float>(beta2),
                          static_cast<float>(eps),  static_cast<float>(weight_decay), decoupled,
                          maximize,                 static_cast<float>(grad_scale)};
  // The launch goes to the current device: where the caller's is another (a rank that never
  // called set_device), its stream handle, the legacy default stream, would name that
  // device's stream, and the kernel would race the work queued on the tensors' device.
  const c10::cuda::CUDAGuard on(device);
  if (add_step) at::_foreach_add_(steps, 1);
  auto stream = static_cast<cudaStream_t>(CurrentCudaStream(device.index()));
  const cudaError_t e = LaunchMasterAdam(descs.data(), static_cast<int>(n), grad_type, h, stream, copy_type);
  if (e != cudaSuccess) throw std::runtime_error(std::string("master_adam_step: ") + cudaGetErrorString(e));
}

}  // namespace

void RegisterMasterAdam(py::module_& m) {
  m.attr("HAVE_MASTER_ADAM") = true;
  m.def("master_adam_step", &Step, py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"),
        py::arg("steps"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
        py::arg("decoupled"), py::arg("maximize"), py::arg("grad_scale"),
        py::arg("copies") = std::vector<at::Tensor>{}, py::arg("add_step") = false);
}

}  // namespace hvdz
