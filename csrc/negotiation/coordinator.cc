#include "negotiation/coordinator.h"

#include <algorithm>

namespace hvdz {

bool Coordinator::Complete(const Pending& p, const std::vector<bool>& joined) const {
  for (int r = 0; r < size_; ++r)
    if (!p.have[r] && !joined[r]) return false;
  return p.count > 0;
}

// Joined ranks that did not submit the tensor are left out: see [Note: join].
Response Coordinator::Respond(const Pending& p, const std::vector<bool>& joined) const {
  std::vector<Request> present;
  std::vector<int> missing;
  for (int r = 0; r < size_; ++r) {
    if (p.have[r]) present.push_back(p.by_rank[r]);
    else if (joined[r]) missing.push_back(r);
  }
  return MakeResponse(present, missing, scope_);
}

void Coordinator::Add(const std::vector<Request>& reqs, std::vector<Response>* ready) {
  for (const auto& r : reqs) {
    if (r.rank < 0 || r.rank >= size_) continue;
    auto& p = table_[r.name];
    if (p.by_rank.empty()) {
      p.by_rank.resize(size_);
      p.have.assign(size_, false);
    }
    if (!p.have[r.rank]) ++p.count;
    p.have[r.rank] = true;
    p.by_rank[r.rank] = r;
    if (p.count == size_) {
      ready->push_back(MakeResponse(p.by_rank, {}, scope_));
      table_.erase(r.name);
    }
  }
}

void Coordinator::Sweep(const std::vector<bool>& joined, std::vector<Response>* ready) {
  std::vector<std::string> done;
  for (const auto& kv : table_)
    if (Complete(kv.second, joined)) done.push_back(kv.first);
  std::sort(done.begin(), done.end());
  for (const auto& name : done) {
    ready->push_back(Respond(table_.at(name), joined));
    table_.erase(name);
  }
}

void Coordinator::AppendWaiting(std::vector<WaitingTensor>* out) const {
  for (const auto& kv : table_) {
    WaitingTensor w{kv.first, {}};
    for (int r = 0; r < size_; ++r)
      if (kv.second.have[r]) w.present_ranks.push_back(r);
    out->push_back(std::move(w));
  }
}

}  // namespace hvdz
