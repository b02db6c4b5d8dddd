#include "runtime/handle_table.h"

#include <string>

namespace hvdz {
namespace {
Status Unknown(int64_t h) {
  return Status::InvalidArgument("Unknown handle " + std::to_string(h) +
                                 ": it was never returned by an async op, or was already synchronized.");
}
}  // namespace

int64_t HandleTable::Allocate(std::shared_ptr<void> keepalive) {
  std::lock_guard<std::mutex> lk(mu_);
  int64_t h = next_++;
  State s;
  s.keepalive = std::move(keepalive);
  states_.emplace(h, std::move(s));
  return h;
}

void HandleTable::MarkDone(int64_t handle, const Status& s, std::shared_ptr<void> keepalive) {
  std::shared_ptr<void> event;  // no longer needed by a waiter: dropped after the unlock
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = states_.find(handle);
    if (it == states_.end()) return;  // `keepalive` goes out of scope after the unlock
    it->second.done = true;
    it->second.status = s;
    it->second.keepalive = std::move(keepalive);
    event = std::move(it->second.event);
  }
  cv_.notify_all();
}

void HandleTable::MarkLaunched(int64_t handle, std::shared_ptr<void> event) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    auto it = states_.find(handle);
    if (it == states_.end() || it->second.done) return;
    it->second.event = std::move(event);
  }
  cv_.notify_all();
}

Status HandleTable::WaitLaunchedUntil(int64_t handle, std::chrono::steady_clock::time_point deadline, bool* ready,
                                      std::shared_ptr<void>* event) {
  std::unique_lock<std::mutex> lk(mu_);
  *ready = true;
  event->reset();
  auto it = states_.find(handle);
  if (it == states_.end()) return Unknown(handle);
  *ready = WaitFor(lk, deadline, [&] {
    const State& s = states_.at(handle);
    return s.done || s.event != nullptr;
  });
  if (!*ready) return Status::OK();
  const State& s = states_.at(handle);
  if (s.done) return s.status;
  *event = s.event;
  return Status::OK();
}

Status HandleTable::Poll(int64_t handle, bool* done) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = states_.find(handle);
  if (it == states_.end()) return Unknown(handle);
  *done = it->second.done;
  return Status::OK();
}

Status HandleTable::Wait(int64_t handle) {
  std::unique_lock<std::mutex> lk(mu_);
  auto it = states_.find(handle);
  if (it == states_.end()) return Unknown(handle);
  cv_.wait(lk, [&] { return states_.at(handle).done; });
  return states_.at(handle).status;
}

Status HandleTable::WaitUntil(int64_t handle, std::chrono::steady_clock::time_point deadline, bool* done) {
  std::unique_lock<std::mutex> lk(mu_);
  *done = true;
  auto it = states_.find(handle);
  if (it == states_.end()) return Unknown(handle);
  *done = WaitFor(lk, deadline, [&] { return states_.at(handle).done; });
  return *done ? states_.at(handle).status : Status::OK();
}

std::shared_ptr<void> HandleTable::Keepalive(int64_t handle) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = states_.find(handle);
  return it == states_.end() ? nullptr : it->second.keepalive;
}

std::shared_ptr<void> HandleTable::Release(int64_t handle) {
  std::lock_guard<std::mutex> lk(mu_);
  auto it = states_.find(handle);
  if (it == states_.end()) return nullptr;
  std::shared_ptr<void> keep = std::move(it->second.keepalive);
  states_.erase(it);
  return keep;
}

}  // namespace hvdz
