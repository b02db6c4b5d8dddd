#include "autotune/gaussian_process.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace hvdz {
namespace {

// In place: the lower triangle of the symmetric n x n matrix `a` becomes L with
// L L^T = a. False when a is not positive definite.
bool Cholesky(std::vector<double>* a, size_t n) {
  std::vector<double>& m = *a;
  for (size_t j = 0; j < n; ++j) {
    double d = m[j * n + j];
    for (size_t k = 0; k < j; ++k) d -= m[j * n + k] * m[j * n + k];
    if (!(d > 0)) return false;
    const double ljj = std::sqrt(d);
    m[j * n + j] = ljj;
    for (size_t i = j + 1; i < n; ++i) {
      double s = m[i * n + j];
      for (size_t k = 0; k < j; ++k) s -= m[i * n + k] * m[j * n + k];
      m[i * n + j] = s / ljj;
    }
  }
  return true;
}

// Solves L z = b for the lower-triangular L.
std::vector<double> ForwardSolve(const std::vector<double>& l, size_t n, std::vector<double> b) {
  for (size_t i = 0; i < n; ++i) {
    for (size_t k = 0; k < i; ++k) b[i] -= l[i * n + k] * b[k];
    b[i] /= l[i * n + i];
  }
  return b;
}

// Solves L^T x = z.
std::vector<double> BackSolve(const std::vector<double>& l, size_t n, std::vector<double> z) {
  for (size_t i = n; i-- > 0;) {
    for (size_t k = i + 1; k < n; ++k) z[i] -= l[k * n + i] * z[k];
    z[i] /= l[i * n + i];
  }
  return z;
}

constexpr double kLengths[] = {0.05, 0.08, 0.12, 0.18, 0.25, 0.35, 0.5, 0.7, 1.0, 1.5};
constexpr double kScales[] = {0.3, 0.5, 0.7, 1.0, 1.4, 2.0};

}  // namespace

double GaussianProcess::Kernel(const std::vector<double>& a, const std::vector<double>& b, double length,
                               double scale) const {
  double d2 = 0;
  for (size_t i = 0; i < a.size(); ++i) d2 += (a[i] - b[i]) * (a[i] - b[i]);
  return scale * scale * std::exp(-d2 / (2 * length * length));
}

double GaussianProcess::Factor(double length, double scale) {
  const size_t n = x_.size();
  chol_.assign(n * n, 0.0);
  for (size_t i = 0; i < n; ++i)
    for (size_t j = 0; j <= i; ++j) chol_[i * n + j] = chol_[j * n + i] = Kernel(x_[i], x_[j], length, scale);
  // A floor under the noise keeps K well conditioned when points repeat.
  const double jitter = std::max(noise_ * noise_, 1e-6);
  for (size_t i = 0; i < n; ++i) chol_[i * n + i] += jitter;
  if (!Cholesky(&chol_, n)) return -std::numeric_limits<double>::infinity();
  const std::vector<double> z = ForwardSolve(chol_, n, y_);
  alpha_ = BackSolve(chol_, n, z);
  // log p(y) = -y^T K^-1 y / 2 - sum log L_ii - n log(2 pi) / 2; y^T K^-1 y = |z|^2.
  double fit = 0, logdet = 0;
  for (size_t i = 0; i < n; ++i) {
    fit += z[i] * z[i];
    logdet += std::log(chol_[i * n + i]);
  }
  return -0.5 * fit - logdet - 0.5 * static_cast<double>(n) * std::log(2 * M_PI);
}

void GaussianProcess::Fit(const std::vector<std::vector<double>>& x, const std::vector<double>& y) {
  x_ = x;
  y_ = y;
  double best = -std::numeric_limits<double>::infinity();
  for (double l : kLengths) {
    for (double s : kScales) {
      const double ll = Factor(l, s);
      if (ll > best) {
        best = ll;
        length_ = l;
        scale_ = s;
      }
    }
  }
  Factor(length_, scale_);
}

void GaussianProcess::Predict(const std::vector<double>& p, double* mean, double* stddev) const {
  const size_t n = x_.size();
  if (n == 0) {
    *mean = 0;
    *stddev = scale_;
    return;
  }
  std::vector<double> k(n);
  for (size_t i = 0; i < n; ++i) k[i] = Kernel(x_[i], p, length_, scale_);
  double m = 0;
  for (size_t i = 0; i < n; ++i) m += k[i] * alpha_[i];
  const std::vector<double> v = ForwardSolve(chol_, n, k);
  double var = scale_ * scale_;
  for (double vi : v) var -= vi * vi;
  *mean = m;
  *stddev = std::sqrt(std::max(var, 0.0));
}

}  // namespace hvdz
