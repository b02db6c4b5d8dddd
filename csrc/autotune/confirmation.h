// HOROVOD_AUTOTUNE_CONFIRM_ROUNDS: the autotuner's last phase, which decides between
// the best-scoring setting of the search and the setting the job started with.
//
// The search ends on its highest score, and the highest of twenty noisy scores may
// be a lucky draw rather than a real win. So both settings are measured again, each round
// a full sample, alternately (candidate, start, candidate, start, ...) so that a
// drift of the job's speed falls on both; the candidate is kept only when the median
// of its rounds beats the start's by more than the rounds' relative spread, and by
// kMinWin at least. Otherwise the job keeps the setting it started with.
#pragma once

#include <vector>

#include "autotune/tuned_values.h"

namespace hvdz {

// The median of `v` (the mean of the middle two for an even count); 0 when empty.
double Median(std::vector<double> v);

class Confirmation {
 public:
  // The least relative win worth changing the settings for, whatever the spread:
  // with one round there is no spread to see.
  static constexpr double kMinWin = 0.02;

  // `rounds` >= 1 samples of each setting.
  Confirmation(const TunedValues& candidate, const TunedValues& start, int rounds);

  bool done() const { return static_cast<int>(start_scores_.size()) >= rounds_; }
  // The setting the next sample measures; valid while !done().
  const TunedValues& next() const { return candidates_turn() ? candidate_ : start_; }
  // The score of a sample of next().
  void Add(double score);

  // Once done():
  double candidate_median() const { return Median(candidate_scores_); }
  double start_median() const { return Median(start_scores_); }
  // The relative win the candidate needs: the larger relative spread (max - min over
  // the median) of the two settings' rounds, at least kMinWin.
  double needed() const;
  bool keep_candidate() const { return candidate_median() > start_median() * (1 + needed()); }
  const TunedValues& kept() const { return keep_candidate() ? candidate_ : start_; }
  // The kept setting's median over its rounds.
  double kept_score() const { return keep_candidate() ? candidate_median() : start_median(); }

 private:
  bool candidates_turn() const { return candidate_scores_.size() == start_scores_.size(); }

  TunedValues candidate_, start_;
  int rounds_;
  std::vector<double> candidate_scores_, start_scores_;
};

}  // namespace hvdz
