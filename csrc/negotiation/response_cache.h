// Responses of tensors seen before, at stable positions, so that a repeated tensor
// is negotiated with one bit instead of a request list. Every rank applies the
// same operations in the same order, so every rank's cache is identical.
#pragma once

#include <cstdint>
#include <list>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/message.h"

namespace hvdz {

class ResponseCache {
 public:
  explicit ResponseCache(uint32_t capacity) : capacity_(capacity) {}

  enum class Lookup { kMiss, kHit, kInvalid };
  // kHit: `req` can be served by the response at *pos. kInvalid: the name is cached
  // with other parameters (shape, dtype, ...) and must be evicted everywhere.
  Lookup Find(const Request& req, uint32_t* pos) const;
  const Response& Get(uint32_t pos) const { return *slots_[pos]; }
  bool Holds(uint32_t pos) const { return pos < slots_.size() && slots_[pos].has_value(); }
  void Touch(uint32_t pos);
  // Inserts (or replaces the entry of the same name). Positions it evicts to make
  // room are appended to *evicted.
  void Put(const Response& resp, std::vector<uint32_t>* evicted);
  void Erase(uint32_t pos);

  uint32_t capacity() const { return capacity_; }
  size_t num_entries() const { return by_name_.size(); }

 private:
  uint32_t capacity_;
  std::vector<std::optional<Response>> slots_;
  std::unordered_map<std::string, uint32_t> by_name_;
  std::list<uint32_t> lru_;  // front: most recently used
  std::unordered_map<uint32_t, std::list<uint32_t>::iterator> lru_at_;
  std::vector<uint32_t> free_;  // kept sorted descending: the lowest free slot is reused first
};

}  // namespace hvdz
