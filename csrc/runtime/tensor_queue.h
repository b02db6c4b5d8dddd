// Framework threads add entries; the background thread pops their requests each
// cycle and takes the entries back when their responses arrive.
#pragma once

#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "runtime/tensor_entry.h"

namespace hvdz {

class TensorQueue {
 public:
  // Adds all entries or none: a group is negotiated together only if it arrives together.
  Status Add(std::vector<TensorEntry> entries);
  std::vector<Request> PopNewRequests();
  // Removes and returns the entry named `name`; false if this rank has none.
  bool Take(const std::string& name, TensorEntry* out);
  // Fails every entry with `s` and refuses later adds with it.
  void Close(const Status& s);
  Clock::time_point EnqueueTime(const std::string& name);

 private:
  std::mutex mu_;
  std::unordered_map<std::string, TensorEntry> table_;
  std::vector<Request> new_requests_;
  Status closed_;
};

}  // namespace hvdz
