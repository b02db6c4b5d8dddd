// Host memory for tests that run the core without torch: malloc'ed tensors, and a
// device context that records the copies and buffers an op asks for before
// passing them on.
#pragma once

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <vector>

#include "common/tensor_entry.h"
#include "ops/device_context.h"

namespace hvdz {
namespace testing {

class MallocAllocator : public Allocator {
 public:
  Status Allocate(int device, DataType dtype, const std::vector<int64_t>& shape, TensorDesc* out,
                  std::shared_ptr<void>* holder) override {
    if (device != kCpuDevice) return Status::Error("no device memory here");
    out->dtype = dtype;
    out->shape = shape;
    out->device = device;
    holder->reset(std::malloc(std::max<size_t>(1, out->bytes())), std::free);
    out->data = holder->get();
    return Status::OK();
  }
  Status AllocateOnStream(int device, int64_t bytes, void*, TensorDesc* out, std::shared_ptr<void>* holder) override {
    return Allocate(device, DataType::kUInt8, {bytes}, out, holder);
  }
};

struct CopyRecord {
  CopyStage stage;
  size_t descs;
  DataType src, dst;
  double scale;
};

class RecordingContext : public DeviceContext {
 public:
  explicit RecordingContext(DeviceContext& inner) : inner_(inner) {}
  Status BeginOp(OpType op) override {
    begun.push_back(op);
    return inner_.BeginOp(op);
  }
  Communicator& comm() override {
    comm_after.push_back(begun.size());
    return inner_.comm();
  }
  Status WaitForInputs(const std::vector<TensorEntry>& entries) override {
    wait_after.push_back(begun.size());
    return inner_.WaitForInputs(entries);
  }
  void* OutputStream() override {
    output_after.push_back(begun.size());
    return inner_.OutputStream();
  }
  Status Copy(const std::vector<CopyDesc>& descs, DataType src, DataType dst, double scale, CopyStage stage) override {
    copies.push_back({stage, descs.size(), src, dst, scale});
    return inner_.Copy(descs, src, dst, scale, stage);
  }
  Status FusionBuffer(size_t bytes, void** ptr) override {
    buffers.push_back(bytes);
    buffer_after.push_back(begun.size());
    return inner_.FusionBuffer(bytes, ptr);
  }
  int64_t WindowBytes() const override { return static_cast<int64_t>(window.size()); }
  Status WindowBuffer(void** ptr) override {
    ++window_uses;
    *ptr = window.data();
    return Status::OK();
  }
  void Finish(std::vector<TensorEntry> entries, const Status& s) override { inner_.Finish(std::move(entries), s); }

  std::vector<CopyRecord> copies;
  std::vector<size_t> buffers;
  std::vector<OpType> begun;          // BeginOp's ops, in order
  std::vector<size_t> comm_after;     // begun.size() at each comm() call
  std::vector<size_t> buffer_after;   // and at each FusionBuffer() call
  std::vector<size_t> wait_after;     // ... WaitForInputs() call
  std::vector<size_t> output_after;   // ... OutputStream() call (outputs the runtime allocates)
  std::vector<uint8_t> window;  // a stand-in for an NCCL window: empty, none
  int window_uses = 0;

 private:
  DeviceContext& inner_;
};

}  // namespace testing
}  // namespace hvdz
