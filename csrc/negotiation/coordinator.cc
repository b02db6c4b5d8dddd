#include "negotiation/coordinator.h"

namespace hvdz {

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
      ready->push_back(MakeResponse(p.by_rank));
      table_.erase(r.name);
    }
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
