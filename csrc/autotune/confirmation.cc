#include "autotune/confirmation.h"

#include <algorithm>

namespace hvdz {
namespace {

double RelativeSpread(const std::vector<double>& v) {
  const double m = Median(v);
  if (v.empty() || m <= 0) return 0;
  const auto [lo, hi] = std::minmax_element(v.begin(), v.end());
  return (*hi - *lo) / m;
}

}  // namespace

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  const size_t h = v.size() / 2;
  std::nth_element(v.begin(), v.begin() + h, v.end());
  if (v.size() % 2 == 1) return v[h];
  return (v[h] + *std::max_element(v.begin(), v.begin() + h)) / 2;
}

Confirmation::Confirmation(const TunedValues& candidate, const TunedValues& start, int rounds)
    : candidate_(candidate), start_(start), rounds_(std::max(1, rounds)) {}

void Confirmation::Add(double score) { (candidates_turn() ? candidate_scores_ : start_scores_).push_back(score); }

double Confirmation::needed() const {
  return std::max({kMinWin, RelativeSpread(candidate_scores_), RelativeSpread(start_scores_)});
}

}  // namespace hvdz
