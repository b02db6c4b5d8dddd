// A Gaussian-process regression over points of the unit cube, small enough to
// refit from scratch after every sample: the autotuner holds at most a few dozen
// points, so plain dense matrices and a Cholesky factorisation are all it needs
// (no linear-algebra library).
#pragma once

#include <vector>

namespace hvdz {

class GaussianProcess {
 public:
  // `noise`: the standard deviation of the observation noise, in the units of the
  // (standardised) values it is fitted to.
  explicit GaussianProcess(double noise) : noise_(noise) {}

  // Fits x (points of the same dimension) to y. The kernel is a squared exponential
  // k(a, b) = s^2 exp(-|a - b|^2 / (2 l^2)); its length l and scale s are the pair of
  // a fixed grid that makes y most likely (highest log marginal likelihood).
  // A grid rather than gradient steps: the likelihood of a few points is flat and
  // multimodal, and 60 small factorisations cost well under a millisecond.
  void Fit(const std::vector<std::vector<double>>& x, const std::vector<double>& y);

  // The posterior mean and standard deviation of the function (noise excluded) at `p`.
  void Predict(const std::vector<double>& p, double* mean, double* stddev) const;

  double length() const { return length_; }
  double scale() const { return scale_; }

 private:
  double Kernel(const std::vector<double>& a, const std::vector<double>& b, double length, double scale) const;
  // Factorises the noisy kernel matrix of x_ for (length, scale) into chol_ and
  // alpha_ = K^-1 y; returns the log marginal likelihood (-inf if K is not positive definite).
  double Factor(double length, double scale);

  double noise_;
  double length_ = 0.3;
  double scale_ = 1.0;
  std::vector<std::vector<double>> x_;
  std::vector<double> y_;
  std::vector<double> chol_;   // lower triangle of K + noise^2 I, row-major n x n
  std::vector<double> alpha_;  // K^-1 y
};

}  // namespace hvdz
