#include "transport/nccl/nccl_communicator.h"

#include <cstring>
#include <string>
#include <vector>

#include "common/cuda_status.h"

namespace hvdz {
namespace {

ncclDataType_t ToNccl(DataType t) {
  switch (t) {
    case DataType::kUInt8: return ncclUint8;
    case DataType::kInt8: return ncclInt8;
    case DataType::kInt32: return ncclInt32;
    case DataType::kInt64: return ncclInt64;
    case DataType::kFloat16: return ncclFloat16;
    case DataType::kBFloat16: return ncclBfloat16;
    case DataType::kFloat32: return ncclFloat32;
    case DataType::kFloat64: return ncclFloat64;
    case DataType::kInt16: break;  // no NCCL type: moved as bytes (MoveAs), never reduced
  }
  return ncclFloat32;
}

ncclRedOp_t ToNccl(ReduceOp op) {
  switch (op) {
    case ReduceOp::kMin: return ncclMin;
    case ReduceOp::kMax: return ncclMax;
    case ReduceOp::kProduct: return ncclProd;
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 10, 0)
    case ReduceOp::kAverage: return ncclAvg;
#endif
    default: return ncclSum;
  }
}

}  // namespace

Status NcclStatus(ncclResult_t r, const char* what) {
  if (r == ncclSuccess) return Status::OK();
  return Status::Error(std::string(what) + " failed: " + ncclGetErrorString(r) +
                       " (set NCCL_DEBUG=INFO for NCCL's own account)");
}

Status NcclCommunicator::Create(int device, ControlPlane& cp, cudaStream_t stream, int64_t window_bytes,
                                std::unique_ptr<NcclCommunicator>* out) {
  HVDZ_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device), "cudaSetDevice"));
  ncclUniqueId id;
  std::vector<uint8_t> bytes;
  if (cp.rank() == 0) {
    HVDZ_RETURN_IF_ERROR(NcclStatus(ncclGetUniqueId(&id), "ncclGetUniqueId"));
    bytes.assign(reinterpret_cast<uint8_t*>(&id), reinterpret_cast<uint8_t*>(&id) + sizeof(id));
  }
  HVDZ_RETURN_IF_ERROR(cp.Broadcast(&bytes));
  if (bytes.size() != sizeof(id)) return Status::Error("Corrupt NCCL unique id from rank 0.");
  std::memcpy(&id, bytes.data(), sizeof(id));
  std::string note;
  const bool window = WindowWanted(cp, window_bytes, &note);
  ncclComm_t comm;
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
  // The copy engines run an allgather only on a communicator that asks for no CTAs.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  if (window) config.CTAPolicy = NCCL_CTA_POLICY_ZERO;
  HVDZ_RETURN_IF_ERROR(
      NcclStatus(ncclCommInitRankConfig(&comm, cp.size(), id, cp.rank(), &config), "ncclCommInitRankConfig"));
#else
  HVDZ_RETURN_IF_ERROR(NcclStatus(ncclCommInitRank(&comm, cp.size(), id, cp.rank()), "ncclCommInitRank"));
#endif
  out->reset(new NcclCommunicator(device, comm, stream));
  (*out)->window_note_ = note;
  if (window) (*out)->agreed_window_ = window_bytes;
  return Status::OK();
}

Status NcclCommunicator::Split(NcclCommunicator& parent, int key, std::unique_ptr<NcclCommunicator>* out,
                               cudaStream_t stream, int max_ctas, bool for_window) {
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0)
  HVDZ_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(parent.device_), "cudaSetDevice"));
  ncclComm_t comm = nullptr;
  const int color = key >= 0 ? 0 : NCCL_SPLIT_NOCOLOR;
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  if (max_ctas > 0) {
    config.maxCTAs = max_ctas;
    config.splitShare = 0;  // resources of its own, whatever NCCL_COMM_SPLIT_SHARE_RESOURCES says
  }
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 28, 0)
  if (for_window) config.CTAPolicy = NCCL_CTA_POLICY_ZERO;
#endif
  const bool configured = max_ctas > 0 || for_window;
  HVDZ_RETURN_IF_ERROR(NcclStatus(ncclCommSplit(parent.comm_, color, key >= 0 ? key : 0, &comm,
                                                configured ? &config : nullptr),
                                  "ncclCommSplit"));
  if (comm != nullptr) out->reset(new NcclCommunicator(parent.device_, comm, stream ? stream : parent.stream_));
  return Status::OK();
#else
  (void)parent;
  (void)key;
  (void)out;
  (void)stream;
  (void)max_ctas;
  (void)for_window;
  return Status::Error("this NCCL has no ncclCommSplit (2.18 or later)");
#endif
}

// The stream is the device's, not this communicator's: work of other communicators
// may still be queued on it.
NcclCommunicator::~NcclCommunicator() {
  if (!aborted_) {
    cudaStreamSynchronize(stream_);
    CloseWindow();
    ncclCommDestroy(comm_);
  }
  // After an abort the window is left allocated: copies still queued, here or by a peer,
  // may yet touch it, and the job is ending (elastic jobs take no window).
}

Status NcclCommunicator::AsyncError() {
  ncclResult_t r = ncclSuccess;
  ncclResult_t q = ncclCommGetAsyncError(comm_, &r);
  if (q != ncclSuccess) return NcclStatus(q, "ncclCommGetAsyncError");
  return NcclStatus(r, "NCCL (asynchronous error)");
}

void NcclCommunicator::Abort() {
  if (aborted_) return;
  aborted_ = true;
  ncclCommAbort(comm_);
}

Status NcclCommunicator::Allreduce(void* buf, int64_t count, DataType dtype, ReduceOp op) {
  return NcclStatus(ncclAllReduce(buf, buf, count, ToNccl(dtype), ToNccl(op), comm_, stream_), "ncclAllReduce");
}

Status NcclCommunicator::Allgather(const void* in, void* out, int64_t count, DataType dtype) {
  const MovedAs m = MoveAs(dtype);
  return NcclStatus(ncclAllGather(in, out, count * m.per_element, ToNccl(m.dtype), comm_, stream_), "ncclAllGather");
}

Status NcclCommunicator::ReduceScatter(const void* in, void* out, int64_t count, DataType dtype, ReduceOp op) {
  return NcclStatus(ncclReduceScatter(in, out, count, ToNccl(dtype), ToNccl(op), comm_, stream_),
                    "ncclReduceScatter");
}

Status NcclCommunicator::Broadcast(void* buf, int64_t count, DataType dtype, int root) {
  const MovedAs m = MoveAs(dtype);
  return NcclStatus(ncclBroadcast(buf, buf, count * m.per_element, ToNccl(m.dtype), root, comm_, stream_),
                    "ncclBroadcast");
}

// One send and one receive per peer inside one group, which NCCL runs as one
// launch. Empty parts are skipped on both sides: rank q's send count to rank r is
// rank r's receive count from q, so the two ends always agree.
Status NcclCommunicator::Alltoall(const void* in, void* out, const std::vector<int64_t>& send_counts,
                                  const std::vector<int64_t>& recv_counts, DataType dtype) {
  if (send_counts.size() != recv_counts.size()) return Status::Error("alltoall: send and receive counts differ in length");
  const MovedAs m = MoveAs(dtype);
  const ncclDataType_t t = ToNccl(m.dtype);
  const int64_t elem = static_cast<int64_t>(DataTypeSize(dtype));
  HVDZ_RETURN_IF_ERROR(GroupStart());
  Status s;
  int64_t sent = 0, received = 0;
  for (size_t q = 0; q < send_counts.size() && s.ok(); ++q) {
    const int peer = static_cast<int>(q);
    if (send_counts[q] > 0) {
      s = NcclStatus(ncclSend(static_cast<const char*>(in) + sent * elem, send_counts[q] * m.per_element, t, peer,
                              comm_, stream_), "ncclSend");
    }
    if (s.ok() && recv_counts[q] > 0) {
      s = NcclStatus(ncclRecv(static_cast<char*>(out) + received * elem, recv_counts[q] * m.per_element, t, peer,
                              comm_, stream_), "ncclRecv");
    }
    sent += send_counts[q];
    received += recv_counts[q];
  }
  Status end = GroupEnd();  // always close the group, even after a failed call
  HVDZ_RETURN_IF_ERROR(s);
  return end;
}

Status NcclCommunicator::GroupStart() { return NcclStatus(ncclGroupStart(), "ncclGroupStart"); }

Status NcclCommunicator::GroupEnd() { return NcclStatus(ncclGroupEnd(), "ncclGroupEnd"); }

}  // namespace hvdz
