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

std::vector<double> Fields(const std::string& line) {
  std::vector<double> out;
  std::stringstream ss(line);
  for (std::string cell; std::getline(ss, cell, ',');) out.push_back(std::stod(cell));
  return out;
}

TEST(Autotuner, SamplesAsHorovodDoesAndKeepsTheBestSetting) {
  Simulation sim(2, 3, 8);
  sim.params.autotune_log = ::testing::TempDir() + "autotune_log.csv";
  sim.params.fixed_cycle_time = true;  // set explicitly: held constant
  sim.params.cycle_time_ms = 3.0;
  // Fastest at a 16 MiB fusion threshold.
  sim.step_us = [](const TunedValues& v) {
    const double d = std::log2(v.fusion_threshold_bytes / double(1 << 20)) - 4;
    return 1000.0 * (1 + d * d / 8);
  };
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
            "tensor_fusion_threshold,score,zero_bucket_mb,zero_prefetch");
  // The first scored sample is the starting setting; the last row is the best row.
  EXPECT_EQ(Fields(lines[1])[5], 128.0);
  double best_score = 0, best_mb = 0;
  for (size_t i = 1; i <= 8; ++i) {
    auto f = Fields(lines[i]);
    ASSERT_EQ(f.size(), 9u);
    EXPECT_EQ(f[0] + f[1] + f[2], 0.0);
    EXPECT_EQ(f[3], 1.0);  // the response cache is on
    EXPECT_EQ(f[4], 3.0);
    if (f[6] > best_score) best_score = f[6], best_mb = f[5];
  }
  auto last = Fields(lines.back());
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
