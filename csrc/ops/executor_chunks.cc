// [Note: pipelined fusion]
// A fused allgather or reducescatter copies its whole buffer once: the copy-out
// after an allgather, the copy-in before a reducescatter. Run as one piece, that
// copy adds to the collective's time (0.78 ms next to 1.87 ms of NCCL for 1 GiB on
// 2 H200s). So a fused op over
// HOROVOD_FUSION_CHUNK_BYTES runs as chunks of whole tensors, each its own
// rank-major collective in its own region of the buffer, and each chunk's big copy
// runs on the copy stream while the neighbouring chunk's collective runs. Only the
// first copy-in (reducescatter) or the last copy-out (allgather) is left exposed,
// so chunk sizes ramp: they start small and double up to the chunk size, counted
// from the front for a reducescatter and from the back for an allgather. On CPU
// the side copies run in line: the chunks only split the Gloo calls.
#include <algorithm>

#include "ops/executor.h"

namespace hvdz {
namespace {

constexpr int64_t kFirstChunkBytes = 16ll << 20;

// Chunk lengths (in tensors) in walk order, each closed once it reaches its target.
std::vector<size_t> RampedLengths(const std::vector<int64_t>& bytes, int64_t cap) {
  std::vector<size_t> lengths;
  int64_t target = std::min(cap, kFirstChunkBytes), acc = 0;
  size_t len = 0;
  for (int64_t b : bytes) {
    acc += b;
    ++len;
    if (acc >= target) {
      lengths.push_back(len);
      acc = 0;
      len = 0;
      target = std::min(cap, 2 * target);
    }
  }
  if (len > 0) lengths.push_back(len);
  return lengths;
}

}  // namespace

std::vector<Executor::Chunk> Executor::Chunks(const Plan& p, bool small_first,
                                              int64_t* total_elems) const {
  const Response& r = *p.group.front();
  const bool rs = r.op == OpType::kReducescatter;
  const size_t n = p.entries.size();
  const int64_t esize = DataTypeSize(r.out_dtype);
  std::vector<int64_t> bytes(n);  // each tensor's share of the full buffer
  int64_t all = 0;
  for (size_t i = 0; i < n; ++i) {
    bytes[i] = (rs ? p.entries[i].input.numel() : p.entries[i].output.numel()) * esize;
    all += bytes[i];
  }
  std::vector<size_t> lengths{n};
  if (chunk_bytes_ > 0 && n > 1 && all > chunk_bytes_) {
    if (!small_first) std::reverse(bytes.begin(), bytes.end());
    lengths = RampedLengths(bytes, chunk_bytes_);
    if (!small_first) std::reverse(lengths.begin(), lengths.end());
  }
  std::vector<Chunk> chunks;
  const int64_t align = std::max<int64_t>(1, kFusionAlignBytes / esize);
  int64_t total = 0;
  size_t begin = 0;
  for (size_t len : lengths) {
    std::vector<const Response*> sub(p.group.begin() + begin, p.group.begin() + begin + len);
    Chunk c{begin, begin + len, ComputeLayout(sub, size_), (total + align - 1) / align * align};
    total = c.base + c.layout.total_elems + (rs ? c.layout.segment_elems : 0);  // reducescatter: + its receive segment
    chunks.push_back(std::move(c));
    begin += len;
  }
  *total_elems = total;
  return chunks;
}

}  // namespace hvdz
