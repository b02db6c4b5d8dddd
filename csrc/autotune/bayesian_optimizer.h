// Bayesian optimisation of a noisy score over the unit cube: a Gaussian process
// models the score from the samples so far, and the next point is the candidate of
// highest expected improvement (EI) over the best score the model predicts at a
// sampled point (the noisy maximum itself would chase lucky samples).
//
// The candidates are random points of the cube plus perturbations of the best
// sample, judged by EI directly: with at most a few dozen samples in two to four
// dimensions a thousand candidates find EI's maximum as well as a gradient search
// with restarts would, and take well under a millisecond.
#pragma once

#include <cstdint>
#include <functional>
#include <random>
#include <vector>

#include "autotune/gaussian_process.h"

namespace hvdz {

class BayesianOptimizer {
 public:
  // Maps a point of the cube to the nearest one the caller can use (whole MiB, whole
  // numbers), so that EI is judged where the sample will really be taken.
  using Snap = std::function<std::vector<double>(const std::vector<double>&)>;

  // `noise`: the observation noise of the model, on scores scaled to unit variance.
  // `xi`: the least improvement worth exploring for, in the same units.
  BayesianOptimizer(size_t dims, double noise, uint32_t seed, double xi = 0.01);

  void AddSample(const std::vector<double>& x, double score);
  // The point of highest expected improvement. Needs one sample at least.
  std::vector<double> Next(const Snap& snap);
  // EI at p under the model of the last Next() (a test hook).
  double ExpectedImprovement(const std::vector<double>& p) const;

  size_t samples() const { return x_.size(); }
  // The sample with the highest score, and its point.
  size_t best() const;
  const std::vector<double>& point(size_t i) const { return x_[i]; }
  double score(size_t i) const { return y_[i]; }

 private:
  void Fit();
  std::vector<double> Candidate(bool near_best);

  size_t dims_;
  double xi_;
  GaussianProcess gp_;
  std::mt19937 rng_;
  std::vector<std::vector<double>> x_;
  std::vector<double> y_;
  double best_mean_ = 0;  // the model's highest mean at a sampled point
};

}  // namespace hvdz
