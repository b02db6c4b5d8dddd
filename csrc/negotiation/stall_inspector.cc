#include "negotiation/stall_inspector.h"

#include <sstream>
#include <unordered_set>

namespace hvdz {
namespace {

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

}  // namespace

std::string StallInspector::Describe(const WaitingTensor& w, double seconds) const {
  std::vector<int> missing;
  std::unordered_set<int> present(w.present_ranks.begin(), w.present_ranks.end());
  for (int r = 0; r < size_; ++r)
    if (!present.count(r)) missing.push_back(r);
  std::ostringstream os;
  os << "Stalled tensor '" << w.name << "'" << scope_.Where() << ": submitted by ranks "
     << RankList(scope_.World(w.present_ranks)) << " but not by ranks " << RankList(scope_.World(missing)) << " for " << static_cast<int>(seconds)
     << " s. Every rank must submit the same tensors; a rank may have skipped this op, "
        "submitted it under another name, or stopped.";
  return os.str();
}

void StallInspector::Inspect(const std::vector<WaitingTensor>& waiting, Clock::time_point now,
                             std::vector<Response>* errors) {
  std::unordered_map<std::string, Seen> still;
  for (const auto& w : waiting) {
    auto it = seen_.find(w.name);
    if (it == seen_.end())
      HVDZ_LOG(log_, kDebug) << "Stall check: '" << w.name << "'" << scope_.Where() << " submitted by ranks "
                             << RankList(scope_.World(w.present_ranks))
                             << ", waiting for the others";
    Seen s = it == seen_.end() ? Seen{now, now, false} : it->second;
    double age = Seconds(now - s.first);
    if (shutdown_s_ > 0 && age >= shutdown_s_) {
      Response e;
      e.name = w.name;
      e.error = Describe(w, age) + " Failing it because HOROVOD_STALL_SHUTDOWN_TIME_SECONDS=" +
                std::to_string(static_cast<int>(shutdown_s_)) + ".";
      HVDZ_LOG(log_, kError) << e.error;
      errors->push_back(std::move(e));
      continue;  // forgotten: a later submission starts a fresh clock
    }
    if (check_s_ > 0 && age >= check_s_ && (!s.warned || Seconds(now - s.last_warn) >= check_s_)) {
      HVDZ_LOG(log_, kWarning) << Describe(w, age);
      s.warned = true;
      s.last_warn = now;
    }
    still.emplace(w.name, s);
  }
  seen_.swap(still);
}

}  // namespace hvdz
