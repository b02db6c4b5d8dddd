// CPU cast kernels: round to nearest, ties to even, at the edges that matter.
// (test/python/test_cast.py compares the same kernels with torch on random data.)
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "fusion/cpu_cast.h"

namespace hvdz {
namespace {

float Bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

TEST(CpuCast, BFloat16RoundsToNearestEven) {
  EXPECT_EQ(FloatToBFloat16(1.0f), 0x3f80);
  EXPECT_EQ(FloatToBFloat16(Bits(0x3f808000)), 0x3f80);  // halfway, even below: down
  EXPECT_EQ(FloatToBFloat16(Bits(0x3f818000)), 0x3f82);  // halfway, odd below: up
  EXPECT_EQ(FloatToBFloat16(Bits(0x3f808001)), 0x3f81);  // just past halfway: up
  EXPECT_EQ(FloatToBFloat16(-2.0f), 0xc000);
  EXPECT_EQ(FloatToBFloat16(std::numeric_limits<float>::infinity()), 0x7f80);
  EXPECT_TRUE(std::isnan(BFloat16ToFloat(FloatToBFloat16(std::nanf("")))));
  EXPECT_EQ(FloatToBFloat16(Bits(0x7f7fffff)), 0x7f80);  // max float rounds to inf
}

TEST(CpuCast, HalfRoundsToNearestEvenIncludingSubnormalsAndOverflow) {
  EXPECT_EQ(FloatToHalf(1.0f), 0x3c00);
  EXPECT_EQ(FloatToHalf(65504.0f), 0x7bff);
  EXPECT_EQ(FloatToHalf(65519.0f), 0x7bff);
  EXPECT_EQ(FloatToHalf(65520.0f), 0x7c00);  // halfway to 65536: ties to even = inf
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(FloatToHalf(std::ldexp(1.0f, -25)), 0x0000);  // halfway to the smallest subnormal
  EXPECT_EQ(FloatToHalf(std::ldexp(3.0f, -25)), 0x0002);
  EXPECT_EQ(FloatToHalf(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // halfway, even: down
  EXPECT_EQ(FloatToHalf(1.0f + std::ldexp(3.0f, -11)), 0x3c02);  // halfway, odd: up
  EXPECT_EQ(FloatToHalf(-0.0f), 0x8000);
  EXPECT_TRUE(std::isnan(HalfToFloat(FloatToHalf(std::nanf("")))));
}

TEST(CpuCast, EveryHalfAndBFloat16ValueRoundTrips) {
  for (uint32_t h = 0; h < 65536; ++h) {
    float f = HalfToFloat(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(FloatToHalf(f), h) << std::hex << h;
    float g = BFloat16ToFloat(static_cast<uint16_t>(h));
    if (std::isnan(g)) continue;
    ASSERT_EQ(FloatToBFloat16(g), h) << std::hex << h;
  }
}

TEST(CpuCast, BatchedCopyCastsAndScalesEveryRange) {
  std::vector<float> a{1.f, 2.f, 3.f}, b{4.f, 5.f};
  std::vector<uint16_t> out(5, 0xffff);
  CpuBatchedCopy({{a.data(), out.data(), 3}, {b.data(), out.data() + 3, 2}}, DataType::kFloat32,
                 DataType::kBFloat16, 0.5);
  for (int i = 0; i < 5; ++i) EXPECT_EQ(BFloat16ToFloat(out[i]), 0.5f * (i + 1));
  std::vector<int64_t> ints{1, -2, 3}, copy(3, 0);
  CpuBatchedCopy({{ints.data(), copy.data(), 3}}, DataType::kInt64, DataType::kInt64, 1.0);
  EXPECT_EQ(copy, ints);
  std::vector<double> d{0.25, 1e300};
  CpuBatchedCopy({{d.data(), d.data(), 2}}, DataType::kFloat64, DataType::kFloat64, 2.0);  // in place
  EXPECT_EQ(d[0], 0.5);
}

// Horovod's ScaleBuffer: fp32 multiplies by (float) factor in float, not in double.
TEST(CpuCast, Float32ScalesInFloatWithTheFactorRoundedToFloat) {
  std::vector<float> x{1.37f}, out(1);
  CpuBatchedCopy({{x.data(), out.data(), 1}}, DataType::kFloat32, DataType::kFloat32, 0.1);
  EXPECT_EQ(out[0], 0.1f * 1.37f);
  EXPECT_NE(out[0], static_cast<float>(0.1 * static_cast<double>(1.37f)));  // the two differ here
}

}  // namespace
}  // namespace hvdz
