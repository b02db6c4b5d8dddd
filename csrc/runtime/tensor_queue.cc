#include "runtime/tensor_queue.h"

#include <algorithm>
#include <unordered_set>

namespace hvdz {

Status TensorQueue::Add(std::vector<TensorEntry> entries) {
  std::lock_guard<std::mutex> lk(mu_);
  if (!closed_.ok()) return closed_;
  std::unordered_set<std::string> seen;  // duplicates inside one batch: grouped calls only
  for (const auto& e : entries) {
    const auto& name = e.request.name;
    if (table_.count(name) || (entries.size() > 1 && !seen.insert(name).second)) {
      return Status::InvalidArgument(
          "A tensor named '" + name + "' is already in flight on this rank. Wait for its handle "
          "(synchronize) before submitting the same name again, or give each tensor its own name.");
    }
  }
  // Only the first request since the loop last looked needs to wake it: waking it
  // for every enqueue costs the framework thread a syscall each time.
  const bool wake = new_requests_.empty();
  for (auto& e : entries) {
    new_requests_.push_back(e.request);
    std::string name = e.request.name;
    table_.emplace(std::move(name), std::move(e));
  }
  if (wake) cv_.notify_one();
  return Status::OK();
}

void TensorQueue::WaitForWork(Clock::time_point deadline) {
  std::unique_lock<std::mutex> lk(mu_);
  cv_.wait_until(lk, deadline, [&] { return woken_ || !new_requests_.empty(); });
  woken_ = false;
}

void TensorQueue::Wake() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    woken_ = true;
  }
  cv_.notify_one();
}

std::vector<Request> TensorQueue::PopNewRequests() {
  std::lock_guard<std::mutex> lk(mu_);
  std::vector<Request> out;
  out.swap(new_requests_);
  return out;
}

bool TensorQueue::Take(const std::string& name, TensorEntry* out) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = table_.find(name);
  if (it == table_.end()) return false;
  *out = std::move(it->second);
  table_.erase(it);
  return true;
}

std::vector<std::string> TensorQueue::PendingNames() {
  std::vector<std::string> names;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (const auto& kv : table_) names.push_back(kv.first);
  }
  std::sort(names.begin(), names.end());
  return names;
}

void TensorQueue::Close(const Status& s) {
  std::unordered_map<std::string, TensorEntry> failed;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_.ok()) closed_ = s;
    failed.swap(table_);
    new_requests_.clear();
  }
  // Callbacks run outside the lock: they may take other locks.
  for (auto& kv : failed) {
    Complete(kv.second, s);
  }
}

}  // namespace hvdz
