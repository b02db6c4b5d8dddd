// A raw NCCL communicator with its own stream. The unique id travels over the
// control plane (Gloo), so NCCL needs no store of its own.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <memory>

#include "transport/communicator.h"
#include "transport/control_plane.h"

namespace hvdz {

class NcclCommunicator : public Communicator {
 public:
  static Status Create(int device, ControlPlane& cp, std::unique_ptr<NcclCommunicator>* out);
  ~NcclCommunicator() override;

  cudaStream_t stream() const { return stream_; }
  int device() const { return device_; }
  // A failure NCCL found on its own (a peer's network error, ...).
  Status AsyncError();
  // Ends every pending NCCL call; the communicator is unusable afterwards.
  void Abort();

  Status Allreduce(void* buf, int64_t count, DataType dtype, ReduceOp op) override;
  Status Allgather(const void* in, void* out, int64_t count, DataType dtype) override;
  Status ReduceScatter(const void* in, void* out, int64_t count, DataType dtype, ReduceOp op) override;
  Status Broadcast(void* buf, int64_t count, DataType dtype, int root) override;
  Status Alltoall(const void* in, void* out, const std::vector<int64_t>& send_counts,
                  const std::vector<int64_t>& recv_counts, DataType dtype) override;
  bool Groups(OpType) const override { return true; }
  Status GroupStart() override;
  Status GroupEnd() override;

 private:
  NcclCommunicator(int device, ncclComm_t comm, cudaStream_t stream)
      : device_(device), comm_(comm), stream_(stream) {}
  int device_;
  ncclComm_t comm_;
  cudaStream_t stream_;
  bool aborted_ = false;
};

// Formats an NCCL failure with the call that failed.
Status NcclStatus(ncclResult_t r, const char* what);

}  // namespace hvdz
