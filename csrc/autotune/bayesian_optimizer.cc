#include "autotune/bayesian_optimizer.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace hvdz {
namespace {

constexpr int kRandomCandidates = 768;
constexpr int kLocalCandidates = 256;
constexpr double kLocalSpread = 0.1;  // of the cube's side

double NormalPdf(double z) { return std::exp(-0.5 * z * z) / std::sqrt(2 * M_PI); }
double NormalCdf(double z) { return 0.5 * std::erfc(-z / std::sqrt(2.0)); }

}  // namespace

BayesianOptimizer::BayesianOptimizer(size_t dims, double noise, uint32_t seed, double xi)
    : dims_(dims), xi_(xi), gp_(noise), rng_(seed) {}

void BayesianOptimizer::AddSample(const std::vector<double>& x, double score) {
  x_.push_back(x);
  y_.push_back(score);
}

size_t BayesianOptimizer::best() const {
  return static_cast<size_t>(std::max_element(y_.begin(), y_.end()) - y_.begin());
}

// Scores in bytes per microsecond differ by orders of magnitude between jobs: the
// model sees them shifted to mean 0 and scaled to unit variance, so that its noise
// and xi mean the same everywhere.
void BayesianOptimizer::Fit() {
  double mean = 0, var = 0;
  for (double y : y_) mean += y;
  mean /= static_cast<double>(y_.size());
  for (double y : y_) var += (y - mean) * (y - mean);
  const double sd = std::sqrt(var / static_cast<double>(y_.size()));
  std::vector<double> z;
  for (double y : y_) z.push_back(sd > 0 ? (y - mean) / sd : y - mean);
  gp_.Fit(x_, z);
  best_mean_ = -std::numeric_limits<double>::infinity();
  for (const auto& x : x_) {
    double m, s;
    gp_.Predict(x, &m, &s);
    best_mean_ = std::max(best_mean_, m);
  }
}

double BayesianOptimizer::ExpectedImprovement(const std::vector<double>& p) const {
  double mean, sd;
  gp_.Predict(p, &mean, &sd);
  if (sd <= 0) return 0;
  const double gain = mean - best_mean_ - xi_;
  const double z = gain / sd;
  return gain * NormalCdf(z) + sd * NormalPdf(z);
}

std::vector<double> BayesianOptimizer::Candidate(bool near_best) {
  std::uniform_real_distribution<double> uniform(0.0, 1.0);
  std::normal_distribution<double> step(0.0, kLocalSpread);
  std::vector<double> p(dims_);
  const std::vector<double>& b = x_[best()];
  for (size_t d = 0; d < dims_; ++d) p[d] = near_best ? std::clamp(b[d] + step(rng_), 0.0, 1.0) : uniform(rng_);
  return p;
}

std::vector<double> BayesianOptimizer::Next(const Snap& snap) {
  Fit();
  std::vector<double> pick;
  double pick_ei = -1;
  for (int i = 0; i < kRandomCandidates + kLocalCandidates; ++i) {
    std::vector<double> p = snap(Candidate(i >= kRandomCandidates));
    const double ei = ExpectedImprovement(p);
    if (ei > pick_ei) {
      pick_ei = ei;
      pick = std::move(p);
    }
  }
  return pick;
}

}  // namespace hvdz
