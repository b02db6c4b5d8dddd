// Framework threads add entries; the background thread pops their requests each
// cycle and takes the entries back when their responses arrive. An entry is named
// by its process set and its name: the same name in two sets is two tensors.
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
  // Removes and returns the entry named `name` in process set `set`; false if this
  // rank has none.
  bool Take(int32_t set, const std::string& name, TensorEntry* out);
  // The names of the entries waiting, sorted; those of other sets than the global
  // one say which set they are in.
  std::vector<std::string> PendingNames();
  // Fails every entry with `s` and refuses later adds with it.
  void Close(const Status& s);
  // Fails every entry of process set `set` with `s` (the set is gone).
  void FailSet(int32_t set, const Status& s);
  // Sleeps until new requests arrive, Wake() is called, or `deadline` passes.
  void WaitForWork(Clock::time_point deadline);
  void Wake();

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool woken_ = false;
  struct Key {
    int32_t set;
    std::string name;
    bool operator==(const Key& o) const { return set == o.set && name == o.name; }
  };
  struct KeyHash {
    size_t operator()(const Key& k) const { return std::hash<std::string>()(k.name) ^ static_cast<size_t>(k.set); }
  };
  static void CompleteAll(std::vector<TensorEntry>& failed, const Status& s);

  std::unordered_map<Key, TensorEntry, KeyHash> table_;
  std::vector<Request> new_requests_;
  Status closed_;
};

}  // namespace hvdz
