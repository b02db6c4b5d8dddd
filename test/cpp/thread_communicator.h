// Ranks as threads for the data plane: a Communicator whose collectives meet in
// memory and do the maths on host buffers, and that records every launch so tests
// can count calls and groups. Calls issued inside GroupStart/GroupEnd run at
// GroupEnd, as NCCL's do, so an executor that read a result before closing its
// group would see stale data.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <vector>

#include "transport/communicator.h"

namespace hvdz {
namespace testing {

struct PostedCall {
  OpType op;
  const void* send;
  void* recv;
  int64_t count;
  DataType dtype;
  ReduceOp reduce_op;
  int root;
  std::vector<int64_t> send_counts = {};  // alltoall
  std::vector<int64_t> recv_counts = {};
};

// Where the same collective of every rank meets.
class CollectiveHub {
 public:
  explicit CollectiveHub(int size) : size_(size), posted_(size) {}
  int size() const { return size_; }
  // Returns once every rank has posted its call and `mine.recv` holds this rank's
  // result. Every rank reads all inputs before any rank writes its output, so
  // in-place calls see the inputs.
  void Run(int rank, const PostedCall& mine);

 private:
  void Barrier();
  std::vector<double> Result(int rank, const PostedCall& mine) const;

  int size_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  std::vector<PostedCall> posted_;
};

class ThreadCommunicator : public Communicator {
 public:
  struct Launch {
    bool grouped;
    std::vector<PostedCall> calls;
  };
  ThreadCommunicator(CollectiveHub& hub, int rank, bool groups) : hub_(hub), rank_(rank), groups_(groups) {}

  Status Allreduce(void* buf, int64_t count, DataType dtype, ReduceOp op) override;
  Status Allgather(const void* in, void* out, int64_t count, DataType dtype) override;
  Status ReduceScatter(const void* in, void* out, int64_t count, DataType dtype, ReduceOp op) override;
  Status Broadcast(void* buf, int64_t count, DataType dtype, int root) override;
  Status Alltoall(const void* in, void* out, const std::vector<int64_t>& send_counts,
                  const std::vector<int64_t>& recv_counts, DataType dtype) override;
  bool Groups(OpType op) const override {
    return groups_ && (group_only_.empty() || std::find(group_only_.begin(), group_only_.end(), op) != group_only_.end());
  }
  // Groups only these ops, as the Gloo communicator groups reduce-scatter and allgather only.
  void GroupOnly(std::vector<OpType> ops) { group_only_ = std::move(ops); }
  // Takes Average in allreduce, as NCCL does; otherwise Average is refused.
  void AverageNatively(bool on) { averages_ = on; }
  bool AveragesNatively() const override { return averages_; }
  Status GroupStart() override;
  Status GroupEnd() override;

  // Every call of `count` elements fails, alike on every rank, before meeting the others.
  void FailCallsOfCount(int64_t count) { fail_count_ = count; }
  // The launches that went through: a group is one launch.
  const std::vector<Launch>& launches() const { return launches_; }
  int group_starts() const { return group_starts_; }
  int group_ends() const { return group_ends_; }

 private:
  Status Post(const PostedCall& c);

  CollectiveHub& hub_;
  int rank_;
  bool groups_;
  std::vector<OpType> group_only_;  // empty: every op
  bool averages_ = false;
  int64_t fail_count_ = -1;
  bool in_group_ = false;
  bool group_failed_ = false;
  int group_starts_ = 0;
  int group_ends_ = 0;
  Launch pending_{true, {}};
  std::vector<Launch> launches_;
};

// Element `i` of a host buffer of dtype `t`, as a double, and back (16-bit floats
// round to nearest even).
double LoadElement(const void* base, DataType t, int64_t i);
void StoreElement(void* base, DataType t, int64_t i, double v);

}  // namespace testing
}  // namespace hvdz
