#include "ops/copy_streams.h"

#include "common/cuda_status.h"

namespace hvdz {

CopyStreams::~CopyStreams() {
  for (auto& p : pending_) cudaEventDestroy(p.done);
  if (in_done_) cudaEventDestroy(in_done_);
  if (coll_done_) cudaEventDestroy(coll_done_);
  if (in_) cudaStreamDestroy(in_);
  if (out_) cudaStreamDestroy(out_);
}

Status CopyStreams::Open() {
  if (in_ != nullptr) return Status::OK();
  // Default priority, below the NCCL stream's: when both have work, the
  // collective's blocks are scheduled first.
  HVDZ_RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithFlags(&in_, cudaStreamNonBlocking), "cudaStreamCreate"));
  HVDZ_RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithFlags(&out_, cudaStreamNonBlocking), "cudaStreamCreate"));
  HVDZ_RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(&in_done_, cudaEventDisableTiming), "cudaEventCreate"));
  return CudaStatus(cudaEventCreateWithFlags(&coll_done_, cudaEventDisableTiming), "cudaEventCreate");
}

void CopyStreams::Prune() {
  while (!pending_.empty() && cudaEventQuery(pending_.front().done) == cudaSuccess) {
    cudaEventDestroy(pending_.front().done);
    pending_.pop_front();
  }
}

Status CopyStreams::OrderAfterPendingWrites(const std::vector<TensorEntry>& entries) {
  waits_.clear();
  Prune();
  touched_.clear();
  if (sibling_ != nullptr) {  // the other lane orders its ops after this one's whole op, see End()
    for (const auto& en : entries) {
      for (const TensorDesc* t : {&en.input, &en.output}) {
        const auto b = reinterpret_cast<uintptr_t>(t->data);
        if (t->data != nullptr && t->bytes() > 0) touched_.push_back({b, b + t->bytes()});
      }
    }
  }
  HVDZ_RETURN_IF_ERROR(WaitForOverlapping(pending_, entries));
  // The sibling prunes its own list; a finished entry left there costs one more wait.
  return sibling_ != nullptr ? WaitForOverlapping(sibling_->pending_, entries) : Status::OK();
}

Status CopyStreams::WaitForOverlapping(const std::deque<PendingWrites>& pending,
                                       const std::vector<TensorEntry>& entries) {
  auto overlaps = [](const std::vector<Range>& rs, const TensorDesc& t) {
    const auto b = reinterpret_cast<uintptr_t>(t.data), e = b + t.bytes();
    for (const auto& r : rs)
      if (b < r.second && r.first < e) return true;
    return false;
  };
  for (const auto& p : pending) {
    for (const auto& en : entries) {
      if (overlaps(p.ranges, en.input) || overlaps(p.ranges, en.output)) {
        HVDZ_RETURN_IF_ERROR(CudaStatus(cudaStreamWaitEvent(collective_, p.done, 0), "cudaStreamWaitEvent"));
        waits_.push_back(p.done);
        break;
      }
    }
  }
  return Status::OK();
}

Status CopyStreams::Begin(bool use, cudaStream_t* buffer_stream) {
  if (use) HVDZ_RETURN_IF_ERROR(Open());
  active_ = use;
  *buffer_stream = use ? in_ : collective_;
  return Status::OK();
}

Status CopyStreams::BeforeStream(const std::vector<cudaEvent_t>& ready, cudaStream_t* s) {
  for (auto ev : ready) HVDZ_RETURN_IF_ERROR(CudaStatus(cudaStreamWaitEvent(in_, ev, 0), "cudaStreamWaitEvent"));
  for (auto ev : waits_) HVDZ_RETURN_IF_ERROR(CudaStatus(cudaStreamWaitEvent(in_, ev, 0), "cudaStreamWaitEvent"));
  *s = in_;
  return Status::OK();
}

Status CopyStreams::BeforeLaunched() {
  HVDZ_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(in_done_, in_), "cudaEventRecord"));
  return CudaStatus(cudaStreamWaitEvent(collective_, in_done_, 0), "cudaStreamWaitEvent");
}

Status CopyStreams::AfterStream(const std::vector<CopyDesc>& written, size_t elem_bytes, cudaStream_t* s) {
  HVDZ_RETURN_IF_ERROR(CudaStatus(cudaEventRecord(coll_done_, collective_), "cudaEventRecord"));
  HVDZ_RETURN_IF_ERROR(CudaStatus(cudaStreamWaitEvent(out_, coll_done_, 0), "cudaStreamWaitEvent"));
  for (const auto& d : written) {
    const auto b = reinterpret_cast<uintptr_t>(d.dst);
    written_.push_back({b, b + static_cast<uintptr_t>(d.count) * elem_bytes});
  }
  wrote_after_ = true;
  *s = out_;
  return Status::OK();
}

Status CopyStreams::End(cudaStream_t* last) {
  *last = wrote_after_ ? out_ : collective_;
  Status s;
  written_.insert(written_.end(), touched_.begin(), touched_.end());
  touched_.clear();
  if (!written_.empty()) {
    PendingWrites p{nullptr, std::move(written_)};
    s = CudaStatus(cudaEventCreateWithFlags(&p.done, cudaEventDisableTiming), "cudaEventCreate");
    if (s.ok()) s = CudaStatus(cudaEventRecord(p.done, *last), "cudaEventRecord");
    if (s.ok()) pending_.push_back(std::move(p));
    else if (p.done) cudaEventDestroy(p.done);
  }
  written_.clear();
  active_ = false;
  wrote_after_ = false;
  return s;
}

}  // namespace hvdz
