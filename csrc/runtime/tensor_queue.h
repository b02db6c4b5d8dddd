// Framework threads add entries; the background thread pops their requests each
// cycle and takes the entries back when their responses arrive.
#pragma once

#include <condition_variable>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/tensor_entry.h"

namespace hvdz {

class TensorQueue {
 public:
  // Adds all entries or none: a group is negotiated together only if it arrives together.
  Status Add(std::vector<TensorEntry> entries);
  std::vector<Request> PopNewRequests();
  // Removes and returns the entry named `name`; false if this rank has none.
  bool Take(const std::string& name, TensorEntry* out);
  // The names of the entries waiting, sorted.
  std::vector<std::string> PendingNames();
  // Fails every entry with `s` and refuses later adds with it.
  void Close(const Status& s);
  // Sleeps until new requests arrive, Wake() is called, or `deadline` passes.
  void WaitForWork(Clock::time_point deadline);
  void Wake();

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool woken_ = false;
  std::unordered_map<std::string, TensorEntry> table_;
  std::vector<Request> new_requests_;
  Status closed_;
};

}  // namespace hvdz
