// A raw NCCL communicator whose collectives run on a stream it is given: every
// communicator of a device (one per process set) shares the device's one
// collective stream (see [Note: process sets] in runtime/process_set.h). The
// unique id travels over the control plane, so NCCL needs no store of its own.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <memory>
#include <string>

#include "transport/communicator.h"
#include "transport/control_plane.h"

namespace hvdz {

class NcclCommunicator : public Communicator {
 public:
  // A communicator of cp's ranks, its unique id from cp's rank 0; collectives go on
  // `stream`, which the caller keeps until this communicator is gone. `window_bytes`
  // > 0: the ranks agree on a symmetric window of that size (see [Note: copy-engine
  // allgather]); if all can take one, the communicator asks for no CTAs and
  // agreed_window() says the size, which OpenWindow (here or on a split) then registers.
  static Status Create(int device, ControlPlane& cp, cudaStream_t stream, int64_t window_bytes,
                       std::unique_ptr<NcclCommunicator>* out);
  // ncclCommSplit of `parent`, collective over every rank of it: `key` >= 0 is this
  // rank's place in the new communicator (ranks ordered by key), -1 takes no part
  // and gets none (*out stays null). Same device as `parent`; its collectives go on
  // `stream`, or on the parent's when null. `max_ctas` > 0 caps the CTAs of each of its
  // kernels (ncclConfig_t::maxCTAs) and gives it resources of its own, not the parent's, so
  // that the two can run at once. Fails on an NCCL without ncclCommSplit (before 2.18).
  // `for_window`: the split asks for no CTAs, so that a window opened on it later runs
  // allgathers on the copy engines.
  static Status Split(NcclCommunicator& parent, int key, std::unique_ptr<NcclCommunicator>* out,
                      cudaStream_t stream = nullptr, int max_ctas = 0, bool for_window = false);
  ~NcclCommunicator() override;

  cudaStream_t stream() const { return stream_; }
  // The symmetric window (nullptr: none) and its size; `window_note()` says why a window
  // that was asked for is missing.
  void* window() const { return window_buf_; }
  int64_t window_bytes() const { return window_buf_ != nullptr ? window_bytes_ : 0; }
  const std::string& window_note() const { return window_note_; }
  // The window size every rank agreed to at Create (0: none), opened or not.
  int64_t agreed_window() const { return agreed_window_; }
  // Collective over cp (this communicator's ranks): allocates and registers the window,
  // or leaves none (window_note() says why) when a rank cannot; fails if registration does.
  Status OpenWindow(ControlPlane& cp, int64_t window_bytes);
  int device() const { return device_; }
  // A failure NCCL found on its own (a peer's network error, ...).
  Status AsyncError();
  // Ends every pending NCCL call; the communicator is unusable afterwards.
  void Abort();
  bool aborted() const { return aborted_; }

  Status Allreduce(void* buf, int64_t count, DataType dtype, ReduceOp op) override;
  Status Allgather(const void* in, void* out, int64_t count, DataType dtype) override;
  Status ReduceScatter(const void* in, void* out, int64_t count, DataType dtype, ReduceOp op) override;
  Status Broadcast(void* buf, int64_t count, DataType dtype, int root) override;
  Status Alltoall(const void* in, void* out, const std::vector<int64_t>& send_counts,
                  const std::vector<int64_t>& recv_counts, DataType dtype) override;
  bool Groups(OpType) const override { return true; }
  bool AveragesNatively() const override { return NCCL_VERSION_CODE >= NCCL_VERSION(2, 10, 0); }  // ncclAvg
  Status GroupStart() override;
  Status GroupEnd() override;

 private:
  NcclCommunicator(int device, ncclComm_t comm, cudaStream_t stream)
      : device_(device), comm_(comm), stream_(stream) {}
  // nccl_window.cc: whether every rank can take a window (one host, NCCL 2.28 or later),
  // agreed over `cp` before the communicator exists; then the collective registration.
  static bool WindowWanted(ControlPlane& cp, int64_t window_bytes, std::string* note);
  void CloseWindow();

  int device_;
  ncclComm_t comm_;
  cudaStream_t stream_;
  bool aborted_ = false;
  void* window_buf_ = nullptr;
  void* window_handle_ = nullptr;  // ncclWindow_t, where this NCCL has windows
  int64_t window_bytes_ = 0;
  int64_t agreed_window_ = 0;
  std::string window_note_;
};

// Formats an NCCL failure with the call that failed.
Status NcclStatus(ncclResult_t r, const char* what);

}  // namespace hvdz
