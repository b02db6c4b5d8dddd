#include "ops/device_context.h"

#include "fusion/cpu_cast.h"

namespace hvdz {

Status CpuContext::Copy(const std::vector<CopyDesc>& descs, DataType src, DataType dst, double scale, CopyStage) {
  CpuBatchedCopy(descs, src, dst, scale);
  return Status::OK();
}

Status CpuContext::FusionBuffer(size_t bytes, void** ptr) {
  if (buffer_.data == nullptr || buffer_.bytes() < bytes) {
    Release();  // before allocating: the old and new buffers are never held together
    HVDZ_RETURN_IF_ERROR(alloc_.Allocate(kCpuDevice, DataType::kUInt8, {static_cast<int64_t>(bytes)},
                                         &buffer_, &buffer_holder_));
    held_bytes_ = static_cast<int64_t>(buffer_.bytes());
  }
  *ptr = buffer_.data;
  return Status::OK();
}

void CpuContext::Release() {
  buffer_holder_.reset();
  buffer_ = TensorDesc();
  held_bytes_ = 0;
}

void CpuContext::Finish(std::vector<TensorEntry> entries, const Status& s) {
  // Gloo is done with the buffer: CPU collectives return when finished.
  if (static_cast<int64_t>(buffer_.bytes()) > keep_buffer_bytes_) Release();
  for (auto& e : entries) Complete(e, s);
}

}  // namespace hvdz
