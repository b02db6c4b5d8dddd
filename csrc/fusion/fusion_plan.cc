#include "fusion/fusion_plan.h"

#include <algorithm>

namespace hvdz {
namespace {

bool Compatible(const Response& a, const Response& b) {
  if (a.op != b.op || a.dtype != b.dtype || a.out_dtype != b.out_dtype || a.on_cuda != b.on_cuda ||
      a.devices != b.devices)
    return false;
  switch (a.op) {
    case OpType::kAllreduce:
    case OpType::kReducescatter:
      return a.reduce_op == b.reduce_op && a.prescale == b.prescale && a.postscale == b.postscale;
    case OpType::kBroadcast:
      return a.root == b.root;
    case OpType::kAllgather:
      return true;
    case OpType::kAlltoall:  // each runs alone, from its input into its output
    case OpType::kJoin:
      return false;
  }
  return false;
}

int64_t AlignUp(int64_t elems, int64_t elem_bytes) {
  int64_t a = std::max<int64_t>(1, kFusionAlignBytes / elem_bytes);
  return (elems + a - 1) / a * a;
}

// Bytes a tensor adds to a fused buffer (padding aside).
int64_t WireBytes(const Response& r) {
  int64_t elems = NumElements(r.shape);
  if (r.op == OpType::kAllgather) {
    elems = 0;
    for (auto d : r.first_dims) elems += d * RowElems(r.shape);
  }
  return elems * static_cast<int64_t>(DataTypeSize(r.out_dtype));
}

}  // namespace

int64_t RowElems(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (size_t i = 1; i < shape.size(); ++i) n *= shape[i];
  return n;
}

int64_t ScatterRows(int64_t dim0, int size, int rank) {
  return dim0 / size + (rank < dim0 % size ? 1 : 0);
}

int64_t ScatterFirstRow(int64_t dim0, int size, int rank) {
  return rank * (dim0 / size) + std::min<int64_t>(rank, dim0 % size);
}

std::vector<int64_t> SentSplits(const Response& r, int size, int rank) {
  return std::vector<int64_t>(r.splits.begin() + rank * size, r.splits.begin() + (rank + 1) * size);
}

std::vector<int64_t> ReceivedSplits(const Response& r, int size, int rank) {
  std::vector<int64_t> out(size);
  for (int q = 0; q < size; ++q) out[q] = r.splits[q * size + rank];
  return out;
}

std::vector<std::vector<size_t>> PlanFusion(const std::vector<Response>& resps,
                                            int64_t threshold_bytes) {
  std::vector<std::vector<size_t>> groups;
  std::vector<bool> taken(resps.size(), false);
  for (size_t i = 0; i < resps.size(); ++i) {
    if (taken[i] || !resps[i].ok()) continue;
    taken[i] = true;
    std::vector<size_t> g{i};
    int64_t bytes = WireBytes(resps[i]);
    for (size_t j = i + 1; threshold_bytes > 0 && j < resps.size(); ++j) {
      if (taken[j] || !resps[j].ok() || !Compatible(resps[i], resps[j])) continue;
      int64_t b = WireBytes(resps[j]);
      if (bytes + b > threshold_bytes) continue;
      bytes += b;
      taken[j] = true;
      g.push_back(j);
    }
    groups.push_back(std::move(g));
  }
  return groups;
}

FusionLayout ComputeLayout(const std::vector<const Response*>& group, int size) {
  FusionLayout L;
  const OpType op = group.front()->op;
  const int64_t esize = static_cast<int64_t>(DataTypeSize(group.front()->out_dtype));
  const bool per_rank = op == OpType::kAllgather || op == OpType::kReducescatter;
  const int ranks = per_rank ? size : 1;
  std::vector<int64_t> fill(ranks, 0);
  for (const Response* r : group) {
    std::vector<int64_t> off(ranks), cnt(ranks);
    for (int k = 0; k < ranks; ++k) {
      if (op == OpType::kAllgather) {
        cnt[k] = r->first_dims[k] * RowElems(r->shape);
      } else if (op == OpType::kReducescatter) {
        cnt[k] = ScatterRows(r->shape[0], size, k) * RowElems(r->shape);
      } else {
        cnt[k] = NumElements(r->shape);
      }
      off[k] = fill[k];
      fill[k] = AlignUp(fill[k] + cnt[k], esize);
    }
    L.offset.push_back(std::move(off));
    L.count.push_back(std::move(cnt));
  }
  L.segment_elems = *std::max_element(fill.begin(), fill.end());
  L.total_elems = L.segment_elems * ranks;
  return L;
}

}  // namespace hvdz
