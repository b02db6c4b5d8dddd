#include "negotiation/join_tracker.h"

#include <cstddef>

namespace hvdz {

JoinTracker::Update JoinTracker::Observe(const std::vector<bool>& joined) {
  Update u;
  bool any = false;
  u.all = true;
  for (size_t r = 0; r < joined.size(); ++r) {
    if (joined[r] && !prev_[r]) {
      u.grew = true;
      last_ = static_cast<int>(r);
    }
    any |= joined[r];
    u.all &= joined[r];
  }
  prev_ = joined;
  if (u.all) {
    u.last = last_;
    prev_.assign(prev_.size(), false);  // every rank leaves join() in this cycle
  }
  if (u.all || !any) last_ = -1;
  return u;
}

}  // namespace hvdz
