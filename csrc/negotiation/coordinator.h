// Rank 0's table of tensors that not every rank has submitted yet (the slow path).
#pragma once

#include <string>
#include <unordered_map>
#include <vector>

#include "common/message.h"

namespace hvdz {

struct WaitingTensor {
  std::string name;
  std::vector<int> present_ranks;
};

class Coordinator {
 public:
  // `scope`: the process set, for the ranks that error responses name.
  Coordinator(int size, const SetScope& scope) : size_(size), scope_(scope) {}
  // Records requests; appends the responses of tensors that every rank has now
  // submitted, in the order they became complete.
  void Add(const std::vector<Request>& reqs, std::vector<Response>* ready);
  // Once every rank's requests of a cycle are in: appends, in name order, the
  // responses of the tensors that wait only on ranks in `joined`.
  void Sweep(const std::vector<bool>& joined, std::vector<Response>* ready);
  void AppendWaiting(std::vector<WaitingTensor>* out) const;
  void Drop(const std::string& name) { table_.erase(name); }

 private:
  struct Pending {
    std::vector<Request> by_rank;
    std::vector<bool> have;
    int count = 0;
  };
  bool Complete(const Pending& p, const std::vector<bool>& joined) const;
  Response Respond(const Pending& p, const std::vector<bool>& joined) const;

  int size_;
  SetScope scope_;
  std::unordered_map<std::string, Pending> table_;
};

}  // namespace hvdz
