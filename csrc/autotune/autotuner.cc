#include "autotune/autotuner.h"

#include <algorithm>
#include <cmath>

namespace hvdz {
namespace {

constexpr double kMiB = 1 << 20;
constexpr uint32_t kSeed = 0x5eed;  // rank 0 alone draws candidates: any fixed seed will do

// Where a knob is searched: its range, on a log scale for sizes and times (their
// effects are multiplicative), rounded to whole MiB or whole units. The prefetch
// depth stops at 2: each unit gathered ahead holds its full parameters, and a tuner
// must not run a job out of memory.
struct Space {
  const char* name;
  double lo, hi;
  bool log_scale;
  double quantum;  // 0: continuous
};
constexpr Space kSpaces[kNumKnobs] = {
    {"fusion_threshold", 1 * kMiB, 256 * kMiB, true, kMiB},
    {"cycle_time_ms", 0.1, 100.0, true, 0.0},
    {"zero_bucket", 1 * kMiB, 256 * kMiB, true, kMiB},
    {"zero_prefetch", 0.0, 2.0, false, 1.0},
};

double Get(const TunedValues& v, Knob k) {
  switch (k) {
    case Knob::kFusionThreshold: return static_cast<double>(v.fusion_threshold_bytes);
    case Knob::kCycleTime: return v.cycle_time_ms;
    case Knob::kZeroBucket: return static_cast<double>(v.zero_bucket_bytes);
    case Knob::kZeroPrefetch: return v.zero_prefetch;
  }
  return 0;
}

void Set(TunedValues* v, Knob k, double x) {
  switch (k) {
    case Knob::kFusionThreshold: v->fusion_threshold_bytes = std::llround(x); break;
    case Knob::kCycleTime: v->cycle_time_ms = x; break;
    case Knob::kZeroBucket: v->zero_bucket_bytes = std::llround(x); break;
    case Knob::kZeroPrefetch: v->zero_prefetch = static_cast<int32_t>(std::lround(x)); break;
  }
}

double ToUnit(const Space& s, double x) {
  x = std::clamp(x, s.lo, s.hi);
  return s.log_scale ? std::log(x / s.lo) / std::log(s.hi / s.lo) : (x - s.lo) / (s.hi - s.lo);
}

double FromUnit(const Space& s, double u) {
  u = std::clamp(u, 0.0, 1.0);
  double x = s.log_scale ? s.lo * std::pow(s.hi / s.lo, u) : s.lo + u * (s.hi - s.lo);
  if (s.quantum > 0) x = std::round(x / s.quantum) * s.quantum;
  return std::clamp(x, s.lo, s.hi);
}

// The i-th point (i >= 1) of a Halton sequence: spread evenly over the cube in any
// dimension, without the clumps of random points.
double RadicalInverse(int i, int base) {
  double f = 1, r = 0;
  for (; i > 0; i /= base) {
    f /= base;
    r += f * (i % base);
  }
  return r;
}
constexpr int kPrimes[kNumKnobs] = {2, 3, 5, 7};

const char* kHeader =
    "hierarchical_allreduce,hierarchical_allgather,torus_allreduce,cache_enabled,cycle_time_ms,"
    "tensor_fusion_threshold,score,zero_bucket_mb,zero_prefetch,phase";

}  // namespace

Autotuner::Autotuner(const Params& params, const Logger& log)
    : log_(log),
      log_path_(params.autotune_log),
      warmup_left_(params.autotune_warmup_samples),
      steps_per_sample_(std::max(1, params.autotune_steps_per_sample)),
      max_samples_(std::max(1, params.autotune_max_samples)),
      noise_(params.autotune_noise),
      confirm_rounds_(std::max(0, params.autotune_confirm_rounds)),
      cache_enabled_(params.cache_capacity > 0),
      fixed_{params.fixed_fusion_threshold, params.fixed_cycle_time, params.fixed_zero_bucket,
             params.fixed_zero_prefetch},
      current_(StartingValues(params)) {}

Status Autotuner::Open() {
  if (log_path_.empty()) return Status::OK();
  file_.open(log_path_, std::ios::out | std::ios::trunc);
  if (!file_) {
    return Status::InvalidArgument("Cannot open HOROVOD_AUTOTUNE_LOG file '" + log_path_ +
                                   "' for writing: give a path in a writable directory, or unset it.");
  }
  file_ << kHeader << std::endl;
  return Status::OK();
}

void Autotuner::UseZero(bool bucket, bool prefetch) {
  if (bucket) zero_bucket_used_ = true;
  if (prefetch) zero_prefetch_used_ = true;
}

void Autotuner::Observe(int32_t set, const std::vector<Response>& responses) {
  const int step_end = (static_cast<int>(sub_scores_.size()) + 1) * steps_per_sample_;
  for (const Response& r : responses) {
    if (!r.ok()) continue;
    cycle_bytes_ += NumElements(r.shape) * static_cast<int64_t>(DataTypeSize(r.out_dtype));
    int& n = seen_[std::to_string(set) + "/" + r.name];
    if (n >= step_end) boundary_ = true;  // a tensor comes round once more than the sub-sample's steps
    ++n;
  }
}

void Autotuner::StartSample(Time at) {
  seen_.clear();
  sub_scores_.clear();
  boundary_ = false;
  sub_start_ = at;
}

void Autotuner::CloseSubSample(Time at) {
  const double us = std::max<double>(1.0, std::chrono::duration<double, std::micro>(at - sub_start_).count());
  sub_scores_.push_back(static_cast<double>(bytes_) / us);
  HVDZ_LOG(log_, kDebug) << "Autotuner: sub-sample of " << bytes_ << " bytes in " << us << " us";
  sub_start_ = at;
}

bool Autotuner::EndCycle(Time cycle_start, TunedValues* next) {
  if (!observing()) return false;
  if (!started_) {
    started_ = true;
    sub_start_ = cycle_start;
  }
  // The cycle that begins a new step belongs to the next sub-sample, from its start.
  if (boundary_) {
    CloseSubSample(cycle_start);
    bytes_ = 0;
  }
  bytes_ += cycle_bytes_;
  cycle_bytes_ = 0;
  boundary_ = false;
  if (static_cast<int>(sub_scores_.size()) < kSubSamples) return false;
  std::vector<double> s = sub_scores_;
  std::nth_element(s.begin(), s.begin() + kSubSamples / 2, s.end());
  StartSample(cycle_start);
  if (warmup_left_ > 0) {
    --warmup_left_;
    HVDZ_LOG(log_, kInfo) << "Autotuner: warming up (" << warmup_left_ << " sample(s) left)";
    return false;
  }
  return Score(s[kSubSamples / 2], next);
}

void Autotuner::Freeze() {
  frozen_ = true;
  const bool used[kNumKnobs] = {true, true, zero_bucket_used_, zero_prefetch_used_};
  std::string tuned, kept;
  for (int k = 0; k < kNumKnobs; ++k) {
    std::string& list = !fixed_[k] && used[k] ? tuned : kept;
    list += (list.empty() ? "" : ", ") + std::string(kSpaces[k].name);
    if (!fixed_[k] && used[k]) dims_.push_back(static_cast<Knob>(k));
  }
  HVDZ_LOG(log_, kInfo) << "Autotuner: tuning [" << tuned << "]; held constant (set explicitly, or unused) [" << kept
                        << "]";
  if (dims_.empty()) return;
  bo_ = std::make_unique<BayesianOptimizer>(dims_.size(), noise_, kSeed);
  for (size_t i = 1; i <= dims_.size() + 1; ++i) {
    std::vector<double> p;
    for (size_t d = 0; d < dims_.size(); ++d) p.push_back(RadicalInverse(static_cast<int>(i), kPrimes[d]));
    first_points_.push_back(Snap(p));
  }
}

std::vector<double> Autotuner::Point(const TunedValues& v) const {
  std::vector<double> p;
  for (Knob k : dims_) p.push_back(ToUnit(kSpaces[static_cast<int>(k)], Get(v, k)));
  return p;
}

TunedValues Autotuner::Values(const std::vector<double>& point) const {
  TunedValues v = current_;  // the knobs held constant keep their values
  for (size_t d = 0; d < dims_.size(); ++d) Set(&v, dims_[d], FromUnit(kSpaces[static_cast<int>(dims_[d])], point[d]));
  return v;
}

std::vector<double> Autotuner::Snap(const std::vector<double>& point) const { return Point(Values(point)); }

bool Autotuner::Score(double score, TunedValues* next) {
  if (!frozen_) Freeze();
  if (confirm_) return Confirm(score, next);
  Write(current_, score, "search");
  tried_.push_back(current_);
  if (dims_.empty()) return Keep(current_, score, next);  // nothing else to try
  bo_->AddSample(Point(current_), score);
  if (static_cast<int>(bo_->samples()) >= max_samples_) {
    const size_t b = bo_->best();
    HVDZ_LOG(log_, kInfo) << "Autotuner: search done after " << bo_->samples() << " samples";
    // tried_[0] is the starting setting: when it scored best there is nothing to confirm.
    if (confirm_rounds_ > 0 && !SameSettings(tried_[b], tried_[0])) {
      confirm_.emplace(tried_[b], tried_[0], confirm_rounds_);
      HVDZ_LOG(log_, kInfo) << "Autotuner: measuring the best and the starting setting in turn, " << confirm_rounds_
                            << " round(s) each";
      return Try(confirm_->next(), next);
    }
    return Keep(tried_[b], bo_->score(b), next);
  }
  std::vector<double> p;
  if (!first_points_.empty()) {
    p = first_points_.front();
    first_points_.erase(first_points_.begin());
  } else {
    p = bo_->Next([this](const std::vector<double>& x) { return Snap(x); });
  }
  return Try(Values(p), next);
}

bool Autotuner::Confirm(double score, TunedValues* next) {
  Write(current_, score, "confirm");
  confirm_->Add(score);
  if (!confirm_->done()) return Try(confirm_->next(), next);
  HVDZ_LOG(log_, kInfo) << "Autotuner: the best's median " << confirm_->candidate_median()
                        << " bytes/us against the start's " << confirm_->start_median() << ", which it must beat by "
                        << 100 * confirm_->needed() << "%: keeping "
                        << (confirm_->keep_candidate() ? "the best" : "the starting setting");
  return Keep(confirm_->kept(), confirm_->kept_score(), next);
}

bool Autotuner::Try(const TunedValues& v, TunedValues* next) {
  *next = v;
  next->tuning = true;
  waiting_ = true;
  return true;
}

bool Autotuner::Keep(const TunedValues& v, double score, TunedValues* next) {
  *next = v;
  next->tuning = false;
  done_ = true;
  HVDZ_LOG(log_, kInfo) << "Autotuner: done; keeping:";
  Write(*next, score, "kept");
  return true;
}

void Autotuner::InForce(const TunedValues& v, Time now) {
  current_ = v;
  waiting_ = false;
  bytes_ = cycle_bytes_ = 0;
  StartSample(now);
}

void Autotuner::Write(const TunedValues& v, double score, const char* phase) {
  HVDZ_LOG(log_, kInfo) << "Autotuner: [cycle_time_ms " << v.cycle_time_ms << ", fusion_threshold "
                        << v.fusion_threshold_bytes / kMiB << " MiB, zero_bucket " << v.zero_bucket_bytes / kMiB
                        << " MiB, zero_prefetch " << v.zero_prefetch << "] score " << score << " bytes/us (" << phase
                        << ")";
  if (!file_.is_open()) return;
  // Horovod's columns (it has no hierarchical or torus collectives here: 0), then ours.
  file_ << "0,0,0," << (cache_enabled_ ? 1 : 0) << "," << v.cycle_time_ms << "," << v.fusion_threshold_bytes / kMiB
        << "," << score << "," << v.zero_bucket_bytes / kMiB << "," << v.zero_prefetch << "," << phase << std::endl;
}

}  // namespace hvdz
