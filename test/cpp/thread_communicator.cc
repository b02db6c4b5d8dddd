#include "thread_communicator.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "fusion/cpu_cast.h"

namespace hvdz {
namespace testing {

double LoadElement(const void* base, DataType t, int64_t i) {
  switch (t) {
    case DataType::kUInt8: return static_cast<const uint8_t*>(base)[i];
    case DataType::kInt8: return static_cast<const int8_t*>(base)[i];
    case DataType::kInt16: return static_cast<const int16_t*>(base)[i];
    case DataType::kInt32: return static_cast<const int32_t*>(base)[i];
    case DataType::kInt64: return static_cast<double>(static_cast<const int64_t*>(base)[i]);
    case DataType::kFloat16: return HalfToFloat(static_cast<const uint16_t*>(base)[i]);
    case DataType::kBFloat16: return BFloat16ToFloat(static_cast<const uint16_t*>(base)[i]);
    case DataType::kFloat32: return static_cast<const float*>(base)[i];
    case DataType::kFloat64: return static_cast<const double*>(base)[i];
  }
  return 0;
}

void StoreElement(void* base, DataType t, int64_t i, double v) {
  switch (t) {
    case DataType::kUInt8: static_cast<uint8_t*>(base)[i] = static_cast<uint8_t>(v); return;
    case DataType::kInt8: static_cast<int8_t*>(base)[i] = static_cast<int8_t>(v); return;
    case DataType::kInt16: static_cast<int16_t*>(base)[i] = static_cast<int16_t>(v); return;
    case DataType::kInt32: static_cast<int32_t*>(base)[i] = static_cast<int32_t>(v); return;
    case DataType::kInt64: static_cast<int64_t*>(base)[i] = static_cast<int64_t>(v); return;
    case DataType::kFloat16: static_cast<uint16_t*>(base)[i] = FloatToHalf(static_cast<float>(v)); return;
    case DataType::kBFloat16: static_cast<uint16_t*>(base)[i] = FloatToBFloat16(static_cast<float>(v)); return;
    case DataType::kFloat32: static_cast<float*>(base)[i] = static_cast<float>(v); return;
    case DataType::kFloat64: static_cast<double*>(base)[i] = v; return;
  }
}

void CollectiveHub::Barrier() {
  std::unique_lock<std::mutex> lk(mu_);
  const uint64_t gen = generation_;
  if (++arrived_ == size_) {
    arrived_ = 0;
    ++generation_;
    cv_.notify_all();
    return;
  }
  // Ranks that issue different collectives never meet: fail loudly instead of hanging.
  if (!cv_.wait_for(lk, std::chrono::seconds(30), [&] { return generation_ != gen; })) {
    std::fprintf(stderr, "CollectiveHub: ranks did not meet within 30 s\n");
    std::abort();
  }
}

std::vector<double> CollectiveHub::Result(int rank, const PostedCall& mine) const {
  const int64_t n = mine.count;
  for (int r = 0; r < size_; ++r) {
    const PostedCall& p = posted_[r];
    if (p.op != mine.op || p.count != n || p.dtype != mine.dtype || p.root != mine.root) {
      // Reading another rank's buffer with this rank's count could run past it.
      ADD_FAILURE() << "rank " << rank << " issued " << OpTypeName(mine.op) << " of " << n << " "
                    << DataTypeName(mine.dtype) << ", rank " << r << " " << OpTypeName(p.op) << " of " << p.count
                    << " " << DataTypeName(p.dtype);
      return std::vector<double>(mine.op == OpType::kAllgather ? n * size_ : n, NAN);
    }
  }
  auto reduce = [&](double a, double b) {
    switch (mine.reduce_op) {
      case ReduceOp::kMin: return std::min(a, b);
      case ReduceOp::kMax: return std::max(a, b);
      case ReduceOp::kProduct: return a * b;
      default: return a + b;
    }
  };
  std::vector<double> out;
  switch (mine.op) {
    case OpType::kAllreduce:
    case OpType::kReducescatter:
      out.resize(n);
      for (int64_t j = 0; j < n; ++j) {
        const bool ar = mine.op == OpType::kAllreduce;
        auto at = [&](int r) { return ar ? LoadElement(posted_[r].recv, mine.dtype, j)
                                         : LoadElement(posted_[r].send, mine.dtype, rank * n + j); };
        double acc = at(0);
        for (int r = 1; r < size_; ++r) acc = reduce(acc, at(r));
        out[j] = mine.reduce_op == ReduceOp::kAverage ? acc / size_ : acc;
      }
      break;
    case OpType::kAllgather:
      out.resize(n * size_);
      for (int q = 0; q < size_; ++q)
        for (int64_t j = 0; j < n; ++j) out[q * n + j] = LoadElement(posted_[q].send, mine.dtype, j);
      break;
    case OpType::kBroadcast:
      out.resize(n);
      for (int64_t j = 0; j < n; ++j) out[j] = LoadElement(posted_[mine.root].recv, mine.dtype, j);
      break;
    case OpType::kAlltoall:
      // Rank q's part for this rank follows its parts for the ranks before.
      for (int q = 0; q < size_; ++q) {
        const PostedCall& p = posted_[q];
        if (p.send_counts.size() != static_cast<size_t>(size_) || p.send_counts[rank] != mine.recv_counts[q]) {
          ADD_FAILURE() << "rank " << q << " sends rank " << rank << " a part its receive counts do not expect";
          return std::vector<double>(out.size(), NAN);
        }
        int64_t first = 0;
        for (int k = 0; k < rank; ++k) first += p.send_counts[k];
        for (int64_t j = 0; j < p.send_counts[rank]; ++j) out.push_back(LoadElement(p.send, mine.dtype, first + j));
      }
      break;
    case OpType::kJoin:
      ADD_FAILURE() << "join is never a collective";
      break;
  }
  return out;
}

void CollectiveHub::Run(int rank, const PostedCall& mine) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    posted_[rank] = mine;
  }
  Barrier();  // every rank's call is posted
  std::vector<double> out = Result(rank, mine);
  Barrier();  // every rank has read its inputs
  for (size_t j = 0; j < out.size(); ++j) StoreElement(mine.recv, mine.dtype, static_cast<int64_t>(j), out[j]);
}

Status ThreadCommunicator::Post(const PostedCall& c) {
  if (c.count == fail_count_) {
    group_failed_ = in_group_;
    return Status::Error("injected failure of a call of " + std::to_string(c.count) + " elements");
  }
  if (in_group_) {
    pending_.calls.push_back(c);
    return Status::OK();
  }
  hub_.Run(rank_, c);
  launches_.push_back({false, {c}});
  return Status::OK();
}

Status ThreadCommunicator::GroupStart() {
  if (in_group_) return Status::Error("GroupStart inside a group");
  ++group_starts_;
  in_group_ = true;
  group_failed_ = false;
  pending_ = {true, {}};
  return Status::OK();
}

Status ThreadCommunicator::GroupEnd() {
  if (!in_group_) return Status::Error("GroupEnd outside a group");
  ++group_ends_;
  in_group_ = false;
  if (group_failed_) return Status::OK();  // every rank failed the same call: launch nothing
  for (const auto& c : pending_.calls) hub_.Run(rank_, c);
  launches_.push_back(std::move(pending_));
  return Status::OK();
}

Status ThreadCommunicator::Allreduce(void* buf, int64_t count, DataType dtype, ReduceOp op) {
  if (op == ReduceOp::kAverage && !averages_) return Status::Error("Average reached a communicator that does not average");
  return Post({OpType::kAllreduce, buf, buf, count, dtype, op, 0});
}

Status ThreadCommunicator::Allgather(const void* in, void* out, int64_t count, DataType dtype) {
  return Post({OpType::kAllgather, in, out, count, dtype, ReduceOp::kSum, 0});
}

Status ThreadCommunicator::ReduceScatter(const void* in, void* out, int64_t count, DataType dtype, ReduceOp op) {
  if (op == ReduceOp::kAverage) return Status::Error("Average reached a reducescatter");
  return Post({OpType::kReducescatter, in, out, count, dtype, op, 0});
}

Status ThreadCommunicator::Broadcast(void* buf, int64_t count, DataType dtype, int root) {
  return Post({OpType::kBroadcast, buf, buf, count, dtype, ReduceOp::kSum, root});
}

Status ThreadCommunicator::Alltoall(const void* in, void* out, const std::vector<int64_t>& send_counts,
                                    const std::vector<int64_t>& recv_counts, DataType dtype) {
  return Post({OpType::kAlltoall, in, out, 0, dtype, ReduceOp::kSum, 0, send_counts, recv_counts});
}

}  // namespace testing
}  // namespace hvdz
