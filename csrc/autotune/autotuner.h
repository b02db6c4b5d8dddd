// HOROVOD_AUTOTUNE: rank 0 tunes the fusion threshold, the cycle time and, when a
// ZeRO optimizer uses them, its gradient bucket size and stage-3 prefetch depth,
// on the running job, as Horovod's autotuner does.
//
// [Note: autotuning]
// - The score is the bytes of the collectives executed per microsecond. A "step"
//   ends when some tensor name comes round again; a sub-sample is
//   HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE steps, and a sample's score is the median of
//   5 sub-samples' scores (Horovod's scheme), so one sample takes 5 x steps.
// - Why no more filtering: a sub-sample runs from a step's first collective to that
//   of a later step, whole steps whatever the setting. A step slowed by a checkpoint,
//   a GC pause, a first-time compile or the step where the ZeRO optimizer takes a new
//   setting (tuning.py) spoils one sub-sample, and the median ignores two of five.
//   The noise left is between samples (scores of nearly the same setting differed
//   by up to 20% on 2 x H200 at micro-batch 1): no filter within a sample removes
//   it; the confirmation below keeps it from choosing the setting.
// - The first HOROVOD_AUTOTUNE_WARMUP_SAMPLES samples are discarded. The first
//   scored one is the settings the job started with, then a few points spread over
//   the space, then the points a Bayesian optimiser proposes
//   (autotune/bayesian_optimizer.h), up to HOROVOD_AUTOTUNE_BAYES_OPT_MAX_SAMPLES
//   samples.
// - Confirmation (ours, autotune/confirmation.h): unless the starting setting scored
//   best, the best-scoring one and the starting one are sampled again in turn,
//   HOROVOD_AUTOTUNE_CONFIRM_ROUNDS samples each, and the best is kept only when the
//   median of its rounds beats the start's by more than their spread (2% at least);
//   otherwise the job keeps the setting it started with. 0 rounds: the best-scoring
//   setting is kept, as in Horovod.
// - Only rank 0 scores and decides. A new setting travels as an announcement of the
//   coordinator (Controller::Announce): every rank applies it in the same
//   negotiation cycle, before fusing that cycle's responses, so every rank fuses
//   with the same threshold. The next sample starts when it is in force.
// - Settings the user set explicitly are held constant, as in Horovod. The ZeRO
//   settings join the search only when an optimizer that uses them exists by the
//   end of the warm-up; the optimizer takes them at a step boundary agreed with
//   the other ranks (horovod_zero/torch/zero/core/tuning.py).
// - The log (HOROVOD_AUTOTUNE_LOG) has Horovod's columns, then ours, the last being
//   the phase: a "search" row per scored sample, a "confirm" row per confirmation
//   round, and a last "kept" row with the setting kept and its score (its median
//   over the rounds when they ran).
#pragma once

#include <atomic>
#include <chrono>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "autotune/bayesian_optimizer.h"
#include "autotune/confirmation.h"
#include "autotune/tuned_values.h"
#include "common/logging.h"
#include "common/message.h"
#include "common/params.h"
#include "common/status.h"

namespace hvdz {

enum class Knob { kFusionThreshold = 0, kCycleTime, kZeroBucket, kZeroPrefetch };
constexpr int kNumKnobs = 4;

class Autotuner {
 public:
  using Time = std::chrono::steady_clock::time_point;
  static constexpr int kSubSamples = 5;

  Autotuner(const Params& params, const Logger& log);

  // Opens the log file, if one was asked for.
  Status Open();
  // An optimizer uses the bucket size / the prefetch depth. Any thread.
  void UseZero(bool bucket, bool prefetch);
  // Whether the tuner is taking samples now (not waiting for its last announcement
  // to be in force, not done).
  bool observing() const { return !waiting_ && !done_; }
  bool done() const { return done_; }
  // The responses of one process set executed in this loop iteration.
  void Observe(int32_t set, const std::vector<Response>& responses);
  // After each loop iteration, with the time its cycles began. True when a sample is
  // complete and every rank must now take *next (announced by the caller).
  bool EndCycle(Time cycle_start, TunedValues* next);
  // The values announced last are in force on every rank from `now`.
  void InForce(const TunedValues& v, Time now);

  // The knobs being searched over, in the order of a point's coordinates.
  const std::vector<Knob>& dims() const { return dims_; }

 private:
  void StartSample(Time at);
  void CloseSubSample(Time at);
  bool Score(double score, TunedValues* next);
  bool Confirm(double score, TunedValues* next);
  // Announce v as the next setting to sample / as the one kept: both return true.
  bool Try(const TunedValues& v, TunedValues* next);
  bool Keep(const TunedValues& v, double score, TunedValues* next);
  void Freeze();
  std::vector<double> Point(const TunedValues& v) const;
  TunedValues Values(const std::vector<double>& point) const;
  std::vector<double> Snap(const std::vector<double>& point) const;
  void Write(const TunedValues& v, double score, const char* phase);

  const Logger& log_;
  std::string log_path_;
  std::ofstream file_;
  int warmup_left_;
  int steps_per_sample_;
  int max_samples_;
  double noise_;
  int confirm_rounds_;
  bool cache_enabled_;
  bool fixed_[kNumKnobs];
  std::atomic<bool> zero_bucket_used_{false};
  std::atomic<bool> zero_prefetch_used_{false};

  bool frozen_ = false;
  std::vector<Knob> dims_;
  std::unique_ptr<BayesianOptimizer> bo_;
  std::vector<std::vector<double>> first_points_;  // tried before the optimiser proposes
  std::vector<TunedValues> tried_;                 // by sample; [0] is the starting setting
  std::optional<Confirmation> confirm_;            // after the search, with confirm_rounds_ > 0
  TunedValues current_;
  bool waiting_ = false;
  bool done_ = false;

  // The sample in progress; its clock starts at the first cycle.
  bool started_ = false;
  std::unordered_map<std::string, int> seen_;  // times each (set, name) was executed
  bool boundary_ = false;                      // this iteration began a new step
  int64_t bytes_ = 0, cycle_bytes_ = 0;
  Time sub_start_;
  std::vector<double> sub_scores_;
};

}  // namespace hvdz
