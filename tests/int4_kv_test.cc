// tests: the `int4` KV policy: the 4-bit codec's error bound and packing (kernels/cpu/int4.h, the
// sizes in core/ops.h), and generation through Int4Kv against fp16 KV (close logits, the
// formula's bytes, no read of untransferred KV). tests/kernels_cuda_test.cc checks the CUDA
// kernels against this codec, bit for bit.
#include "offload/int4_kv.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/generation.h"
#include "core/model_loader.h"
#include "core/ops.h"
#include "kernels/cpu/int4.h"
#include "offload/full_kv.h"
#include "tests/test_util.h"

namespace infinigen {
namespace {

struct Quantised {
  std::vector<uint8_t> codes;
  std::vector<f16> meta;
  std::vector<float> decoded;
};

Quantised round_trip(const std::vector<float>& x) {
  const int64_t d = static_cast<int64_t>(x.size());
  Quantised q;
  q.codes.resize(ops::int4_code_bytes(d));
  q.meta.resize(ops::int4_meta_bytes(d) / sizeof(f16));
  q.decoded.resize(x.size());
  // f16 is its bits (core/dtype.h): the codec reads and writes them as uint16_t.
  uint16_t* meta = reinterpret_cast<uint16_t*>(q.meta.data());
  kernels::cpu::int4_quantize_row(x.data(), d, q.codes.data(), meta);
  kernels::cpu::int4_dequantize_row(q.codes.data(), meta, d, q.decoded.data());
  return q;
}

// |x - x'| <= scale / 2 for every element, with the group's stored scale (plus fp32 rounding of
// the arithmetic).
void expect_within_half_scale(const std::vector<float>& x, const Quantised& q) {
  const int64_t d = static_cast<int64_t>(x.size());
  const int64_t group = ops::int4_group_size(d);
  for (int64_t i = 0; i < d; ++i) {
    const float min = f16_to_float(q.meta[static_cast<size_t>(2 * (i / group))]);
    const float scale = f16_to_float(q.meta[static_cast<size_t>(2 * (i / group) + 1)]);
    const float slack = 1e-6f * (std::fabs(x[static_cast<size_t>(i)]) + std::fabs(min));
    EXPECT_LE(std::fabs(x[static_cast<size_t>(i)] - q.decoded[static_cast<size_t>(i)]),
              scale / 2 + slack)
        << "element " << i << " of " << d << ", x " << x[static_cast<size_t>(i)] << ", scale "
        << scale;
  }
}

TEST(Int4Codec, SizesFollowTheGroupRule) {
  EXPECT_EQ(ops::int4_group_size(128), 64);
  EXPECT_EQ(ops::int4_groups(128), 2);
  EXPECT_EQ(ops::int4_row_bytes(128), 64u + 2 * 4);
  EXPECT_EQ(ops::int4_row_bytes(64), 32u + 4);
  EXPECT_EQ(ops::int4_group_size(16), 16);  // d < 64: one group of d
  EXPECT_EQ(ops::int4_row_bytes(16), 8u + 4);
  testing_util::expect_error([] { ops::int4_group_size(96); }, {"head_dim", "96"});
  testing_util::expect_error([] { ops::int4_group_size(7); }, {"head_dim", "7"});
}

TEST(Int4Codec, RoundTripIsWithinHalfAScale) {
  std::mt19937 rng(7);
  for (int64_t d : {16, 32, 64, 128, 256}) {
    for (float spread : {1e-3f, 0.1f, 1.0f, 30.0f}) {
      std::normal_distribution<float> normal(0.5f, spread);
      std::vector<float> x(static_cast<size_t>(d));
      for (float& v : x) v = normal(rng);
      expect_within_half_scale(x, round_trip(x));
    }
  }
}

TEST(Int4Codec, ValuesOnTheGridAreExact) {
  std::mt19937 rng(3);
  std::uniform_int_distribution<int> code(0, 15);
  for (int64_t d : {16, 64, 128}) {
    std::vector<float> x(static_cast<size_t>(d));
    for (float& v : x) v = -1.0f + 0.25f * static_cast<float>(code(rng));
    for (int64_t g0 = 0; g0 < d; g0 += ops::int4_group_size(d)) {  // each group spans the grid
      x[static_cast<size_t>(g0)] = -1.0f;
      x[static_cast<size_t>(g0 + 1)] = -1.0f + 0.25f * 15;
    }
    EXPECT_EQ(round_trip(x).decoded, x) << d;
  }
}

TEST(Int4Codec, ConstantGroupsAreExactWithScaleZero) {
  for (float c : {0.0f, 0.375f, -2.0f, 1000.0f}) {
    const std::vector<float> x(64, c);
    const Quantised q = round_trip(x);
    EXPECT_EQ(q.decoded, x) << c;
    EXPECT_EQ(f16_to_float(q.meta[1]), 0.0f) << c;
    for (uint8_t byte : q.codes) EXPECT_EQ(byte, 0) << c;
  }
  // One constant group beside a varying one: the groups are independent.
  std::vector<float> x(128, 3.5f);
  for (size_t i = 64; i < 128; ++i) x[i] = static_cast<float>(i) * 0.01f;
  const Quantised q = round_trip(x);
  for (size_t i = 0; i < 64; ++i) EXPECT_EQ(q.decoded[i], 3.5f) << i;
  expect_within_half_scale(x, q);
}

TEST(Int4Codec, ExtremeRangesStayWithinTheBound) {
  std::vector<float> wide(64);
  for (size_t i = 0; i < wide.size(); ++i) wide[i] = (i % 2 ? 60000.0f : -60000.0f) / (1.0f + i);
  expect_within_half_scale(wide, round_trip(wide));
  // A narrow spread far from zero: min rounds down to the fp16 grid (spacing 0.5 at 1000).
  std::vector<float> offset(64);
  for (size_t i = 0; i < offset.size(); ++i) offset[i] = 1000.3f + 1e-3f * static_cast<float>(i);
  expect_within_half_scale(offset, round_trip(offset));
  // Tiny values, where the scale is an fp16 subnormal.
  std::vector<float> tiny(64);
  for (size_t i = 0; i < tiny.size(); ++i) tiny[i] = 1e-6f * static_cast<float>(i % 7) - 2e-6f;
  expect_within_half_scale(tiny, round_trip(tiny));
}

TEST(Int4Codec, PacksTwoCodesPerByteLowNibbleFirst) {
  std::vector<float> x(64);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>((i * 7) % 16);  // min 0, max 15
  const Quantised q = round_trip(x);
  ASSERT_EQ(q.codes.size(), 32u);
  ASSERT_EQ(q.meta.size(), 2u);
  EXPECT_EQ(f16_to_float(q.meta[0]), 0.0f);  // min
  EXPECT_EQ(f16_to_float(q.meta[1]), 1.0f);  // scale
  for (size_t i = 0; i < q.codes.size(); ++i) {
    const uint8_t low = static_cast<uint8_t>((2 * i * 7) % 16);
    const uint8_t high = static_cast<uint8_t>(((2 * i + 1) * 7) % 16);
    EXPECT_EQ(q.codes[i], low | (high << 4)) << i;
  }
  EXPECT_EQ(q.decoded, x);
}

class Int4KvGeneration : public testing_util::MixedLengthRunTest {
 protected:
  struct Run {
    GenerationResult result;
    OffloadStats stats;
  };
  // Generation with the int4 store, or (int4 false) the `full` policy's fp16 KV.
  Run run(bool int4) {
    const auto model = make_model(source_.config, load_weights(source_, Device::Cpu), Device::Cpu);
    TransferEngine engine(Device::Cpu, LinkEmulation{});
    Run r;
    const ModelConfig& config = source_.config;
    const KvStoreFactory factory = [&](int64_t batch,
                                       int64_t capacity) -> std::unique_ptr<KvStore> {
      if (int4) {
        return std::make_unique<Int4Kv>(config, batch, capacity, Device::Cpu, engine, r.stats);
      }
      return std::make_unique<FullKv>(config, batch, capacity, DType::F16, Device::Cpu, 4, engine,
                                      r.stats);
    };
    r.result = generate(*model, request_, {}, factory);
    engine.synchronize();
    return r;
  }

  // opt-tiny (d = 16, one group per row) and a wider variant with two groups of 64 per row.
  void for_each_shape(const std::function<void(const std::string&)>& body) {
    body("opt-tiny d=16");
    source_.config.hidden_size = 256;
    source_.config.num_heads = 2;
    body("d=128");
  }
};

TEST_F(Int4KvGeneration, LogitsStayCloseToFp16Kv) {
  for_each_shape([&](const std::string& shape) {
    const Run full = run(false);
    const Run int4 = run(true);
    const std::vector<float> expected = full.result.last_logits.to_floats();
    const std::vector<float> got = int4.result.last_logits.to_floats();
    ASSERT_EQ(got.size(), expected.size());
    const double error = testing_util::relative_error(got.data(), expected.data(), got.size());
    size_t same = 0, total = 0;
    for (size_t b = 0; b < full.result.tokens.size(); ++b) {
      for (size_t t = 0; t < full.result.tokens[b].size(); ++t) {
        same += full.result.tokens[b][t] == int4.result.tokens[b][t];
        ++total;
      }
    }
    std::printf("[ int4 ] %s: last-step logits relative error %.3e, %zu/%zu tokens as fp16\n",
                shape.c_str(), error, same, total);
    EXPECT_LT(error, 5e-2) << shape;
    // The prefill attends the fresh rows, so the first token is the reference's.
    for (size_t b = 0; b < full.result.tokens.size(); ++b) {
      EXPECT_EQ(int4.result.tokens[b][0], full.result.tokens[b][0]) << shape << " sequence " << b;
    }
  });
}

TEST_F(Int4KvGeneration, MovesExactlyTheFormulaBytes) {
  for_each_shape([&](const std::string& shape) {
    const ModelConfig& c = source_.config;
    const uint64_t L = c.num_layers, B = request_.prompts.size(), H = c.num_heads;
    const uint64_t d = c.head_dim();
    const uint64_t G = d < 64 ? 1 : d / 64;
    const uint64_t row = d / 2 + 4 * G;  // packed nibbles plus (min, scale) fp16 per group
    const uint64_t prompt = 9;           // the longest prompt, padding included
    const Run r = run(true);
    const auto& steps = r.stats.steps();
    ASSERT_EQ(steps.size(), static_cast<size_t>(request_.gen_len)) << shape;
    EXPECT_EQ(steps[0].h2d_bytes, 0u) << shape;
    EXPECT_EQ(steps[0].d2h_bytes, 2 * L * B * prompt * H * row) << shape;
    for (size_t i = 1; i < steps.size(); ++i) {
      const uint64_t n = prompt + i - 1;  // tokens in the pool when decode step i starts
      EXPECT_EQ(steps[i].h2d_bytes, 2 * L * B * n * H * row) << shape << " step " << i;
      EXPECT_EQ(steps[i].d2h_bytes, 2 * L * B * 1 * H * row) << shape << " step " << i;
      uint64_t unpadded = 0;
      for (const auto& prompt_tokens : request_.prompts) {
        unpadded += (n - prompt + prompt_tokens.size()) * H;
      }
      for (const LayerTraffic& layer : steps[i].layers) {
        EXPECT_EQ(layer.kv_h2d_bytes, 2 * B * n * H * row) << shape << " step " << i;
        EXPECT_EQ(layer.kv_d2h_bytes, 2 * B * H * row) << shape << " step " << i;
        EXPECT_EQ(layer.tokens_fetched, unpadded) << shape << " step " << i;
      }
    }
  });
}

TEST_F(Int4KvGeneration, NothingReadsKvThatWasNotTransferred) {
  for_each_shape([&](const std::string& shape) {
    const std::vector<std::vector<int32_t>> expected = run(true).result.tokens;
    set_debug_poison(true);  // staging and loaded codes are NaN until a transfer or decode fills
    EXPECT_EQ(run(true).result.tokens, expected) << shape;
    set_debug_poison(false);
  });
}

TEST_F(Int4KvGeneration, RepeatedRunsAreIdentical) {
  request_.gen_len = 10;
  const std::vector<float> first = run(true).result.last_logits.to_floats();
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(run(true).result.last_logits.to_floats(), first) << "run " << i;
  }
}

}  // namespace
}  // namespace infinigen
