// tests: fp16/bf16 conversions and Tensor basics.
#include "core/dtype.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "core/tensor.h"

namespace infinigen {
namespace {

TEST(DType, F16RoundTripsEveryFiniteValue) {
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const f16 h{static_cast<uint16_t>(bits)};
    const float f = f16_to_float(h);
    if (std::isnan(f)) continue;
    EXPECT_EQ(float_to_f16(f).bits, h.bits) << "bits " << bits;
  }
}

TEST(DType, F16RoundsToNearestEven) {
  EXPECT_EQ(f16_to_float(float_to_f16(1.0f + 1.0f / 4096.0f)), 1.0f);  // halfway, even stays
  EXPECT_EQ(f16_to_float(float_to_f16(65504.0f)), 65504.0f);
  EXPECT_TRUE(std::isinf(f16_to_float(float_to_f16(70000.0f))));
  EXPECT_EQ(f16_to_float(float_to_f16(5.9604645e-8f)), 5.9604645e-8f);  // smallest subnormal
}

TEST(DType, Bf16KeepsRangeAndRounds) {
  EXPECT_EQ(bf16_to_float(float_to_bf16(1e30f)), bf16_to_float(float_to_bf16(1e30f)));
  EXPECT_NEAR(bf16_to_float(float_to_bf16(3.14159f)), 3.14159f, 0.01f);
  EXPECT_EQ(bf16_to_float(float_to_bf16(-2.0f)), -2.0f);
}

TEST(DType, BulkConversionMatchesScalar) {
  std::vector<float> values;
  for (int i = -500; i < 500; ++i) values.push_back(static_cast<float>(i) * 0.37f);
  Tensor t = Tensor::from_floats({static_cast<int64_t>(values.size())}, values);
  Tensor h = t.to_dtype(DType::F16);
  for (size_t i = 0; i < values.size(); ++i) {
    EXPECT_EQ(h.data<f16>()[i].bits, float_to_f16(values[i]).bits);
  }
  const std::vector<float> back = h.to_floats();
  for (size_t i = 0; i < values.size(); ++i)
    EXPECT_EQ(back[i], f16_to_float(float_to_f16(values[i])));
}

TEST(Tensor, ShapeAndTypeChecks) {
  Tensor t = Tensor::zeros({2, 3}, DType::F32);
  EXPECT_EQ(t.numel(), 6);
  EXPECT_EQ(t.dim(-1), 3);
  EXPECT_THROW(t.data<f16>(), Error);
  EXPECT_THROW(t.reshape({4, 2}), Error);
  EXPECT_EQ(t.slice_rows(1, 2).numel(), 3);
  EXPECT_THROW(t.slice_rows(1, 3), Error);
}

}  // namespace
}  // namespace infinigen
