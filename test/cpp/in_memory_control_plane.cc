#include "in_memory_control_plane.h"

namespace hvdz {
namespace testing {

Status Hub::Exchange(int rank, std::vector<uint8_t> mine, std::vector<std::vector<uint8_t>>* all,
                     std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait(lk, [&] { return !draining_; });  // the previous round must be fully read
  slots_[rank] = std::move(mine);
  if (++arrived_ == size_) {
    result_ = slots_;
    draining_ = true;
    cv_.notify_all();
  } else if (!cv_.wait_for(lk, timeout, [&] { return draining_; })) {
    --arrived_;
    return Status::Aborted("in-memory exchange timed out: a rank did not arrive");
  }
  *all = result_;
  if (++departed_ == size_) {
    draining_ = false;
    arrived_ = departed_ = 0;
    cv_.notify_all();
  }
  return Status::OK();
}

Status InMemoryControlPlane::Allgather(const std::vector<uint8_t>& mine, std::vector<uint8_t>* all) {
  ++exchanges_;
  std::vector<std::vector<uint8_t>> parts;
  HVDZ_RETURN_IF_ERROR(hub_.Exchange(rank_, mine, &parts));
  all->clear();
  for (auto& p : parts) all->insert(all->end(), p.begin(), p.end());
  return Status::OK();
}

Status InMemoryControlPlane::Gatherv(const std::vector<uint8_t>& mine, std::vector<std::vector<uint8_t>>* at_root) {
  ++exchanges_;
  std::vector<std::vector<uint8_t>> parts;
  HVDZ_RETURN_IF_ERROR(hub_.Exchange(rank_, mine, &parts));
  if (rank_ == 0) *at_root = std::move(parts);
  return Status::OK();
}

Status InMemoryControlPlane::Broadcast(std::vector<uint8_t>* buf) {
  ++exchanges_;
  std::vector<std::vector<uint8_t>> parts;
  HVDZ_RETURN_IF_ERROR(hub_.Exchange(rank_, *buf, &parts));
  *buf = parts[0];
  return Status::OK();
}

void Spawn(int size, const std::function<void(int)>& fn) {
  std::vector<std::thread> ts;
  for (int r = 0; r < size; ++r) ts.emplace_back(fn, r);
  for (auto& t : ts) t.join();
}

}  // namespace testing
}  // namespace hvdz
