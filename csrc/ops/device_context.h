// What the executor needs from one device: its communicator, batched copies,
// a fusion buffer, and a way to hand finished tensors back.
#pragma once

#include <atomic>
#include <memory>
#include <vector>

#include "common/copy_desc.h"
#include "common/tensor_entry.h"
#include "transport/communicator.h"

namespace hvdz {

// Where a copy sits in its op: before the collective (into the fusion buffer or the
// output) or after it (out of the buffer, or a postscale pass). A CUDA context may
// run the two on streams of their own; see [Note: copy streams].
enum class CopyStage { kBeforeCollective, kAfterCollective };

class DeviceContext {
 public:
  virtual ~DeviceContext() = default;
  // Start of every op, before any other call for it: a CUDA context picks the
  // communicator and stream the op runs on (see [Note: the gather lane] in
  // ops/cuda_context.h); Finish ends the op, also one whose BeginOp failed.
  virtual Status BeginOp(OpType) { return Status::OK(); }
  virtual Communicator& comm() = 0;
  // Orders later work after the producers of these inputs (CUDA: stream waits on
  // their ready events). CPU inputs are ready when enqueued.
  virtual Status WaitForInputs(const std::vector<TensorEntry>& entries) = 0;
  virtual Status Copy(const std::vector<CopyDesc>& descs, DataType src, DataType dst, double scale,
                      CopyStage stage) = 0;
  // At least `bytes` of scratch for this op, valid until Finish; asked for before the
  // op's first copy. CPU: one buffer kept across ops (a later call may move it). CUDA:
  // a stream-ordered buffer per op.
  virtual Status FusionBuffer(size_t bytes, void** ptr) = 0;
  // The bytes of a buffer that starts at the same offset of a registered window on
  // every rank, through which the communicator runs an allgather on the copy engines
  // (see [Note: copy-engine allgather] in transport/nccl/nccl_window.cc); 0: none.
  virtual int64_t WindowBytes() const { return 0; }
  // That buffer, taken instead of FusionBuffer for an allgather that fits; the op's
  // copies then stay on the collective stream, which orders every use of the window.
  virtual Status WindowBuffer(void** ptr) {
    *ptr = nullptr;
    return Status::Error("this device has no allgather window");
  }
  // Reports `s` to every entry once the work queued for them has finished.
  virtual void Finish(std::vector<TensorEntry> entries, const Status& s) = 0;
  // The stream that first writes outputs the runtime allocates (CUDA); nullptr on CPU.
  virtual void* OutputStream() { return nullptr; }
  // After a peer failed: ends work in flight instead of waiting for it (CUDA: aborts the
  // communicator, so that the kernels waiting for the dead peer stop).
  virtual void Abort() {}
};

// CPU tensors: Gloo for the collective, plain loops for copies, done when returned.
// The fusion buffer has the size the largest op since it was last freed asked for,
// never more. It is kept across ops while the job is busy, freed after an op that
// grew it past `keep_buffer_bytes` (one tensor larger than the fusion threshold),
// and freed by Release() when the runtime goes idle, so an idle job holds none.
class CpuContext : public DeviceContext {
 public:
  CpuContext(Communicator& comm, Allocator& alloc, int64_t keep_buffer_bytes)
      : comm_(comm), alloc_(alloc), keep_buffer_bytes_(keep_buffer_bytes) {}
  Communicator& comm() override { return comm_; }
  Status WaitForInputs(const std::vector<TensorEntry>&) override { return Status::OK(); }
  Status Copy(const std::vector<CopyDesc>& descs, DataType src, DataType dst, double scale, CopyStage) override;
  Status FusionBuffer(size_t bytes, void** ptr) override;
  void Finish(std::vector<TensorEntry> entries, const Status& s) override;
  void Release();
  // The buffer held now; readable from any thread.
  int64_t buffer_bytes() const { return held_bytes_.load(std::memory_order_relaxed); }

 private:
  Communicator& comm_;
  Allocator& alloc_;
  int64_t keep_buffer_bytes_;
  TensorDesc buffer_;
  std::shared_ptr<void> buffer_holder_;
  std::atomic<int64_t> held_bytes_{0};
};

}  // namespace hvdz
