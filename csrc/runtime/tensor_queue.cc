#include "runtime/tensor_queue.h"

#include <algorithm>
#include <unordered_set>

namespace hvdz {

Status TensorQueue::Add(std::vector<TensorEntry> entries) {
  std::lock_guard<std::mutex> lk(mu_);
  if (!closed_.ok()) return closed_;
  std::unordered_set<std::string> seen;  // duplicates inside one batch (one set): grouped calls only
  for (const auto& e : entries) {
    const auto& name = e.request.name;
    if (table_.count(Key{e.request.process_set, name}) || (entries.size() > 1 && !seen.insert(name).second)) {
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
    Key key{e.request.process_set, e.request.name};
    table_.emplace(std::move(key), std::move(e));
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

bool TensorQueue::Take(int32_t set, const std::string& name, TensorEntry* out) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = table_.find(Key{set, name});
  if (it == table_.end()) return false;
  *out = std::move(it->second);
  table_.erase(it);
  return true;
}

std::vector<std::string> TensorQueue::PendingNames() {
  std::vector<std::string> names;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (const auto& kv : table_)
      names.push_back(kv.first.set == 0 ? kv.first.name
                                        : kv.first.name + " (process set " + std::to_string(kv.first.set) + ")");
  }
  std::sort(names.begin(), names.end());
  return names;
}

void TensorQueue::CompleteAll(std::vector<TensorEntry>& failed, const Status& s) {
  for (auto& e : failed) Complete(e, s);
}

void TensorQueue::Close(const Status& s) {
  std::vector<TensorEntry> failed;
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_.ok()) closed_ = s;
    for (auto& kv : table_) failed.push_back(std::move(kv.second));
    table_.clear();
    new_requests_.clear();
  }
  CompleteAll(failed, s);  // outside the lock: callbacks may take other locks
}

void TensorQueue::FailSet(int32_t set, const Status& s) {
  std::vector<TensorEntry> failed;
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (auto it = table_.begin(); it != table_.end();) {
      if (it->first.set != set) {
        ++it;
        continue;
      }
      failed.push_back(std::move(it->second));
      it = table_.erase(it);
    }
    new_requests_.erase(std::remove_if(new_requests_.begin(), new_requests_.end(),
                                       [set](const Request& r) { return r.process_set == set; }),
                        new_requests_.end());
  }
  CompleteAll(failed, s);
}

}  // namespace hvdz
