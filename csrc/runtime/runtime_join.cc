// The runtime's side of join() (see [Note: join] in negotiation/join_tracker.h):
// the join entry, a joined rank's zeros for the others' allreduces, and join()'s
// return value.
#include "runtime/runtime.h"

namespace hvdz {
namespace {

Request StandInRequest(const Response& r, int rank, int device) {
  Request q;
  q.name = r.name;
  q.rank = rank;
  q.op = r.op;
  q.reduce_op = r.reduce_op;
  q.dtype = r.dtype;
  q.out_dtype = r.out_dtype;
  q.device = device;
  q.prescale = r.prescale;
  q.postscale = r.postscale;
  q.shape = r.shape;
  return q;
}

}  // namespace

Status Runtime::EnqueueJoin(int cuda_device, const TensorDesc& last_joined, std::shared_ptr<void> keepalive,
                            int64_t* handle) {
  if (last_joined.dtype != DataType::kInt32 || last_joined.numel() != 1 || last_joined.device != kCpuDevice)
    return Status::InvalidArgument("join() reports the last rank in a host int32 scalar.");
  if (cuda_device >= 0 && (!gpu_ || cuda_device >= gpu_->device_count())) {
    return Status::InvalidArgument("join(device=" + std::to_string(cuda_device) + "): this process sees " +
                                   std::to_string(gpu_ ? gpu_->device_count() : 0) + " CUDA device(s). Pass one "
                                   "of them, or -1 to let horovod_zero choose.");
  }
  join_device_ = cuda_device >= 0 ? cuda_device : -1;
  TensorEntry e;
  e.request.name = kJoinName;
  e.request.op = OpType::kJoin;
  e.output = last_joined;
  e.keepalive = std::move(keepalive);
  std::vector<TensorEntry> entries;
  entries.push_back(std::move(e));
  std::vector<int64_t> handles;
  HVDZ_RETURN_IF_ERROR(Enqueue(std::move(entries), nullptr, &handles));
  *handle = handles[0];
  return Status::OK();
}

Status Runtime::StandIn(const Response& r, int device, DeviceContext& ctx, TensorEntry* e) {
  e->request = StandInRequest(r, world_.rank, device);
  e->enqueued = Clock::now();
  std::shared_ptr<void> input, output;
  HVDZ_RETURN_IF_ERROR(alloc_->AllocateZeros(device, r.dtype, r.shape, ctx.OutputStream(), &e->input, &input));
  e->output = e->input;  // reduced in place, then dropped
  if (r.out_dtype != r.dtype) HVDZ_RETURN_IF_ERROR(alloc_->Allocate(device, r.out_dtype, r.shape, &e->output, &output));
  e->keepalive = std::make_shared<std::pair<std::shared_ptr<void>, std::shared_ptr<void>>>(input, output);
  return Status::OK();
}

void Runtime::CompleteJoin(int last_joined) {
  TensorEntry e;
  if (!queue_.Take(0, kJoinName, &e)) {
    HVDZ_LOG(logger_, kError) << "Every rank has joined, but this rank has no join() waiting.";
    return;
  }
  *static_cast<int32_t*>(e.output.data) = last_joined;
  Complete(e, Status::OK());
}

}  // namespace hvdz
