// The CPU Adam kernel (csrc/offload/cpu_adam.*) against Adam computed in double,
// on every ISA this CPU has; the ISAs against each other bit for bit; the param
// copies against the cast kernel's rounding. (test/python/test_cpu_adam.py
// compares the same kernel with torch.optim.Adam and AdamW.)
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "fusion/cpu_cast.h"
#include "offload/cpu_adam.h"

namespace hvdz {
namespace {

std::vector<CpuAdamIsa> SupportedIsas() {
  std::vector<CpuAdamIsa> out;
  for (CpuAdamIsa isa : {CpuAdamIsa::kScalar, CpuAdamIsa::kAvx2, CpuAdamIsa::kAvx512})
    if (CpuAdamIsaSupported(isa)) out.push_back(isa);
  return out;
}

// One shard's state and gradient, with the gradient kept in its storage dtype.
struct Shard {
  std::vector<float> param, exp_avg, exp_avg_sq, grad32;
  std::vector<uint16_t> grad16;  // bf16 or fp16 bits
  std::vector<uint16_t> out16;
  std::vector<float> out32;
  DataType grad_type = DataType::kFloat32;

  float GradValue(size_t i) const {
    if (grad_type == DataType::kBFloat16) return BFloat16ToFloat(grad16[i]);
    if (grad_type == DataType::kFloat16) return HalfToFloat(grad16[i]);
    return grad32[i];
  }
  AdamTensors Tensors(DataType out_type, bool with_out) {
    AdamTensors t;
    t.param = param.data();
    t.exp_avg = exp_avg.data();
    t.exp_avg_sq = exp_avg_sq.data();
    t.grad = grad_type == DataType::kFloat32 ? static_cast<const void*>(grad32.data()) : grad16.data();
    t.grad_type = grad_type;
    t.numel = static_cast<int64_t>(param.size());
    if (with_out) {
      t.out_type = out_type;
      t.out = out_type == DataType::kFloat32 ? static_cast<void*>(out32.data()) : out16.data();
    }
    return t;
  }
};

Shard RandomShard(size_t n, DataType grad_type, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> uniform(0.0f, 0.01f);
  Shard s;
  s.grad_type = grad_type;
  for (size_t i = 0; i < n; ++i) {
    s.param.push_back(normal(gen));
    s.exp_avg.push_back(0.1f * normal(gen));
    s.exp_avg_sq.push_back(uniform(gen));
    const float g = normal(gen) * (i % 7 == 0 ? 1e-4f : 1.0f);  // some gradients far below the moments
    s.grad32.push_back(g);
    s.grad16.push_back(grad_type == DataType::kFloat16 ? FloatToHalf(g) : FloatToBFloat16(g));
  }
  s.out16.assign(n, 0);
  s.out32.assign(n, 0.0f);
  return s;
}

Status Step(CpuAdamIsa isa, const AdamHyper& h, const AdamTensors& t, int64_t begin, int64_t end) {
  AdamCoeffs c;
  HVDZ_RETURN_IF_ERROR(MakeAdamCoeffs(h, &c));
  HVDZ_RETURN_IF_ERROR(CheckAdamTensors(t));
  CpuAdamStep(isa, c, t, begin, end);
  return Status::OK();
}

// Adam in double from the same fp32 inputs, and a bound of a few fp32 ulps on
// each result: of the moment's inputs (lerp can cancel) and of the update.
struct Expected {
  double param, exp_avg, exp_avg_sq;
  double param_tol, exp_avg_tol, exp_avg_sq_tol;
};

struct Reference {
  explicit Reference(const AdamHyper& hyper)
      : h(hyper),
        step_size(h.lr / (1 - std::pow(h.beta1, static_cast<double>(h.step)))),
        bias_correction2_sqrt(std::sqrt(1 - std::pow(h.beta2, static_cast<double>(h.step)))) {}

  Expected operator()(double p, double m, double v, double g) const {
    constexpr double kUlps = 4 * std::numeric_limits<float>::epsilon();
    g *= h.maximize ? -h.grad_scale : h.grad_scale;
    if (h.decoupled) p *= 1 - h.lr * h.weight_decay;
    else g += h.weight_decay * p;
    Expected e;
    e.exp_avg_tol = kUlps * (std::fabs(m) + std::fabs(g));
    e.exp_avg = h.beta1 * m + (1 - h.beta1) * g;
    e.exp_avg_sq = h.beta2 * v + (1 - h.beta2) * g * g;
    e.exp_avg_sq_tol = kUlps * e.exp_avg_sq;
    const double denom = std::sqrt(e.exp_avg_sq) / bias_correction2_sqrt + h.eps;
    e.param = p - step_size * e.exp_avg / denom;
    e.param_tol = kUlps * (std::fabs(e.param) + step_size * (std::fabs(m) + std::fabs(g)) / denom);
    return e;
  }

  AdamHyper h;
  double step_size, bias_correction2_sqrt;
};

void ExpectMatchesReference(const Shard& before, const Shard& after, const AdamHyper& h, const std::string& what) {
  const Reference reference(h);
  int bad = 0;
  for (size_t i = 0; i < before.param.size() && bad < 5; ++i) {
    const Expected e = reference(before.param[i], before.exp_avg[i], before.exp_avg_sq[i], before.GradValue(i));
    const bool ok = std::fabs(after.param[i] - e.param) <= e.param_tol &&
                    std::fabs(after.exp_avg[i] - e.exp_avg) <= e.exp_avg_tol &&
                    std::fabs(after.exp_avg_sq[i] - e.exp_avg_sq) <= e.exp_avg_sq_tol;
    if (!ok) {
      ++bad;
      ADD_FAILURE() << what << " element " << i << ": param " << after.param[i] << " vs " << e.param
                    << ", exp_avg " << after.exp_avg[i] << " vs " << e.exp_avg << ", exp_avg_sq "
                    << after.exp_avg_sq[i] << " vs " << e.exp_avg_sq;
    }
  }
}

// Bitwise, except that any NaN equals any NaN.
bool SameFloats(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!(std::isnan(a[i]) && std::isnan(b[i])) && std::memcmp(&a[i], &b[i], 4) != 0) return false;
  return true;
}

std::vector<AdamHyper> HyperVariants() {
  std::vector<AdamHyper> out;
  AdamHyper adamw;
  adamw.lr = 1e-2;
  adamw.weight_decay = 0.01;
  adamw.step = 1;
  out.push_back(adamw);
  AdamHyper later = adamw;  // bias corrections well away from their first-step values
  later.step = 25;
  later.grad_scale = 0.37;
  out.push_back(later);
  AdamHyper l2 = adamw;  // Adam's coupled decay, maximizing
  l2.decoupled = false;
  l2.weight_decay = 0.1;
  l2.maximize = true;
  l2.step = 3;
  out.push_back(l2);
  AdamHyper small_beta = adamw;  // 1 - beta1 >= 0.5: torch's lerp takes its other form
  small_beta.beta1 = 0.3;
  small_beta.beta2 = 0.9;
  small_beta.weight_decay = 0;
  small_beta.eps = 1e-3;
  small_beta.step = 7;
  out.push_back(small_beta);
  return out;
}

class CpuAdamIsaTest : public ::testing::TestWithParam<CpuAdamIsa> {};

TEST_P(CpuAdamIsaTest, MatchesDoubleReferenceForEveryLengthAndDtype) {
  const CpuAdamIsa isa = GetParam();
  for (size_t n : {0, 1, 7, 15, 16, 17, 31, 33, 1000, 1000003}) {
    for (DataType gt : {DataType::kFloat32, DataType::kBFloat16, DataType::kFloat16}) {
      for (const AdamHyper& h : HyperVariants()) {
        if (n > 1000 && (gt != DataType::kBFloat16 || h.step != 1)) continue;  // one long case: time
        Shard before = RandomShard(n, gt, static_cast<uint32_t>(n * 31 + static_cast<int>(gt)));
        Shard after = before;
        ASSERT_TRUE(Step(isa, h, after.Tensors(DataType::kBFloat16, false), 0, n).ok());
        ExpectMatchesReference(before, after,
                               h, std::string(CpuAdamIsaName(isa)) + " n=" + std::to_string(n) + " grad " +
                                      DataTypeName(gt) + " step " + std::to_string(h.step));
      }
    }
  }
}

// Every ISA gives the scalar kernel's bits, over a long shard (whole vectors and a
// tail) and over ranges that start and end off the vector width.
TEST_P(CpuAdamIsaTest, AgreesWithScalarBitForBit) {
  const CpuAdamIsa isa = GetParam();
  const size_t n = 1000003;
  for (auto [gt, h] : {std::pair<DataType, AdamHyper>{DataType::kFloat32, HyperVariants()[1]},
                        {DataType::kBFloat16, HyperVariants()[2]}}) {
    {
      Shard ref = RandomShard(n, gt, 7);
      Shard mine = ref;
      ASSERT_TRUE(Step(CpuAdamIsa::kScalar, h, ref.Tensors(DataType::kFloat32, true), 0, n).ok());
      // Three ranges, as threads would take them: [0, 5), [5, 500001), [500001, n).
      AdamTensors t = mine.Tensors(DataType::kFloat32, true);
      for (auto [b, e] : {std::pair<int64_t, int64_t>{0, 5}, {5, 500001}, {500001, n}}) ASSERT_TRUE(Step(isa, h, t, b, e).ok());
      EXPECT_TRUE(SameFloats(ref.param, mine.param)) << CpuAdamIsaName(isa);
      EXPECT_TRUE(SameFloats(ref.exp_avg, mine.exp_avg)) << CpuAdamIsaName(isa);
      EXPECT_TRUE(SameFloats(ref.exp_avg_sq, mine.exp_avg_sq)) << CpuAdamIsaName(isa);
      EXPECT_TRUE(SameFloats(ref.out32, mine.param)) << "the fp32 copy is the new param";
    }
  }
}

TEST_P(CpuAdamIsaTest, LeavesElementsOutsideTheRangeAlone) {
  Shard s = RandomShard(40, DataType::kFloat16, 3);
  const Shard before = s;
  ASSERT_TRUE(Step(GetParam(), HyperVariants()[0], s.Tensors(DataType::kBFloat16, true), 3, 37).ok());
  for (size_t i : {0, 1, 2, 37, 38, 39}) {
    EXPECT_EQ(s.param[i], before.param[i]) << i;
    EXPECT_EQ(s.exp_avg[i], before.exp_avg[i]) << i;
    EXPECT_EQ(s.exp_avg_sq[i], before.exp_avg_sq[i]) << i;
    EXPECT_EQ(s.out16[i], 0) << i;
  }
  for (size_t i = 3; i < 37; ++i) EXPECT_NE(s.param[i], before.param[i]) << i;
}

// The copy is the new param rounded as the cast kernel rounds (torch's .to()): with
// lr = 0 the param is unchanged, so the copy shows the rounding of chosen values.
TEST_P(CpuAdamIsaTest, ParamCopiesRoundLikeTheCastKernel) {
  auto bits = [](uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  };
  std::vector<float> values = {1.0f, -2.5f, bits(0x3f808000), bits(0x3f818000), bits(0x3f808001), 65504.0f, 65520.0f,
                               1e-8f, 6e-8f, 3e-38f, 1e-45f, bits(0x7f7fffff), 1.00390625f, 1.01171875f,
                               std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                               std::nanf(""), -std::nanf("")};
  std::mt19937 gen(5);
  std::normal_distribution<float> normal;
  while (values.size() < 83) values.push_back(normal(gen) * std::exp2(static_cast<float>(values.size() % 60) - 30));
  for (DataType ot : {DataType::kBFloat16, DataType::kFloat16}) {
    Shard s = RandomShard(values.size(), DataType::kFloat32, 9);
    s.param = values;
    AdamHyper h;
    h.lr = 0;
    ASSERT_TRUE(Step(GetParam(), h, s.Tensors(ot, true), 0, static_cast<int64_t>(values.size())).ok());
    for (size_t i = 0; i < values.size(); ++i) {
      const uint16_t want = ot == DataType::kBFloat16 ? FloatToBFloat16(values[i]) : FloatToHalf(values[i]);
      if (std::isnan(values[i])) {
        EXPECT_TRUE(std::isnan(ot == DataType::kBFloat16 ? BFloat16ToFloat(s.out16[i]) : HalfToFloat(s.out16[i])));
      } else {
        EXPECT_EQ(s.out16[i], want) << DataTypeName(ot) << " of " << values[i];
      }
    }
  }
}

TEST_P(CpuAdamIsaTest, NanGradientMakesNanParamAndCopyOnlyThere) {
  Shard s = RandomShard(33, DataType::kBFloat16, 11);
  s.grad16[20] = 0x7fc0;  // bf16 NaN
  ASSERT_TRUE(Step(GetParam(), HyperVariants()[0], s.Tensors(DataType::kBFloat16, true), 0, 33).ok());
  for (size_t i = 0; i < 33; ++i) {
    EXPECT_EQ(std::isnan(s.param[i]), i == 20) << i;
    EXPECT_EQ(std::isnan(BFloat16ToFloat(s.out16[i])), i == 20) << i;
  }
}

std::string IsaName(const ::testing::TestParamInfo<CpuAdamIsa>& info) { return CpuAdamIsaName(info.param); }

INSTANTIATE_TEST_SUITE_P(EverySupportedIsa, CpuAdamIsaTest, ::testing::ValuesIn(SupportedIsas()), IsaName);

TEST(CpuAdam, ResolvesIsaNames) {
  CpuAdamIsa isa;
  ASSERT_TRUE(ResolveCpuAdamIsa("auto", &isa).ok());
  EXPECT_EQ(isa, SupportedIsas().back());  // the widest
  ASSERT_TRUE(ResolveCpuAdamIsa("scalar", &isa).ok());
  EXPECT_EQ(isa, CpuAdamIsa::kScalar);
  Status s = ResolveCpuAdamIsa("sse9", &isa);
  EXPECT_EQ(s.type(), StatusType::kInvalidArgument);
  EXPECT_NE(s.reason().find("auto, avx512, avx2 or scalar"), std::string::npos) << s.reason();
  for (CpuAdamIsa named : {CpuAdamIsa::kAvx2, CpuAdamIsa::kAvx512}) {
    EXPECT_EQ(ResolveCpuAdamIsa(CpuAdamIsaName(named), &isa).ok(), CpuAdamIsaSupported(named));
  }
}

TEST(CpuAdam, RefusesBadHyperparametersAndDtypes) {
  AdamCoeffs c;
  AdamHyper h;
  h.step = 0;
  EXPECT_NE(MakeAdamCoeffs(h, &c).reason().find("steps count from 1"), std::string::npos);
  h.step = 1;
  h.beta2 = 1.0;
  EXPECT_FALSE(MakeAdamCoeffs(h, &c).ok());
  h.beta2 = 0.999;
  h.lr = std::nan("");
  EXPECT_FALSE(MakeAdamCoeffs(h, &c).ok());
  Shard s = RandomShard(4, DataType::kFloat32, 1);
  AdamTensors t = s.Tensors(DataType::kFloat32, false);
  t.grad_type = DataType::kFloat64;
  EXPECT_NE(CheckAdamTensors(t).reason().find("float32, bfloat16 or float16"), std::string::npos);
  t.grad_type = DataType::kFloat32;
  t.grad = nullptr;
  EXPECT_FALSE(CheckAdamTensors(t).ok());
}

}  // namespace
}  // namespace hvdz
