#include "ops/device_context.h"

#include "fusion/cpu_cast.h"

namespace hvdz {

Status CpuContext::Copy(const std::vector<CopyDesc>& descs, DataType src, DataType dst, double scale, CopyStage) {
  CpuBatchedCopy(descs, src, dst, scale);
  return Status::OK();
}

Status CpuContext::FusionBuffer(size_t bytes, void** ptr) {
  if (buffer_.data == nullptr || buffer_.bytes() < bytes) {
    buffer_holder_.reset();
    HVDZ_RETURN_IF_ERROR(alloc_.Allocate(kCpuDevice, DataType::kUInt8, {static_cast<int64_t>(bytes)},
                                         &buffer_, &buffer_holder_));
  }
  *ptr = buffer_.data;
  return Status::OK();
}

void CpuContext::Finish(std::vector<TensorEntry> entries, const Status& s) {
  if (buffer_.data != nullptr && static_cast<int64_t>(buffer_.bytes()) > keep_buffer_bytes_) {
    buffer_holder_.reset();  // Gloo is done with it: CPU collectives return when finished
    buffer_ = TensorDesc();
  }
  for (auto& e : entries) Complete(e, s);
}

}  // namespace hvdz
