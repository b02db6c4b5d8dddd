#include "negotiation/response_cache.h"

#include <algorithm>

namespace hvdz {

ResponseCache::Lookup ResponseCache::Find(const Request& req, uint32_t* pos) const {
  auto it = by_name_.find(req.name);
  if (it == by_name_.end()) return Lookup::kMiss;
  *pos = it->second;
  return slots_[it->second]->Matches(req) ? Lookup::kHit : Lookup::kInvalid;
}

void ResponseCache::Touch(uint32_t pos) {
  auto it = lru_at_.find(pos);
  if (it == lru_at_.end()) return;
  lru_.splice(lru_.begin(), lru_, it->second);
}

void ResponseCache::Erase(uint32_t pos) {
  if (!Holds(pos)) return;
  by_name_.erase(slots_[pos]->name);
  slots_[pos].reset();
  lru_.erase(lru_at_.at(pos));
  lru_at_.erase(pos);
  free_.push_back(pos);
  std::sort(free_.begin(), free_.end(), std::greater<uint32_t>());
}

void ResponseCache::Put(const Response& resp, std::vector<uint32_t>* evicted) {
  if (capacity_ == 0 || !resp.ok()) return;
  auto it = by_name_.find(resp.name);
  if (it != by_name_.end()) {
    slots_[it->second] = resp;
    Touch(it->second);
    return;
  }
  if (num_entries() >= capacity_) {
    uint32_t victim = lru_.back();
    Erase(victim);
    evicted->push_back(victim);
  }
  uint32_t pos;
  if (!free_.empty()) {
    pos = free_.back();
    free_.pop_back();
  } else {
    pos = static_cast<uint32_t>(slots_.size());
    slots_.emplace_back();
  }
  slots_[pos] = resp;
  by_name_[resp.name] = pos;
  lru_.push_front(pos);
  lru_at_[pos] = lru_.begin();
}

}  // namespace hvdz
