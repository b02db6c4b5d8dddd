// Autotuning: the Gaussian process and the Bayesian optimiser against functions
// whose maximum is known, the tuner's sampling scheme and log against Horovod's
// documented behaviour, and the coordinator's announcement reaching every rank.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "autotune/autotuner.h"
#include "autotune/bayesian_optimizer.h"
#include "autotune/confirmation.h"
#include "autotune/gaussian_process.h"
#include "negotiation_harness.h"

namespace hvdz {
namespace {

TEST(GaussianProcess, InterpolatesASmoothFunctionBetweenItsSamples) {
  GaussianProcess gp(0.01);
  std::vector<std::vector<double>> x;
  std::vector<double> y;
  for (int i = 0; i <= 10; ++i) {
    x.push_back({i / 10.0});
    y.push_back(std::sin(3 * i / 10.0));
  }
  gp.Fit(x, y);
  for (double p : {0.05, 0.33, 0.71, 0.95}) {
    double m, s;
    gp.Predict({p}, &m, &s);
    EXPECT_NEAR(m, std::sin(3 * p), 0.02) << "at " << p;
    EXPECT_LT(s, 0.1) << "at " << p;
  }
  double m, s_far;
  gp.Predict({3.0}, &m, &s_far);  // far from every sample: the prior's uncertainty
  EXPECT_GT(s_far, 0.25);
}

// Samples `f` at `first` points, then where the optimiser proposes; the best point found.
std::vector<double> Maximise(size_t dims, const std::function<double(const std::vector<double>&)>& f,
                             const std::vector<std::vector<double>>& first, int budget) {
  BayesianOptimizer bo(dims, 0.05, 7);
  for (const auto& p : first) bo.AddSample(p, f(p));
  auto same = [](const std::vector<double>& p) { return p; };
  while (static_cast<int>(bo.samples()) < budget) {
    auto p = bo.Next(same);
    bo.AddSample(p, f(p));
  }
  return bo.point(bo.best());
}

TEST(BayesianOptimizer, FindsTheMaximumOfAOneDimensionalFunction) {
  // Two local maxima; the global one at 0.73 is the narrower.
  auto f = [](const std::vector<double>& p) {
    const double x = p[0];
    return std::exp(-(x - 0.2) * (x - 0.2) / 0.02) + 1.5 * std::exp(-(x - 0.73) * (x - 0.73) / 0.01);
  };
  auto best = Maximise(1, f, {{0.1}, {0.5}, {0.9}}, 10);
  EXPECT_NEAR(best[0], 0.73, 0.01);
}

TEST(BayesianOptimizer, FindsTheMaximumOfATwoDimensionalFunction) {
  auto f = [](const std::vector<double>& p) {
    const double dx = p[0] - 0.7, dy = p[1] - 0.25;
    return 10 - 30 * (dx * dx + dy * dy) + 0.5 * std::sin(7 * p[0]);  // a tilt that moves the peak a little
  };
  // The true maximum, by brute force on a fine grid.
  std::vector<double> truth{0, 0};
  for (int i = 0; i <= 400; ++i)
    for (int j = 0; j <= 400; ++j)
      if (f({i / 400.0, j / 400.0}) > f(truth)) truth = {i / 400.0, j / 400.0};
  auto best = Maximise(2, f, {{0.5, 0.5}, {0.25, 0.33}, {0.75, 0.67}, {0.125, 0.89}}, 20);
  EXPECT_NEAR(best[0], truth[0], 0.05);
  EXPECT_NEAR(best[1], truth[1], 0.05);
  EXPECT_GT(f(best), f(truth) - 0.05);
}

TEST(BayesianOptimizer, ExpectedImprovementIsHighestWhereTheModelPromisesMost) {
  BayesianOptimizer bo(1, 0.01, 1);
  for (double x : {0.0, 0.25, 0.5}) bo.AddSample({x}, x);  // rising towards 1
  bo.Next([](const std::vector<double>& p) { return p; });
  EXPECT_GT(bo.ExpectedImprovement({0.75}), bo.ExpectedImprovement({0.1}));
  EXPECT_LT(bo.ExpectedImprovement({0.25}), 1e-3);  // a sampled point, no noise: nothing to gain
}

TEST(TunedValues, RoundTripAndHistory) {
  TunedValues v{64 << 20, 2.5, 8 << 20, 2, false};
  TunedValues w;
  ASSERT_TRUE(DecodeTuned(EncodeTuned(v), &w));
  EXPECT_EQ(w.fusion_threshold_bytes, v.fusion_threshold_bytes);
  EXPECT_EQ(w.cycle_time_ms, v.cycle_time_ms);
  EXPECT_EQ(w.zero_bucket_bytes, v.zero_bucket_bytes);
  EXPECT_EQ(w.zero_prefetch, v.zero_prefetch);
  EXPECT_EQ(w.tuning, v.tuning);
  EXPECT_FALSE(DecodeTuned({1, 2, 3}, &w));
  TunedHistory h(TunedValues{});
  h.Append(v);
  int64_t gen = -1;
  EXPECT_EQ(h.Latest(&gen).zero_prefetch, 2);
  EXPECT_EQ(gen, 1);
  EXPECT_TRUE(h.At(0, &w));
  EXPECT_EQ(w.zero_prefetch, 0);
  EXPECT_FALSE(h.At(2, &w));
}

// A simulated job: each step executes tensors "a" and "b" (one cycle each) and lasts
// as long as `step_us` says for the settings in force. The tuner announces, and the
// announcement is in force from the next step, as on every rank of a real job.
struct Simulation {
  Simulation(int warmup, int steps_per_sample, int max_samples) {
    params.autotune = true;
    params.autotune_warmup_samples = warmup;
    params.autotune_steps_per_sample = steps_per_sample;
    params.autotune_max_samples = max_samples;
  }
  Params params;
  std::function<double(const TunedValues&)> step_us;
  std::vector<TunedValues> announced;
  int steps = 0;

  void Run(Autotuner& t, int max_steps) {
    Autotuner::Time now{};
    TunedValues current = StartingValues(params);
    Response a, b;
    a.name = "a";
    b.name = "b";
    a.shape = b.shape = {1 << 18};  // 1 MiB of fp32 each
    for (steps = 0; steps < max_steps && !t.done(); ++steps) {
      for (const Response* r : {&a, &b}) {
        t.Observe(0, {*r});
        TunedValues next;
        if (t.EndCycle(now, &next)) {
          announced.push_back(next);
          current = next;
          t.InForce(next, now);
        }
        now += std::chrono::microseconds(static_cast<int64_t>(step_us(current) / 2));
      }
    }
  }
};

std::vector<std::string> Lines(const std::string& path) {
  std::ifstream f(path);
  std::vector<std::string> out;
  for (std::string line; std::getline(f, line);) out.push_back(line);
  return out;
}

// A row's numeric cells; its phase (the last cell) goes to *phase.
std::vector<double> Fields(const std::string& line, std::string* phase = nullptr) {
  std::vector<std::string> cells;
  std::stringstream ss(line);
  for (std::string cell; std::getline(ss, cell, ',');) cells.push_back(cell);
  if (phase) *phase = cells.back();
  std::vector<double> out;
  for (size_t i = 0; i + 1 < cells.size(); ++i) out.push_back(std::stod(cells[i]));
  return out;
}

std::string Phase(const std::string& line) {
  std::string phase;
  Fields(line, &phase);
  return phase;
}

// Step time of a job fastest at a 16 MiB fusion threshold; 2.1x slower at the starting 128 MiB.
double FastestAt16MiB(const TunedValues& v) {
  const double d = std::log2(v.fusion_threshold_bytes / double(1 << 20)) - 4;
  return 1000.0 * (1 + d * d / 8);
}

TEST(Autotuner, SamplesAsHorovodDoesAndKeepsTheBestSetting) {
  Simulation sim(2, 3, 8);
  sim.params.autotune_log = ::testing::TempDir() + "autotune_log.csv";
  sim.params.autotune_confirm_rounds = 0;  // Horovod's tuner: the best-scoring sample is kept
  sim.params.fixed_cycle_time = true;      // set explicitly: held constant
  sim.params.cycle_time_ms = 3.0;
  sim.step_us = FastestAt16MiB;
  Logger log(LogLevel::kFatal, 0);
  Autotuner t(sim.params, log);
  ASSERT_TRUE(t.Open().ok());
  sim.Run(t, 10000);
  ASSERT_TRUE(t.done());
  // Warm-up and scored samples of 5 sub-samples of 3 steps each (a step or two more for
  // each announcement to take hold).
  const int samples = 2 + 8;
  EXPECT_GE(sim.steps, samples * 5 * 3);
  EXPECT_LE(sim.steps, samples * (5 * 3 + 2));
  ASSERT_EQ(t.dims().size(), 1u);  // the fusion threshold alone: no ZeRO optimizer, cycle time fixed
  // One announcement per scored sample after the first; the last one ends the tuning.
  ASSERT_EQ(sim.announced.size(), 8u);
  for (size_t i = 0; i + 1 < sim.announced.size(); ++i) EXPECT_TRUE(sim.announced[i].tuning);
  const TunedValues& final_values = sim.announced.back();
  EXPECT_FALSE(final_values.tuning);
  for (const auto& v : sim.announced) EXPECT_EQ(v.cycle_time_ms, 3.0);

  auto lines = Lines(sim.params.autotune_log);
  ASSERT_EQ(lines.size(), 1u + 8 + 1);
  EXPECT_EQ(lines[0],
            "hierarchical_allreduce,hierarchical_allgather,torus_allreduce,cache_enabled,cycle_time_ms,"
            "tensor_fusion_threshold,score,zero_bucket_mb,zero_prefetch,phase");
  // The first scored sample is the starting setting; the last row is the best row.
  EXPECT_EQ(Fields(lines[1])[5], 128.0);
  double best_score = 0, best_mb = 0;
  for (size_t i = 1; i <= 8; ++i) {
    std::string phase;
    auto f = Fields(lines[i], &phase);
    ASSERT_EQ(f.size(), 9u);
    EXPECT_EQ(phase, "search");
    EXPECT_EQ(f[0] + f[1] + f[2], 0.0);
    EXPECT_EQ(f[3], 1.0);  // the response cache is on
    EXPECT_EQ(f[4], 3.0);
    if (f[6] > best_score) best_score = f[6], best_mb = f[5];
  }
  std::string phase;
  auto last = Fields(lines.back(), &phase);
  EXPECT_EQ(phase, "kept");
  EXPECT_EQ(last[6], best_score);
  EXPECT_EQ(last[5], best_mb);
  EXPECT_EQ(final_values.fusion_threshold_bytes, static_cast<int64_t>(best_mb) << 20);
  // The score is bytes per microsecond: 2 MiB per step over the step's duration.
  EXPECT_NEAR(best_score, 2.0 * (1 << 20) / sim.step_us(final_values), 0.02 * best_score);
  // Eight samples of a smooth one-dimensional score get near its best (16 MiB).
  EXPECT_GE(final_values.fusion_threshold_bytes, 8ll << 20);
  EXPECT_LE(final_values.fusion_threshold_bytes, 32ll << 20);
  std::remove(sim.params.autotune_log.c_str());
}

TEST(Autotuner, TunesTheZeroSettingsOnlyWhenAnOptimizerUsesThem) {
  Simulation sim(1, 1, 6);
  sim.params.fixed_zero_bucket = true;
  sim.step_us = [](const TunedValues& v) { return 1000.0 + 100.0 * v.zero_prefetch; };
  Logger log(LogLevel::kFatal, 0);
  Autotuner t(sim.params, log);
  t.UseZero(true, true);  // the bucket size was set explicitly: only the prefetch depth joins
  sim.Run(t, 10000);
  ASSERT_TRUE(t.done());
  ASSERT_EQ(t.dims(), (std::vector<Knob>{Knob::kFusionThreshold, Knob::kCycleTime, Knob::kZeroPrefetch}));
  for (const auto& v : sim.announced) {
    EXPECT_EQ(v.zero_bucket_bytes, sim.params.zero_bucket_bytes);
    EXPECT_GE(v.zero_prefetch, 0);
    EXPECT_LE(v.zero_prefetch, 2);
  }
}

TEST(Autotuner, EverySettingFixedEndsAfterOneSample) {
  Simulation sim(0, 1, 20);
  sim.params.fixed_fusion_threshold = sim.params.fixed_cycle_time = true;
  sim.step_us = [](const TunedValues&) { return 100.0; };
  Logger log(LogLevel::kFatal, 0);
  Autotuner t(sim.params, log);
  sim.Run(t, 100);
  EXPECT_TRUE(t.done());
  ASSERT_EQ(sim.announced.size(), 1u);
  EXPECT_FALSE(sim.announced[0].tuning);
  EXPECT_EQ(sim.announced[0].fusion_threshold_bytes, sim.params.fusion_threshold_bytes);
}

// The confirmation's rule on scores given directly: rounds alternate, the candidate
// first; it is kept only when its median beats the start's by more than the spread.
Confirmation Rounds(const std::vector<double>& candidate, const std::vector<double>& start) {
  TunedValues c, s;
  c.fusion_threshold_bytes = 16 << 20;
  s.fusion_threshold_bytes = 128 << 20;
  Confirmation conf(c, s, static_cast<int>(candidate.size()));
  for (size_t i = 0; i < candidate.size(); ++i) {
    EXPECT_EQ(conf.next().fusion_threshold_bytes, c.fusion_threshold_bytes) << "round " << i;
    conf.Add(candidate[i]);
    EXPECT_FALSE(conf.done());
    EXPECT_EQ(conf.next().fusion_threshold_bytes, s.fusion_threshold_bytes) << "round " << i;
    conf.Add(start[i]);
  }
  EXPECT_TRUE(conf.done());
  return conf;
}

TEST(Confirmation, KeepsACandidateFasterBeyondTheSpread) {
  auto c = Rounds({110, 112, 111}, {100, 101, 99});
  EXPECT_EQ(c.candidate_median(), 111);
  EXPECT_EQ(c.start_median(), 100);
  EXPECT_NEAR(c.needed(), 0.02, 1e-12);  // spreads of 1.8% and 2%
  EXPECT_TRUE(c.keep_candidate());
  EXPECT_EQ(c.kept().fusion_threshold_bytes, 16 << 20);
  EXPECT_EQ(c.kept_score(), 111);
}

TEST(Confirmation, KeepsTheStartWhenTheWinIsWithinTheNoise) {
  // 3% ahead in the median, but a round of either may be 15% off another.
  auto noisy = Rounds({103, 95, 110}, {100, 92, 104});
  EXPECT_NEAR(noisy.needed(), 15.0 / 103, 1e-12);
  EXPECT_FALSE(noisy.keep_candidate());
  EXPECT_EQ(noisy.kept().fusion_threshold_bytes, 128 << 20);
  EXPECT_EQ(noisy.kept_score(), 100);
  // Steady, but 1% is below the least win worth a change.
  EXPECT_FALSE(Rounds({101, 101, 101}, {100, 100, 100}).keep_candidate());
  // Slower when measured again.
  EXPECT_FALSE(Rounds({95, 96, 94}, {100, 100, 100}).keep_candidate());
}

TEST(Confirmation, MedianOfAnEvenCountIsTheMeanOfTheMiddleTwo) {
  EXPECT_EQ(Median({4, 1, 3, 2}), 2.5);
  EXPECT_EQ(Median({5}), 5);
  EXPECT_EQ(Median({}), 0);
  EXPECT_TRUE(Rounds({120, 130}, {100, 102}).keep_candidate());  // needs max(2%, 8.3%)
}

// The simulated job of SamplesAsHorovodDoes... (the fusion threshold alone tuned, 8
// samples); its step times follow FastestAt16MiB while the tuner searches and
// `measured_again` once it has announced the first confirmation round.
using StepUs = std::function<double(const TunedValues&)>;

struct Confirmed {
  Confirmed(int rounds, StepUs measured_again) : sim(0, 1, kSearch) {
    sim.params.autotune_confirm_rounds = rounds;
    sim.params.autotune_log = ::testing::TempDir() + "autotune_confirm.csv";
    sim.params.fixed_cycle_time = true;
    sim.step_us = [this, measured_again](const TunedValues& v) {
      return static_cast<int>(sim.announced.size()) < kSearch ? FastestAt16MiB(v) : measured_again(v);
    };
    Logger log(LogLevel::kFatal, 0);
    Autotuner t(sim.params, log);
    EXPECT_TRUE(t.Open().ok());
    sim.Run(t, 10000);
    EXPECT_TRUE(t.done());
    lines = Lines(sim.params.autotune_log);
    std::remove(sim.params.autotune_log.c_str());
  }
  static constexpr int kSearch = 8;
  Simulation sim;
  std::vector<std::string> lines;
  // The search's best-scoring row.
  std::vector<double> Best() const {
    std::vector<double> best{};
    for (int i = 1; i <= kSearch; ++i)
      if (best.empty() || Fields(lines[i])[6] > best[6]) best = Fields(lines[i]);
    return best;
  }
  int64_t kept() const { return sim.announced.back().fusion_threshold_bytes; }
};

constexpr int64_t kStart = 128ll << 20;  // Params' default fusion threshold

TEST(Autotuner, ConfirmationKeepsABestThatIsReallyFaster) {
  Confirmed c(3, FastestAt16MiB);
  const int64_t best = static_cast<int64_t>(c.Best()[5]) << 20;
  ASSERT_NE(best, kStart);
  // Search rows, then best and start in turn, 3 rounds each, then the kept row.
  ASSERT_EQ(c.lines.size(), 1u + 8 + 6 + 1);
  for (int i = 0; i < 6; ++i) {
    const auto& row = c.lines[1 + 8 + i];
    EXPECT_EQ(Phase(row), "confirm");
    EXPECT_EQ(static_cast<int64_t>(Fields(row)[5]) << 20, i % 2 == 0 ? best : kStart) << row;
  }
  // An announcement per sample after the first, each round's included; the last ends the tuning.
  ASSERT_EQ(c.sim.announced.size(), 7u + 1 + 6);
  for (size_t i = 0; i + 1 < c.sim.announced.size(); ++i) EXPECT_TRUE(c.sim.announced[i].tuning);
  EXPECT_FALSE(c.sim.announced.back().tuning);
  EXPECT_EQ(c.kept(), best);
  EXPECT_EQ(Phase(c.lines.back()), "kept");
  EXPECT_EQ(static_cast<int64_t>(Fields(c.lines.back())[5]) << 20, best);
  EXPECT_NEAR(Fields(c.lines.back())[6], 2.0 * (1 << 20) / FastestAt16MiB(c.sim.announced.back()),
              0.02 * Fields(c.lines.back())[6]);
}

TEST(Autotuner, ConfirmationDropsABestThatWasLuckOrIsSlowerMeasuredAgain) {
  const StepUs flat = [](const TunedValues&) { return 1000.0; };  // the search's win was noise
  const StepUs slower = [](const TunedValues& v) { return v.fusion_threshold_bytes == kStart ? 1000.0 : 1100.0; };
  for (const StepUs& again : {flat, slower}) {
    Confirmed c(3, again);
    ASSERT_EQ(c.lines.size(), 1u + 8 + 6 + 1);
    EXPECT_EQ(c.kept(), kStart);
    EXPECT_FALSE(c.sim.announced.back().tuning);
    auto last = Fields(c.lines.back());
    EXPECT_EQ(Phase(c.lines.back()), "kept");
    EXPECT_EQ(static_cast<int64_t>(last[5]) << 20, kStart);  // the row autotune_bench.sh re-runs
    EXPECT_NEAR(last[6], 2.0 * (1 << 20) / 1000.0, 0.02 * last[6]);  // the start's median over its rounds
  }
}

TEST(Autotuner, NoConfirmationRoundsKeepsTheBestScoringAsBefore) {
  Confirmed c(0, [](const TunedValues&) { return 1000.0; });
  ASSERT_EQ(c.lines.size(), 1u + 8 + 1);
  const auto best = c.Best();
  EXPECT_NE(static_cast<int64_t>(best[5]) << 20, kStart);
  EXPECT_EQ(c.kept(), static_cast<int64_t>(best[5]) << 20);  // the lucky sample is kept
  EXPECT_EQ(Fields(c.lines.back()), best);
  ASSERT_EQ(c.sim.announced.size(), 8u);
}

TEST(Autotuner, NothingToConfirmWhenTheStartScoredBest) {
  Simulation sim(0, 1, 6);
  sim.params.fixed_cycle_time = true;
  sim.step_us = [](const TunedValues& v) {
    return 1000.0 + 100 * std::abs(std::log2(v.fusion_threshold_bytes / double(kStart)));  // fastest at the start
  };
  Logger log(LogLevel::kFatal, 0);
  Autotuner t(sim.params, log);
  sim.Run(t, 10000);
  ASSERT_TRUE(t.done());
  ASSERT_EQ(sim.announced.size(), 6u);  // five search points, then the start kept at once
  EXPECT_EQ(sim.announced.back().fusion_threshold_bytes, kStart);
}

TEST(Controller, RankZerosAnnouncementReachesEveryRankInTheSameCycle) {
  const int size = 3, cycles = 4;
  testing::Hub hub(size);
  std::vector<std::vector<std::vector<uint8_t>>> got(size);
  testing::Spawn(size, [&](int rank) {
    testing::InMemoryControlPlane cp(hub, rank);
    Logger log(LogLevel::kFatal, rank);
    Params p;
    Controller c(cp, p, log);
    for (int k = 0; k < cycles; ++k) {
      if (rank == 0 && k == 1) c.Announce({7, 8, 9});
      if (rank == 1 && k == 2) c.Announce({1});  // only rank 0 announces
      CycleResult res;
      ASSERT_TRUE(c.RunCycle({}, false, &res).ok());
      got[rank].push_back(res.announcement);
    }
  });
  for (int r = 0; r < size; ++r) {
    EXPECT_TRUE(got[r][0].empty());
    EXPECT_EQ(got[r][1], (std::vector<uint8_t>{7, 8, 9})) << "rank " << r;
    EXPECT_TRUE(got[r][2].empty()) << "rank " << r;
    EXPECT_TRUE(got[r][3].empty()) << "rank " << r;
  }
}

}  // namespace
}  // namespace hvdz
