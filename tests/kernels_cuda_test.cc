// tests: every op on CUDA tensors against the CPU backend on the same random inputs, on the
// default stream and on a stream of their own, and the ops' persistent scratch (the index upload
// ring, the GEMM scratch) under growth, wrap-around and two streams (label gpu; each test skips
// when no CUDA device is present).
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <ostream>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "core/generation.h"
#include "core/kv_cache.h"
#include "core/model.h"
#include "core/model_config.h"
#include "core/model_loader.h"
#include "core/ops.h"
#include "core/rope.h"
#include "core/stream.h"
#include "core/synthetic_model.h"
#include "kernels/cuda/runtime.h"
#include "offload/runtime.h"
#include "tests/test_util.h"

namespace infinigen {
namespace {

using testing_util::relative_error;

class CudaOps : public ::testing::Test {
 protected:
  void SetUp() override { INFINIGEN_SKIP_WITHOUT_CUDA_DEVICE(); }
};

template <typename Param>
class CudaOpsWith : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override { INFINIGEN_SKIP_WITHOUT_CUDA_DEVICE(); }
};

// A CPU tensor of `dtype` holding normal(0, scale) values (rounded to dtype).
Tensor random_tensor(Shape shape, uint64_t seed, float scale = 1.0f, DType dtype = DType::F32) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> values(static_cast<size_t>(shape_numel(shape)));
  for (float& x : values) x = normal(rng);
  const Tensor t = Tensor::from_floats(std::move(shape), values);
  return dtype == DType::F32 ? t : t.to_dtype(dtype);
}

// An output tensor on `device` filled with NaN, so that an element a kernel forgot to write
// shows up in the comparison.
Tensor nan_tensor(const Shape& shape, Device device, DType dtype = DType::F32) {
  Tensor t = Tensor::empty(shape, dtype, device);
  fill_nan(t);
  return t;
}

// ||cuda - cpu|| / ||cpu||; NaN (a failure) when either holds a NaN.
double error_vs_cpu(const Tensor& cuda, const Tensor& cpu) {
  EXPECT_EQ(cuda.device(), Device::Cuda);
  EXPECT_EQ(cuda.shape(), cpu.shape());
  const std::vector<float> a = cuda.to_floats(), b = cpu.to_floats();
  return relative_error(a.data(), b.data(), b.size());
}

// Element-wise identity, NaN matching NaN (for caches whose untouched rows are NaN).
void expect_same_values(const Tensor& cuda, const Tensor& cpu) {
  const std::vector<float> a = cuda.to_floats(), b = cpu.to_floats();
  ASSERT_EQ(a.size(), b.size());
  size_t mismatches = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const bool same = (std::isnan(a[i]) && std::isnan(b[i])) || a[i] == b[i];
    if (!same && mismatches++ == 0)
      ADD_FAILURE() << "element " << i << ": " << a[i] << " vs " << b[i];
  }
  EXPECT_EQ(mismatches, 0u);
}

// Tolerance of a result computed from operands of `dtype`: the CUDA GEMM rounds activations to
// 16-bit weights' type, the CPU does not; everything else differs only in summation order.
double tolerance(DType dtype) {
  switch (dtype) {
    case DType::F16:
      return 2e-3;
    case DType::BF16:
      return 1.5e-2;
    default:
      return 1e-5;
  }
}

// ---- linear ----

struct GemmShape {
  int64_t M, N, K;
};
std::ostream& operator<<(std::ostream& out, const GemmShape& s) {
  return out << s.M << "x" << s.N << "x" << s.K;
}

class CudaLinear : public CudaOpsWith<std::tuple<DType, GemmShape>> {};

TEST_P(CudaLinear, MatchesCpu) {
  const auto [w_type, shape] = GetParam();
  const auto [M, N, K] = shape;
  const Tensor x = random_tensor({M, K}, 1);
  const Tensor w = random_tensor({N, K}, 2, 0.05f, w_type);
  const Tensor bias = random_tensor({N}, 3);
  const Tensor x_d = x.to(Device::Cuda), w_d = w.to(Device::Cuda), bias_d = bias.to(Device::Cuda);
  for (bool with_bias : {false, true}) {
    for (bool relu : {false, true}) {
      Tensor y = nan_tensor({M, N}, Device::Cpu), y_d = nan_tensor({M, N}, Device::Cuda);
      ops::linear(x, w, with_bias ? bias : Tensor(), y, relu);
      ops::linear(x_d, w_d, with_bias ? bias_d : Tensor(), y_d, relu);
      EXPECT_LT(error_vs_cpu(y_d, y), tolerance(w_type))
          << "bias " << with_bias << " relu " << relu;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    WeightTypesAndShapes, CudaLinear,
    ::testing::Combine(::testing::Values(DType::F32, DType::F16, DType::BF16),
                       ::testing::Values(GemmShape{1, 131, 67}, GemmShape{5, 64, 64},
                                         GemmShape{33, 257, 128}, GemmShape{128, 768, 768},
                                         GemmShape{7, 3072, 768})));

// ---- layer norm, embedding, elementwise ----

struct NormShape {
  int64_t rows, cols;
};
std::ostream& operator<<(std::ostream& out, const NormShape& s) {
  return out << s.rows << "x" << s.cols;
}

class CudaLayerNorm : public CudaOpsWith<NormShape> {};

TEST_P(CudaLayerNorm, MatchesCpuAlsoInPlace) {
  const auto [rows, cols] = GetParam();
  Tensor x = random_tensor({rows, cols}, 4, 3.0f);
  x.data<float>()[cols / 2] = 400.0f;  // an outlier channel, as OPT has
  // A row with a large mean: one-pass statistics (E[x^2] - mean^2) cancel there.
  for (int64_t c = 0; c < cols; ++c) x.data<float>()[(rows - 1) * cols + c] += 200.0f;
  const Tensor gamma = random_tensor({cols}, 5), beta = random_tensor({cols}, 6);
  const Tensor gamma_d = gamma.to(Device::Cuda), beta_d = beta.to(Device::Cuda);
  Tensor y = nan_tensor({rows, cols}, Device::Cpu), y_d = nan_tensor({rows, cols}, Device::Cuda);
  ops::layer_norm(x, gamma, beta, 1e-5f, y);
  ops::layer_norm(x.to(Device::Cuda), gamma_d, beta_d, 1e-5f, y_d);
  EXPECT_LT(error_vs_cpu(y_d, y), 1e-5);
  Tensor in_place = x.to(Device::Cuda);
  ops::layer_norm(in_place, gamma_d, beta_d, 1e-5f, in_place);
  EXPECT_LT(error_vs_cpu(in_place, y), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaLayerNorm,
                         ::testing::Values(NormShape{1, 64}, NormShape{7, 96}, NormShape{3, 768},
                                           NormShape{5, 4097}, NormShape{300, 1024}));

class CudaRmsNorm : public CudaOpsWith<NormShape> {};

TEST_P(CudaRmsNorm, MatchesCpuAlsoInPlace) {
  const auto [rows, cols] = GetParam();
  Tensor x = random_tensor({rows, cols}, 40, 3.0f);
  x.data<float>()[cols / 2] = 400.0f;  // a massive activation, as trained models have
  const Tensor gamma = random_tensor({cols}, 41);
  const Tensor gamma_d = gamma.to(Device::Cuda);
  Tensor y = nan_tensor({rows, cols}, Device::Cpu), y_d = nan_tensor({rows, cols}, Device::Cuda);
  ops::rms_norm(x, gamma, 1e-6f, y);
  ops::rms_norm(x.to(Device::Cuda), gamma_d, 1e-6f, y_d);
  EXPECT_LT(error_vs_cpu(y_d, y), 1e-5);
  Tensor in_place = x.to(Device::Cuda);
  ops::rms_norm(in_place, gamma_d, 1e-6f, in_place);
  EXPECT_LT(error_vs_cpu(in_place, y), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaRmsNorm,
                         ::testing::Values(NormShape{1, 64}, NormShape{7, 96}, NormShape{3, 3584},
                                           NormShape{5, 4097}, NormShape{300, 4096}));

// RoPE at positions up to 100k (llama3-scaled frequencies, angles of thousands of radians):
// the device's sincosf must agree with the host's cos/sin to fp32 rounding.
TEST_F(CudaOps, RopeMatchesCpuAtLongPositions) {
  const int64_t rows = 37, heads = 6, d = 128;
  RopeConfig rope;
  rope.theta = 500000.0;
  rope.scaling = RopeConfig::Scaling::Llama3;
  rope.factor = 8.0;
  rope.high_freq_factor = 4.0;
  rope.original_max_positions = 8192;
  const Tensor inv_freq = Tensor::from_floats({d / 2}, rope_inv_freq(rope, d));
  std::vector<int32_t> positions(rows);
  for (int64_t r = 0; r < rows; ++r) positions[r] = static_cast<int32_t>(r * 2777);
  Tensor x = random_tensor({rows, heads * d}, 42);
  Tensor x_d = x.to(Device::Cuda);
  ops::rope(x, positions, inv_freq);
  ops::rope(x_d, positions, inv_freq.to(Device::Cuda));
  EXPECT_LT(error_vs_cpu(x_d, x), 1e-5);
}

TEST_F(CudaOps, SiluMulMatchesCpu) {
  const int64_t n = 1000003;
  Tensor gate = random_tensor({n}, 43, 4.0f), up = random_tensor({n}, 44);
  Tensor gate_d = gate.to(Device::Cuda);
  ops::silu_mul(gate, up);
  ops::silu_mul(gate_d, up.to(Device::Cuda));
  EXPECT_LT(error_vs_cpu(gate_d, gate), 1e-6);
}

class CudaEmbed : public CudaOpsWith<DType> {};

TEST_P(CudaEmbed, MatchesCpu) {
  const DType type = GetParam();
  const int64_t vocab = 100, max_positions = 40, D = 96, n = 23;
  const Tensor tokens_table = random_tensor({vocab, D}, 7, 1.0f, type);
  const Tensor positions_table = random_tensor({max_positions, D}, 8, 1.0f, type);
  std::mt19937 rng(9);
  std::vector<int32_t> tokens(n), positions(n);
  for (int64_t i = 0; i < n; ++i) {
    tokens[i] = static_cast<int32_t>(rng() % vocab);
    positions[i] = static_cast<int32_t>(rng() % max_positions);
  }
  Tensor out = nan_tensor({n, D}, Device::Cpu), out_d = nan_tensor({n, D}, Device::Cuda);
  ops::embed(tokens, positions, tokens_table, positions_table, out);
  ops::embed(tokens, positions, tokens_table.to(Device::Cuda), positions_table.to(Device::Cuda),
             out_d);
  EXPECT_LT(error_vs_cpu(out_d, out), 1e-7);
}

INSTANTIATE_TEST_SUITE_P(TableTypes, CudaEmbed,
                         ::testing::Values(DType::F32, DType::F16, DType::BF16));

TEST_F(CudaOps, AddAndScaleMatchCpu) {
  const int64_t n = 1000003;  // odd: the tail of a grid-stride loop
  Tensor y = random_tensor({n}, 10), x = random_tensor({n}, 11);
  Tensor y_d = y.to(Device::Cuda);
  ops::add_inplace(y, x);
  ops::add_inplace(y_d, x.to(Device::Cuda));
  EXPECT_LT(error_vs_cpu(y_d, y), 1e-7);
  ops::scale_inplace(y, 0.125f);
  ops::scale_inplace(y_d, 0.125f);
  EXPECT_LT(error_vs_cpu(y_d, y), 1e-7);
}

TEST_F(CudaOps, MixedDevicesAreRefused) {
  const Tensor y_d = Tensor::zeros({4}, DType::F32, Device::Cuda);
  Tensor y = Tensor::zeros({4}, DType::F32);
  testing_util::expect_error([&] { ops::add_inplace(y, y_d); },
                             {"add", "tensors on different devices"});
}

// ---- attention ----

// Test names from a case's operator<< (letters, digits and underscores only).
template <typename Case>
std::string case_name(const ::testing::TestParamInfo<Case>& param_info) {
  std::ostringstream name;
  name << param_info.param;
  return name.str();
}

struct PrefillCase {
  int64_t B, n, H, d;
  std::vector<int32_t> first_valid;
  int64_t H_kv = 0;  // KV heads (grouped queries when fewer than H); 0: H
  int64_t kv_heads() const { return H_kv > 0 ? H_kv : H; }
};
std::ostream& operator<<(std::ostream& out, const PrefillCase& c) {
  out << "B" << c.B << "_n" << c.n << "_H" << c.H << "_d" << c.d << "_pad";
  for (int32_t f : c.first_valid) out << "_" << f;
  if (c.kv_heads() != c.H) out << "_kv" << c.kv_heads();
  return out;
}

class CudaPrefill : public CudaOpsWith<PrefillCase> {};

TEST_P(CudaPrefill, MatchesCpuWithLeftPadding) {
  const PrefillCase& c = GetParam();
  const int64_t rows = c.B * c.n, D = c.H * c.d, D_kv = c.kv_heads() * c.d;
  // Logits of std ~3 after the 1/sqrt(d) scaling: peaked enough to exercise the running max.
  const Tensor q = random_tensor({rows, D}, 12, 3.0f / std::sqrt(static_cast<float>(c.d)));
  const Tensor k = random_tensor({rows, D_kv}, 13), v = random_tensor({rows, D_kv}, 14);
  Tensor out = nan_tensor({rows, D}, Device::Cpu), out_d = nan_tensor({rows, D}, Device::Cuda);
  ops::attention_prefill(q, k, v, out, c.B, c.H, c.first_valid);
  ops::attention_prefill(q.to(Device::Cuda), k.to(Device::Cuda), v.to(Device::Cuda), out_d, c.B,
                         c.H, c.first_valid);
  EXPECT_LT(error_vs_cpu(out_d, out), 1e-5);
  // Padding rows are exactly zero, not merely close.
  const std::vector<float> got = out_d.to_floats();
  for (int64_t b = 0; b < c.B; ++b) {
    for (int64_t t = 0; t < c.first_valid[static_cast<size_t>(b)]; ++t) {
      for (int64_t e = 0; e < D; ++e)
        ASSERT_EQ(got[static_cast<size_t>((b * c.n + t) * D + e)], 0.0f);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaPrefill,
    ::testing::Values(PrefillCase{1, 1, 1, 64, {0}},            // a single token
                      PrefillCase{2, 17, 3, 64, {0, 5}},        // odd n inside one query tile
                      PrefillCase{3, 37, 2, 128, {0, 20, 36}},  // last sequence: one real token
                      PrefillCase{2, 150, 2, 64, {0, 77}},      // many key tiles, padding mid-tile
                      PrefillCase{2, 129, 4, 128, {3, 128}},    // n one past a tile boundary
                      PrefillCase{1, 65, 2, 80, {1}},           // d not a multiple of 32 (OPT-2.7B)
                      PrefillCase{2, 45, 2, 16, {0, 2}},        // d below a warp (opt-tiny)
                      PrefillCase{1, 40, 1, 256, {0}},          // opt-in shared memory size
                      // grouped queries: query head h reads KV head h / (H / H_kv)
                      PrefillCase{2, 37, 8, 64, {0, 9}, 2},   // 4 query heads per KV head
                      PrefillCase{1, 20, 6, 128, {3}, 3},     // 2 per KV head
                      PrefillCase{2, 18, 4, 32, {0, 1}, 1}),  // multi-query: one KV head
    case_name<PrefillCase>);

struct DecodeCase {
  int64_t B, H, d, capacity, n;  // n tokens stored by a prefill, then m more (1: a decode step)
  std::vector<int32_t> first_valid;
  DType cache_type;
  // Shared prefixes: each sequence's group (-1: none) and each group's length; none when empty.
  std::vector<int32_t> prefix_groups = {};
  std::vector<int64_t> prefix_lengths = {};
  int64_t m = 1;
  int64_t H_kv = 0;  // KV heads (grouped queries when fewer than H); 0: H
  int64_t kv_heads() const { return H_kv > 0 ? H_kv : H; }
};
std::ostream& operator<<(std::ostream& out, const DecodeCase& c) {
  out << "B" << c.B << "_H" << c.H << "_d" << c.d << "_cap" << c.capacity << "_n" << c.n << "_pad";
  for (int32_t f : c.first_valid) out << "_" << f;
  for (int64_t length : c.prefix_lengths) out << "_shared" << length;
  if (c.m > 1) out << "_extend" << c.m;
  if (c.kv_heads() != c.H) out << "_kv" << c.kv_heads();
  return out << "_" << dtype_name(c.cache_type);
}

class CudaDecode : public CudaOpsWith<DecodeCase> {};

TEST_P(CudaDecode, CacheStoreAndDecodeMatchCpu) {
  const DecodeCase& c = GetParam();
  const int64_t D = c.H * c.d, D_kv = c.kv_heads() * c.d, length = c.n + c.m;
  const Shape cache_shape = {c.B, c.kv_heads(), c.capacity, c.d};
  // Caches start as NaN on both devices: a read outside [first_valid, length) poisons the result.
  Tensor k_cache = nan_tensor(cache_shape, Device::Cpu, c.cache_type);
  Tensor v_cache = nan_tensor(cache_shape, Device::Cpu, c.cache_type);
  Tensor k_cache_d = nan_tensor(cache_shape, Device::Cuda, c.cache_type);
  Tensor v_cache_d = nan_tensor(cache_shape, Device::Cuda, c.cache_type);
  const Tensor k_prompt = random_tensor({c.B * c.n, D_kv}, 15),
               v_prompt = random_tensor({c.B * c.n, D_kv}, 16);
  const Tensor k_step = random_tensor({c.B * c.m, D_kv}, 17),
               v_step = random_tensor({c.B * c.m, D_kv}, 18);
  ops::cache_store(k_prompt, k_cache, 0);
  ops::cache_store(v_prompt, v_cache, 0);
  ops::cache_store(k_step, k_cache, c.n);
  ops::cache_store(v_step, v_cache, c.n);
  ops::cache_store(k_prompt.to(Device::Cuda), k_cache_d, 0);
  ops::cache_store(v_prompt.to(Device::Cuda), v_cache_d, 0);
  ops::cache_store(k_step.to(Device::Cuda), k_cache_d, c.n);
  ops::cache_store(v_step.to(Device::Cuda), v_cache_d, c.n);
  expect_same_values(k_cache_d, k_cache);
  expect_same_values(v_cache_d, v_cache);

  const SharedPrefixes shared = c.prefix_lengths.empty()
                                    ? SharedPrefixes()
                                    : SharedPrefixes(c.prefix_groups, c.prefix_lengths);
  const Tensor q = random_tensor({c.B * c.m, D}, 19, 3.0f / std::sqrt(static_cast<float>(c.d)));
  Tensor out = nan_tensor({c.B * c.m, D}, Device::Cpu),
         out_d = nan_tensor({c.B * c.m, D}, Device::Cuda);
  ops::attention_decode(q, k_cache, v_cache, out, length, c.first_valid, &shared);
  ops::attention_decode(q.to(Device::Cuda), k_cache_d, v_cache_d, out_d, length, c.first_valid,
                        &shared);
  // Both read the same rounded cache values, so fp16 caches need no looser tolerance.
  EXPECT_LT(error_vs_cpu(out_d, out), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaDecode,
    ::testing::Values(
        DecodeCase{1, 1, 64, 8, 1, {0}, DType::F32},  // two rows: most warps idle
        DecodeCase{3, 4, 64, 48, 30, {8, 12, 20}, DType::F16, {0, 0, 0}, {8}},
        // two groups' prefixes (sequences 0 and 2, 1 and 3) and one unshared
        DecodeCase{5, 2, 64, 48, 30, {8, 12, 20, 9, 16}, DType::F16, {0, 1, 0, 1, -1}, {8, 4}},
        // an extension by 6 rows, causal, sequence 1's first 3 of them padding
        DecodeCase{3, 2, 64, 48, 30, {8, 33, 20}, DType::F32, {0, -1, 0}, {8}, 6},
        DecodeCase{2, 3, 64, 40, 17, {0, 5}, DType::F32},
        DecodeCase{2, 3, 64, 40, 17, {0, 5}, DType::F16},
        DecodeCase{3, 2, 128, 300, 257, {0, 100, 256}, DType::F16},
        DecodeCase{2, 2, 128, 1100, 1033, {7, 0}, DType::F32},
        DecodeCase{1, 4, 80, 64, 33, {2}, DType::BF16},
        DecodeCase{2, 4, 16, 32, 9, {0, 4}, DType::F16},
        DecodeCase{1, 2, 256, 70, 65, {0}, DType::F32},
        // grouped queries: query head h reads KV head h / (H / H_kv)
        DecodeCase{2, 8, 64, 40, 21, {0, 6}, DType::F16, {}, {}, 1, 2},
        DecodeCase{3, 6, 128, 64, 40, {2, 0, 11}, DType::F32, {}, {}, 1, 3},
        DecodeCase{2, 4, 32, 24, 9, {0, 3}, DType::BF16, {}, {}, 1, 1},
        // grouped queries with a shared prefix and an extension of 4 rows
        DecodeCase{3, 8, 64, 48, 30, {8, 12, 20}, DType::F16, {0, 0, -1}, {8}, 4, 2},
        // extensions of 8 rows or more: the tiled kernel (16 queries a block, 32 rows a tile)
        DecodeCase{2, 3, 64, 80, 30, {0, 5}, DType::F16, {}, {}, 8},  // the smallest tiled
        // 40 rows: 3 query tiles; sequence 1's first 10 new rows padding, 0 and 2 share 8 rows
        DecodeCase{3, 2, 64, 120, 30, {8, 40, 20}, DType::F32, {0, -1, 0}, {8}, 40},
        // sequence 1's first two query tiles all padding (no row loaded), the third in part
        DecodeCase{2, 2, 64, 64, 10, {0, 45}, DType::F16, {}, {}, 40},
        DecodeCase{2, 2, 128, 1100, 1033, {7, 0}, DType::BF16, {}, {}, 33},  // many row tiles
        DecodeCase{3, 8, 64, 80, 30, {8, 12, 20}, DType::F16, {0, 0, -1}, {8}, 17, 2},
        DecodeCase{1, 4, 80, 64, 20, {2}, DType::F32, {}, {}, 16},         // d not a multiple of 32
        DecodeCase{2, 4, 16, 64, 9, {0, 4}, DType::F16, {}, {}, 20},       // d below a warp
        DecodeCase{1, 2, 256, 100, 40, {0}, DType::F32, {}, {}, 24},       // opt-in shared memory
        DecodeCase{2, 4, 32, 80, 9, {0, 3}, DType::BF16, {}, {}, 50, 1}),  // one KV head
    case_name<DecodeCase>);

// ---- the int4 codec ----

// ops::int4_quantize and ops::int4_dequantize on CUDA against the CPU codec, bit for bit: the
// codes and the (min, scale) fp16 of every group, and the decoded fp16 rows. The rows mix random
// values of several spreads with the codec's hard cases: the fp16 range's ends, a narrow spread
// far from zero, scales that are fp16 subnormals, fp32 subnormals, constant rows (zeros of both
// signs among them: the min keeps the CPU's sign), values on the grid and halfway between two
// codes (ties to even). Buffers start with a pattern, so a byte written on one side only shows.
struct Int4Case {
  int64_t B, n, H, d, rows;  // rows per (kind, sequence, head) of the packed buffers, >= n
  std::vector<int32_t> first_valid;
  int64_t t0, t1, row0, capacity;  // the dequantised range and where it lands
};
std::ostream& operator<<(std::ostream& out, const Int4Case& c) {
  return out << "B" << c.B << "_n" << c.n << "_H" << c.H << "_d" << c.d << "_rows" << c.rows << "_t"
             << c.t0 << "to" << c.t1 << "_at" << c.row0;
}

// Value i of row r (of the 2 * B * n * H rows of K and V): one of the row kinds above.
float int4_case_value(int64_t r, int64_t i, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const auto at = static_cast<float>(i);
  switch (r % 10) {
    case 0:
      return 0.5f + normal(rng);
    case 1:
      return 30.0f * normal(rng);
    case 2:  // the ends of the fp16 range, and large values of both signs
      if (i % 16 == 1) return 65504.0f;
      if (i % 16 == 2) return -65504.0f;
      return (i % 2 ? 60000.0f : -60000.0f) / (1.0f + at);
    case 3:  // a narrow spread far from zero: min rounds down on the fp16 grid
      return 1000.3f + 1e-3f * at;
    case 4:  // fp16-subnormal scales, and fp32 subnormals
      return i % 5 == 0 ? 1e-40f * at : 1e-6f * static_cast<float>(i % 7) - 2e-6f;
    case 5:  // constant
      return std::array<float, 6>{
          0.375f, -2.0f, 1000.0f, 65504.0f, -65504.0f, 1e-7f}[static_cast<size_t>((r / 10) % 6)];
    case 6:  // zeros of alternating signs, the first's by the row: a constant group whose min
             // is the first zero's sign (the scan keeps the first of equals)
      return (i % 2 == 0) == ((r / 10) % 2 == 0) ? -0.0f : 0.0f;
    case 7:  // on the grid of min -1, scale 0.25 (its ends at 0 and 2), and halfway between
             // codes at odd i (ties to even)
      if (i == 0) return -1.0f;
      if (i == 2) return -1.0f + 0.25f * 15;
      return i % 2 == 0 ? -1.0f + 0.25f * static_cast<float>(i % 16)
                        : -1.0f + 0.125f * static_cast<float>(2 * (i % 15) + 1);
    case 8:  // half constant, half random: groups are independent
      return i < 32 ? 3.5f : normal(rng);
    default:  // small values around an outlier
      return i == 7 ? 200.0f : 1e-3f * normal(rng);
  }
}

// The same elements (bytes, fp16 bits), or where the first of them differs and how many do.
template <typename T>
void expect_same_elements(const std::vector<T>& cuda, const std::vector<T>& cpu, const char* what) {
  ASSERT_EQ(cuda.size(), cpu.size()) << what;
  size_t mismatches = 0;
  for (size_t i = 0; i < cpu.size(); ++i) {
    if (cuda[i] != cpu[i] && mismatches++ == 0) {
      ADD_FAILURE() << what << " " << i << ": 0x" << std::hex << +cuda[i] << " on CUDA, 0x"
                    << +cpu[i] << " on the CPU";
    }
  }
  EXPECT_EQ(mismatches, 0u) << what << "s differ";
}

class CudaInt4 : public CudaOpsWith<Int4Case> {};

TEST_P(CudaInt4, QuantiseAndDequantiseGiveTheCpuCodecsBytes) {
  const Int4Case& c = GetParam();
  const int64_t width = c.H * c.d, token_rows = c.B * c.n;
  std::mt19937_64 rng(static_cast<uint64_t>(c.d * 131 + c.B * 7 + c.n));
  std::array<std::vector<float>, 2> kv;  // K, V: (B * n, H * d)
  for (int64_t kind = 0; kind < 2; ++kind) {
    kv[static_cast<size_t>(kind)].resize(static_cast<size_t>(token_rows * width));
    for (int64_t row = 0; row < token_rows; ++row) {
      for (int64_t h = 0; h < c.H; ++h) {
        const int64_t r = (kind * token_rows + row) * c.H + h;
        for (int64_t i = 0; i < c.d; ++i) {
          kv[static_cast<size_t>(kind)][static_cast<size_t>(row * width + h * c.d + i)] =
              int4_case_value(r, i, rng);
        }
      }
    }
  }
  const Tensor keys = Tensor::from_floats({token_rows, width}, kv[0]);
  const Tensor values = Tensor::from_floats({token_rows, width}, kv[1]);

  const size_t packed_rows = static_cast<size_t>(2 * c.B * c.H * c.rows);
  const size_t code_bytes = packed_rows * ops::int4_code_bytes(c.d);
  const size_t meta_bytes = packed_rows * ops::int4_meta_bytes(c.d);
  std::vector<uint8_t> codes(code_bytes, 0xa5), meta(meta_bytes, 0xa5);
  const ops::Int4Rows cpu{codes.data(), meta.data(), Device::Cpu, c.B, c.H, c.rows, c.d};
  ops::int4_quantize(keys, values, cpu);

  uint8_t* device_codes = static_cast<uint8_t*>(device_alloc(Device::Cuda, code_bytes));
  uint8_t* device_meta = static_cast<uint8_t*>(device_alloc(Device::Cuda, meta_bytes));
  const std::vector<uint8_t> pattern(std::max(code_bytes, meta_bytes), 0xa5);
  device_copy(device_codes, Device::Cuda, pattern.data(), Device::Cpu, code_bytes);
  device_copy(device_meta, Device::Cuda, pattern.data(), Device::Cpu, meta_bytes);
  const ops::Int4Rows gpu{device_codes, device_meta, Device::Cuda, c.B, c.H, c.rows, c.d};
  ops::int4_quantize(keys.to(Device::Cuda), values.to(Device::Cuda), gpu);
  std::vector<uint8_t> gpu_codes(code_bytes), gpu_meta(meta_bytes);
  device_copy(gpu_codes.data(), Device::Cpu, device_codes, Device::Cuda, code_bytes);
  device_copy(gpu_meta.data(), Device::Cpu, device_meta, Device::Cuda, meta_bytes);
  expect_same_elements(gpu_codes, codes, "code byte");
  expect_same_elements(gpu_meta, meta, "meta byte");

  // Decoding the CPU's codes on both sides, into NaN-filled staging: the rows written, their
  // fp16 bits, and the padding rows left alone.
  device_copy(device_codes, Device::Cuda, codes.data(), Device::Cpu, code_bytes);
  device_copy(device_meta, Device::Cuda, meta.data(), Device::Cpu, meta_bytes);
  const Shape staging = {c.B, c.H, c.capacity, c.d};
  Tensor k = nan_tensor(staging, Device::Cpu, DType::F16);
  Tensor v = nan_tensor(staging, Device::Cpu, DType::F16);
  Tensor k_d = nan_tensor(staging, Device::Cuda, DType::F16);
  Tensor v_d = nan_tensor(staging, Device::Cuda, DType::F16);
  ops::int4_dequantize(cpu, c.t0, c.t1, c.first_valid, c.row0, k, v);
  ops::int4_dequantize(gpu, c.t0, c.t1, c.first_valid, c.row0, k_d, v_d);
  const auto bits = [](const Tensor& t) {
    const Tensor host = t.to(Device::Cpu);
    const auto* begin = static_cast<const uint16_t*>(host.raw());
    return std::vector<uint16_t>(begin, begin + host.numel());
  };
  expect_same_elements(bits(k_d), bits(k), "decoded key element");
  expect_same_elements(bits(v_d), bits(v), "decoded value element");
  // Written exactly where the range lands outside the padding.
  const std::vector<uint16_t> written = bits(k_d);
  for (int64_t b = 0; b < c.B; ++b) {
    for (int64_t row = 0; row < c.capacity; ++row) {
      const bool decoded = row >= c.row0 && row < c.row0 + c.t1 - c.t0 &&
                           row >= c.first_valid[static_cast<size_t>(b)];
      const uint16_t first = written[static_cast<size_t>(((b * c.H) * c.capacity + row) * c.d)];
      EXPECT_EQ(first == 0x7e00, !decoded) << "sequence " << b << " row " << row;
    }
  }
  device_free(Device::Cuda, device_codes);
  device_free(Device::Cuda, device_meta);
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaInt4,
    ::testing::Values(
        // d = 64: one group; every row, no padding
        Int4Case{2, 5, 3, 64, 5, {0, 0}, 0, 5, 0, 5},
        // d = 128: two groups; padded sequences, the whole buffer into a larger staging
        Int4Case{3, 4, 2, 128, 7, {0, 2, 5}, 0, 7, 0, 9},
        // d < 64: one group of d (opt-tiny's 16, llama-tiny's 32)
        Int4Case{2, 3, 4, 16, 3, {1, 0}, 0, 3, 0, 3}, Int4Case{2, 6, 2, 32, 8, {0, 3}, 2, 6, 1, 8},
        // a decode step's token: one row, landing at row 6 (sequence 1 padded up to 4)
        Int4Case{2, 1, 2, 128, 1, {0, 4}, 0, 1, 6, 8},
        // d = 256: four groups; a range whose first rows are padding for one sequence
        Int4Case{1, 10, 1, 256, 12, {5}, 0, 10, 0, 12}),
    case_name<Int4Case>);

TEST_F(CudaOps, Int4CodesOnAnotherDeviceThanTheirRowsAreRefused) {
  const Tensor keys = Tensor::zeros({2, 64}, DType::F32, Device::Cuda);
  std::vector<uint8_t> codes(64), meta(8);
  const ops::Int4Rows host{codes.data(), meta.data(), Device::Cpu, 1, 1, 2, 64};
  testing_util::expect_error([&] { ops::int4_quantize(keys, keys, host); }, {"int4_quantize"});
}

// ---- streams ----

// A CUDA stream of the test's own, non-blocking (unordered with the legacy default stream, as the
// pipeline's are), so that an op or a copy that strays onto the default stream races with it.
// Releases the ops' scratch of the stream, then destroys it.
class OwnStream {
 public:
  OwnStream() {
    const int code = kernels::cuda::stream_create(&handle_);
    if (code != 0) ADD_FAILURE() << "stream_create: " << kernels::cuda::error_string(code);
  }
  ~OwnStream() {
    ops::release_cuda_scratch(handle_);
    kernels::cuda::stream_destroy(handle_);
  }
  OwnStream(const OwnStream&) = delete;
  OwnStream& operator=(const OwnStream&) = delete;
  void* get() const { return handle_; }

 private:
  void* handle_ = nullptr;
};

// ---- the whole model ----

// A model's forward pass on CUDA tensors against the CPU, on fp16 synthetic weights: a
// left-padded prefill (logits of every position), then decode steps over the KV cache. OPT
// (opt-tiny) and the Llama family (llama-tiny: GQA, RoPE, RMSNorm, SwiGLU). Every op of the
// model runs; the logits come back by a copy on the current stream.
void expect_model_matches_cpu(const char* family) {
  const ModelConfig config = load_preset(family);
  const auto cpu = make_model(config, synthetic_weights(config, {}, Device::Cpu), Device::Cpu);
  const auto gpu = make_model(config, synthetic_weights(config, {}, Device::Cuda), Device::Cuda);
  const std::vector<std::vector<int32_t>> prompts = {{2, 10, 11, 12, 13},
                                                     {2, 500, 600, 700, 800, 900, 1000, 1100}};
  std::vector<int32_t> first_valid;
  const std::vector<int32_t> tokens = left_pad(prompts, 1, &first_valid);
  const int64_t B = static_cast<int64_t>(prompts.size());
  const int64_t n = static_cast<int64_t>(tokens.size()) / B, steps = 3;
  KvCache cache_cpu(config, B, n + steps, DType::F16, Device::Cpu);
  KvCache cache_gpu(config, B, n + steps, DType::F16, Device::Cuda);
  const Tensor logits_cpu = cpu->prefill(tokens, first_valid, cache_cpu, true);
  const Tensor logits_gpu = gpu->prefill(tokens, first_valid, cache_gpu, true);
  ASSERT_EQ(logits_gpu.device(), Device::Cpu);
  const std::vector<float> a = logits_gpu.to_floats(), b = logits_cpu.to_floats();
  // Padding positions' logits are not meaningful on either device; compare the real ones.
  const int64_t V = config.vocab_size;
  std::vector<float> real_a, real_b;
  for (int64_t s = 0; s < B; ++s) {
    for (int64_t t = first_valid[static_cast<size_t>(s)]; t < n; ++t) {
      const size_t at = static_cast<size_t>((s * n + t) * V);
      real_a.insert(real_a.end(), a.begin() + at, a.begin() + at + V);
      real_b.insert(real_b.end(), b.begin() + at, b.begin() + at + V);
    }
  }
  EXPECT_LT(relative_error(real_a.data(), real_b.data(), real_b.size()), 1e-2);
  for (int64_t step = 0; step < steps; ++step) {
    const std::vector<int32_t> next(static_cast<size_t>(B), 20 + static_cast<int32_t>(step));
    const Tensor step_cpu = cpu->decode(next, cache_cpu), step_gpu = gpu->decode(next, cache_gpu);
    const std::vector<float> x = step_gpu.to_floats(), y = step_cpu.to_floats();
    EXPECT_LT(relative_error(x.data(), y.data(), y.size()), 1e-2) << "step " << step;
  }
}

class CudaModel : public CudaOpsWith<const char*> {};

TEST_P(CudaModel, MatchesCpu) {
  expect_model_matches_cpu(GetParam());
}

// The same on a stream of its own: every op launches there (its index uploads go through that
// stream's ring, none through the default stream's), and reading the logits on it waits for them.
TEST_P(CudaModel, MatchesCpuOnItsOwnStream) {
  const int64_t default_stream_uploads = ops::cuda_scratch_stats(nullptr).uploads;
  OwnStream stream;
  {
    const CudaStreamScope scope(stream.get());
    expect_model_matches_cpu(GetParam());
  }
  EXPECT_GT(ops::cuda_scratch_stats(stream.get()).uploads, 0);
  EXPECT_EQ(ops::cuda_scratch_stats(nullptr).uploads, default_stream_uploads);
}

INSTANTIATE_TEST_SUITE_P(Families, CudaModel, ::testing::Values("opt-tiny", "llama-tiny"),
                         [](const ::testing::TestParamInfo<const char*>& family) {
                           return std::string(family.param) == "opt-tiny" ? "Opt" : "Llama";
                         });

// ---- the ops' scratch ----

// Random token ids and positions for an embedding, and its outputs on both devices (the CUDA one
// NaN until the op runs).
struct EmbedCase {
  std::vector<int32_t> tokens, positions;
  Tensor cuda, cpu;
};
EmbedCase embed_case(int64_t rows, int64_t vocab, int64_t max_positions, int64_t D, uint64_t seed) {
  std::mt19937 rng(static_cast<uint32_t>(seed));
  EmbedCase c{std::vector<int32_t>(static_cast<size_t>(rows)),
              std::vector<int32_t>(static_cast<size_t>(rows)), nan_tensor({rows, D}, Device::Cuda),
              nan_tensor({rows, D}, Device::Cpu)};
  for (size_t i = 0; i < c.tokens.size(); ++i) {
    c.tokens[i] = static_cast<int32_t>(rng() % vocab);
    c.positions[i] = static_cast<int32_t>(rng() % max_positions);
  }
  return c;
}

// Token and position tables, on both devices.
struct EmbedTables {
  Tensor tokens, positions, tokens_d, positions_d;
  EmbedTables(int64_t vocab, int64_t max_positions, int64_t D, uint64_t seed)
      : tokens(random_tensor({vocab, D}, seed)),
        positions(random_tensor({max_positions, D}, seed + 1)),
        tokens_d(tokens.to(Device::Cuda)),
        positions_d(positions.to(Device::Cuda)) {}
  void run_cuda(EmbedCase& c) const {
    ops::embed(c.tokens, c.positions, tokens_d, positions_d, c.cuda);
  }
  void run_cpu(EmbedCase& c) const { ops::embed(c.tokens, c.positions, tokens, positions, c.cpu); }
};

// An op whose index arrays outgrow the upload ring grows it (after the stream's work on the old
// one), and the ops before and after it read their own indices.
TEST_F(CudaOps, IndexUploadsLargerThanTheRingGrowIt) {
  OwnStream stream;
  const CudaStreamScope scope(stream.get());
  const EmbedTables tables(1000, 50, 8, 50);
  EmbedCase small = embed_case(10, 1000, 50, 8, 52);
  tables.run_cuda(small);
  const size_t first_ring = ops::cuda_scratch_stats(stream.get()).upload_bytes;
  // tokens and positions: 8 bytes a row, more than the first ring holds
  const int64_t rows = static_cast<int64_t>(first_ring / 8) + 1000;
  EmbedCase large = embed_case(rows, 1000, 50, 8, 53), after = embed_case(10, 1000, 50, 8, 54);
  tables.run_cuda(large);
  tables.run_cuda(after);
  const ops::CudaScratchStats stats = ops::cuda_scratch_stats(stream.get());
  EXPECT_GT(first_ring, 0u);
  EXPECT_GE(stats.upload_bytes, static_cast<size_t>(rows) * 8);
  EXPECT_EQ(stats.grows, 2);  // the first ring, then the larger one
  EXPECT_EQ(stats.uploads, 3);
  for (EmbedCase* c : {&small, &large, &after}) {
    tables.run_cpu(*c);
    EXPECT_EQ(error_vs_cpu(c->cuda, c->cpu), 0.0) << c->tokens.size() << " rows";
  }
}

// Many uploads in a row queued behind a slow kernel: the ring comes round several times before
// the device has run the earlier copies, so a part reused before its copy had run would hand a
// kernel another op's indices. Everything is allocated first: an allocation or a synchronous copy
// in between would let the device catch up.
TEST_F(CudaOps, ManyIndexUploadsInARowWrapTheRing) {
  OwnStream stream;
  const CudaStreamScope scope(stream.get());
  const EmbedTables tables(5000, 300, 8, 55);
  std::vector<EmbedCase> cases;
  for (uint64_t i = 0; i < 100; ++i) {
    cases.push_back(embed_case(500, 5000, 300, 8, 100 + i));  // 4000 bytes: 16 to a 64 KiB ring
  }
  const Tensor x_d = random_tensor({512, 1024}, 57).to(Device::Cuda);
  const Tensor w_d = random_tensor({1024, 1024}, 58, 0.05f).to(Device::Cuda);
  Tensor y_d = nan_tensor({512, 1024}, Device::Cuda);
  ops::linear(x_d, w_d, Tensor(), y_d);  // keeps the stream busy while the uploads are queued
  for (EmbedCase& c : cases) tables.run_cuda(c);
  const ops::CudaScratchStats stats = ops::cuda_scratch_stats(stream.get());
  EXPECT_EQ(stats.grows, 1);
  EXPECT_GE(stats.wraps, 5);
  for (size_t i = 0; i < cases.size(); ++i) {
    tables.run_cpu(cases[i]);
    EXPECT_EQ(error_vs_cpu(cases[i].cuda, cases[i].cpu), 0.0) << "upload " << i;
  }
}

// 16-bit linears alternating between two streams, never synchronised: each stream rounds its
// input into its own scratch, so neither GEMM reads the other's input. Inputs and outputs are
// allocated first (freeing or allocating device memory in between could synchronise the device).
TEST_F(CudaOps, SixteenBitLinearsOnTwoStreamsKeepTheirOwnScratch) {
  const int64_t M = 256, N = 128, K = 512;
  const Tensor w = random_tensor({N, K}, 60, 0.05f, DType::F16);
  const Tensor w_d = w.to(Device::Cuda);
  OwnStream a, b;
  std::vector<Tensor> inputs, inputs_d, outputs_d;
  for (uint64_t i = 0; i < 8; ++i) {
    inputs.push_back(random_tensor({M, K}, 61 + i));
    inputs_d.push_back(inputs.back().to(Device::Cuda));
    outputs_d.push_back(nan_tensor({M, N}, Device::Cuda));
  }
  const auto stream_of = [&](size_t i) { return i % 2 == 0 ? a.get() : b.get(); };
  for (size_t i = 0; i < inputs.size(); ++i) {
    const CudaStreamScope scope(stream_of(i));
    ops::linear(inputs_d[i], w_d, Tensor(), outputs_d[i]);
  }
  const ops::CudaScratchStats stats_a = ops::cuda_scratch_stats(a.get());
  const ops::CudaScratchStats stats_b = ops::cuda_scratch_stats(b.get());
  ASSERT_NE(stats_a.gemm, nullptr);
  ASSERT_NE(stats_b.gemm, nullptr);
  EXPECT_NE(stats_a.gemm, stats_b.gemm);
  EXPECT_EQ(stats_a.gemm_bytes, ops::cuda_linear_scratch_bytes(M, K, DType::F16));
  for (size_t i = 0; i < inputs.size(); ++i) {
    const CudaStreamScope scope(stream_of(i));
    Tensor y = nan_tensor({M, N}, Device::Cpu);
    ops::linear(inputs[i], w, Tensor(), y);
    EXPECT_LT(error_vs_cpu(outputs_d[i], y), tolerance(DType::F16)) << "linear " << i;
  }
}

// Reserved up front, the scratch does not grow for the ops within the reservation.
TEST_F(CudaOps, ReservedScratchDoesNotGrow) {
  const int64_t M = 64, N = 32, K = 96;
  OwnStream stream;
  const CudaStreamScope scope(stream.get());
  ops::reserve_cuda_scratch(size_t{1} << 20, ops::cuda_linear_scratch_bytes(M, K, DType::BF16));
  const ops::CudaScratchStats reserved = ops::cuda_scratch_stats(stream.get());
  EXPECT_EQ(reserved.upload_bytes, size_t{1} << 20);
  EXPECT_EQ(reserved.gemm_bytes, ops::cuda_linear_scratch_bytes(M, K, DType::BF16));
  EXPECT_EQ(reserved.grows, 2);
  const Tensor x = random_tensor({M, K}, 70), w = random_tensor({N, K}, 71, 0.05f, DType::BF16);
  Tensor y = nan_tensor({M, N}, Device::Cpu), y_d = nan_tensor({M, N}, Device::Cuda);
  ops::linear(x.to(Device::Cuda), w.to(Device::Cuda), Tensor(), y_d);
  ops::linear(x, w, Tensor(), y);
  const EmbedTables tables(100, 50, 8, 72);
  EmbedCase c = embed_case(20000, 100, 50, 8, 73);  // 160000 bytes of indices
  tables.run_cuda(c);
  tables.run_cpu(c);
  EXPECT_EQ(ops::cuda_scratch_stats(stream.get()).grows, 2);
  EXPECT_LT(error_vs_cpu(y_d, y), tolerance(DType::BF16));
  EXPECT_EQ(error_vs_cpu(c.cuda, c.cpu), 0.0);
}

// ---- the int4 store ----

// Int4Kv on the device (its codec's kernels on the compute stream) gives the CPU's tokens,
// greedy, and close logits, for heads of one and two groups of 64 (the presets' heads, 16 and 32
// wide, run through the CLI below), prompts of different lengths (left padding never decoded),
// with staging and loaded codes NaN until written (a row left undecoded would be read as NaN).
TEST_F(CudaOps, Int4StoreGivesTheCpuTokensWithHeadsOfOneAndTwoGroups) {
  GenerationRequest request;
  request.prompts = {
      {2, 10, 11, 12, 13}, {2, 500, 600, 700, 800, 900, 1000, 1100, 1200}, {2, 40, 41}};
  request.gen_len = 6;
  OffloadOptions options;
  options.policy = "int4";
  for (const int64_t heads : {4, 2}) {  // d = 64, 128
    ModelSource source = resolve_model("opt-tiny", {});
    source.config.hidden_size = 256;
    source.config.num_heads = heads;
    set_debug_poison(true);
    const OffloadRun cpu = run_offloaded(source, request, options, Device::Cpu);
    const OffloadRun cuda = run_offloaded(source, request, options, Device::Cuda);
    set_debug_poison(false);
    ASSERT_EQ(cpu.result.tokens.size(), request.prompts.size());
    EXPECT_EQ(cuda.result.tokens, cpu.result.tokens) << "head size " << 256 / heads;
    const std::vector<float> a = cuda.result.last_logits.to_floats();
    const std::vector<float> b = cpu.result.last_logits.to_floats();
    ASSERT_EQ(a.size(), b.size());
    // 1.6e-4 here; a K/V row left undecoded (read as NaN, which CUDA decode attention turns
    // into a zero row, or stale) moved them by 1e-2.
    EXPECT_LT(relative_error(a.data(), b.data(), b.size()), 2e-3) << "head size " << 256 / heads;
    EXPECT_EQ(cuda.stats.steps().back().h2d_bytes, cpu.stats.steps().back().h2d_bytes);
  }
}

// ---- the command line ----

// `--device cuda` == `--device cpu`: a run through the CLI, greedy, gives the same tokens on
// both for every policy that runs on the device (and the run names the device it used): the
// built-in model and llama-tiny (RoPE, grouped queries), prompts of different lengths, prefixes
// shared in whole blocks, weights streamed from the host, both ways of gathering KV, int4's
// codec on the device (with staging and loaded codes NaN until written, INFINIGEN_DEBUG_NAN), and
// infinigen's speculation, selection and gather on the device (OPT and Llama, skewed and not,
// alpha 4 and alpha large, both fetch rules, fp16 partial keys, shared prefixes).
struct CliCase {
  const char* name;
  std::vector<std::string> args;
  std::vector<std::string> prompts = {};  // one per sequence, through --prompt-file; none: default
  std::vector<std::string> env = {};      // "NAME=value" for both runs
  // A checkpoint `infinigen skew` rotates first (OPT: into its weights; Llama: a skew kept beside
  // them, applied after RoPE), which both runs then use; null: none.
  const char* skew_model = nullptr;
};

class CudaCli : public CudaOpsWith<CliCase> {};

// One run's generated tokens per sequence, with what `--logprobs 2` says of them: each token's
// text ("tokens") and the two most likely texts at its step ("top_logprobs", text -> log p).
struct CliOutputs {
  std::vector<std::vector<int>> tokens;
  std::vector<nlohmann::json> logprobs;
};

// Greedy decoding is discrete: where the two most likely tokens of a step are within the backends'
// rounding (cuBLAS against the CPU's GEMM, 1e-4 relative on the logits), a machine's CPU may pick
// the other one, and the text goes its own way from there. The device's tokens must equal the
// CPU's up to the first step where they differ, and that step must be such a near-tie on the CPU:
// both tokens among its two most likely, within kNearTie of each other. (A near-tie in infinigen's
// selection moves the logits further; such prompts are avoided below.)
constexpr double kNearTie = 2e-3;  // nats

void expect_same_tokens_up_to_a_near_tie(const CliOutputs& cpu, const CliOutputs& cuda) {
  ASSERT_EQ(cuda.tokens.size(), cpu.tokens.size());
  for (size_t b = 0; b < cpu.tokens.size(); ++b) {
    const std::vector<int>& want = cpu.tokens[b];
    const std::vector<int>& got = cuda.tokens[b];
    ASSERT_EQ(got.size(), want.size()) << "sequence " << b;
    const auto differ = std::mismatch(want.begin(), want.end(), got.begin()).first;
    if (differ == want.end()) continue;
    const size_t step = static_cast<size_t>(differ - want.begin());
    const nlohmann::json& top = cpu.logprobs[b]["top_logprobs"];
    const nlohmann::json& cuda_texts = cuda.logprobs[b]["tokens"];
    ASSERT_LT(step, std::min(top.size(), cuda_texts.size())) << "sequence " << b;
    // The CPU's two most likely at that step must be its token and the device's.
    const std::string cpu_text = cpu.logprobs[b]["tokens"][step];
    const std::string cuda_text = cuda_texts[step];
    ASSERT_TRUE(top[step].contains(cpu_text) && top[step].contains(cuda_text))
        << "sequence " << b << " differs at step " << step << " (cpu \"" << cpu_text
        << "\", cuda \"" << cuda_text << "\"), not among the CPU's two most likely " << top[step];
    const double margin = top[step][cpu_text].get<double>() - top[step][cuda_text].get<double>();
    EXPECT_LT(std::abs(margin), kNearTie)
        << "sequence " << b << " differs at step " << step << " (cpu \"" << cpu_text
        << "\", cuda \"" << cuda_text << "\"), " << margin << " nats apart on the CPU";
    std::printf("sequence %zu: a near-tie at step %zu (%s), where the runs part\n", b, step,
                top[step].dump().c_str());
  }
}

// The comparison itself: a parting at a near-tie passes, one at a clear choice fails.
TEST(CudaCliComparison, OnlyANearTieLetsTheRunsPart) {
  const auto outputs = [](std::vector<int> tokens, const char* texts, const char* top) {
    return CliOutputs{{std::move(tokens)},
                      {nlohmann::json{{"tokens", nlohmann::json::parse(texts)},
                                      {"top_logprobs", nlohmann::json::parse(top)}}}};
  };
  const CliOutputs cpu = outputs({5, 7, 9}, R"([" a", " b", " c"])",
                                 R"([{" a": -0.1, " x": -3}, {" b": -1.0, " y": -1.0005},
                                     {" c": -0.2, " z": -2}])");
  const CliOutputs near_tie = outputs({5, 8, 4}, R"([" a", " y", " q"])", "[]");
  expect_same_tokens_up_to_a_near_tie(cpu, near_tie);
  const CliOutputs clear_choice = outputs({6, 7, 9}, R"([" x", " b", " c"])", "[]");
  EXPECT_NONFATAL_FAILURE(expect_same_tokens_up_to_a_near_tie(cpu, clear_choice),
                          "nats apart on the CPU");
}

TEST_P(CudaCli, DeviceCudaGivesTheCpuTokens) {
  const testing_util::TempDir cache("cuda-cli");
  std::vector<std::string> model_args;
  if (GetParam().skew_model != nullptr) {
    const std::string skewed = (cache.path() / "skewed").string();
    const testing_util::CommandResult skew = testing_util::run_infinigen(
        {"skew", "--model", GetParam().skew_model, "--out", skewed, "--calib-len", "256"},
        {"INFINIGEN_CACHE_DIR=" + cache.str()});
    ASSERT_EQ(skew.exit_code, 0) << skew.err;
    model_args = {"--model", skewed};
  }
  const auto outputs = [&](const std::string& device, std::string* description) {
    std::vector<std::string> args = {"run",       "--device", device,   "--temperature", "0",
                                     "--gen-len", "6",        "--json", "--logprobs",    "2"};
    args.insert(args.end(), GetParam().args.begin(), GetParam().args.end());
    args.insert(args.end(), model_args.begin(), model_args.end());
    if (!GetParam().prompts.empty()) {
      const std::filesystem::path file = cache.path() / "prompts.txt";
      std::ofstream out(file);
      for (const std::string& prompt : GetParam().prompts) out << prompt << "\n";
      args.insert(args.end(), {"--prompt-file", file.string()});
    }
    std::vector<std::string> env = {"INFINIGEN_CACHE_DIR=" + cache.str()};
    env.insert(env.end(), GetParam().env.begin(), GetParam().env.end());
    const testing_util::CommandResult run = testing_util::run_infinigen(args, env);
    EXPECT_EQ(run.exit_code, 0) << run.err;
    const nlohmann::json report = nlohmann::json::parse(run.out, nullptr, false);
    EXPECT_FALSE(report.is_discarded()) << run.out;
    CliOutputs out;
    if (report.is_discarded()) return out;
    *description = report.value("device_description", "");
    for (const auto& output : report["outputs"]) {
      out.tokens.push_back(output["tokens"]);
      out.logprobs.push_back(output["logprobs"]);
    }
    return out;
  };
  std::string cpu_description, cuda_description;
  const CliOutputs cpu = outputs("cpu", &cpu_description);
  const CliOutputs cuda = outputs("cuda", &cuda_description);
  EXPECT_EQ(cpu_description, "cpu");
  EXPECT_EQ(cuda_description.rfind("cuda (", 0), 0u) << cuda_description;
  ASSERT_FALSE(cpu.tokens.empty());
  expect_same_tokens_up_to_a_near_tie(cpu, cuda);
}

// What infinigen cannot do on the device is refused with one line naming the option.
TEST(CudaCliRefusal, InfinigenRecallIsMeasuredOnTheHostOnly) {
  INFINIGEN_SKIP_WITHOUT_CUDA_DEVICE();
  const testing_util::TempDir cache("cuda-refusal");
  const testing_util::CommandResult run = testing_util::run_infinigen(
      {"run", "--device", "cuda", "--policy", "infinigen", "--check-recall", "--gen-len", "2"},
      {"INFINIGEN_CACHE_DIR=" + cache.str()});
  EXPECT_NE(run.exit_code, 0);
  EXPECT_NE(run.err.find("--check-recall measures on the host"), std::string::npos) << run.err;
  EXPECT_EQ(std::count(run.err.begin(), run.err.end(), '\n'), 1) << run.err;
}

// A conversation kept with --session on CUDA (`full`: its pool is host memory) continues as on
// the CPU: the same tokens in both turns.
TEST(CudaSession, FullContinuesAConversationAsTheCpuDoes) {
  INFINIGEN_SKIP_WITHOUT_CUDA_DEVICE();
  const testing_util::TempDir dir("cuda-session");
  const auto turn = [&](const std::string& device, const std::string& flag,
                        const std::string& prompt) {
    const testing_util::CommandResult run = testing_util::run_infinigen(
        {"run", "--device", device, "--policy", "full", "--temperature", "0", "--gen-len", "4",
         "--json", "--prompt", prompt, flag, (dir.path() / device).string()},
        {"INFINIGEN_CACHE_DIR=" + dir.str()});
    EXPECT_EQ(run.exit_code, 0) << run.err;
    const nlohmann::json report = nlohmann::json::parse(run.out, nullptr, false);
    std::vector<std::vector<int>> out;
    if (report.is_discarded()) return out;
    for (const auto& output : report["outputs"]) out.push_back(output["tokens"]);
    return out;
  };
  for (const std::string device : {"cpu", "cuda"}) {
    EXPECT_FALSE(turn(device, "--session", "Once upon a time").empty()) << device;
  }
  const auto cpu = turn("cpu", "--resume", " and then the dog");
  const auto cuda = turn("cuda", "--resume", " and then the dog");
  ASSERT_FALSE(cpu.empty());
  EXPECT_EQ(cuda, cpu);
}

// Prompts of different lengths (left padding), and two that share a prefix of whole 4-token
// blocks.
const std::vector<std::string> kMixedPrompts = {
    "Once upon a time", "The little dog ran to the park and saw a big red ball near the old tree"};
// Three of different lengths on which llama-tiny's synthetic weights take a few steps to fall into
// the token they then repeat (on the default prompts most sequences start there), so that a
// wrong KV row changes the tokens.
const std::vector<std::string> kLlamaPrompts = {
    "The little dog ran to the park and saw a big red ball near the old tree", "Once upon a time",
    "A cat sat on the mat and looked at the bird"};
const std::vector<std::string> kSharedPrompts = {
    "The little dog ran to the park and saw a big red ball near the old tree, and then",
    "The little dog ran to the park and saw a big red ball near the old tree, so it"};
// infinigen's selection is discrete: where the n'-th and the next estimated logits of a row are
// within the backends' rounding (1e-4 relative: cuBLAS against the CPU's GEMM), the two pick a
// different token, and the text may change. kSharedPrompts have such a near-tie for the built-in
// model (7e-5 apart); these have none there, in six steps. That the device selects what the CPU
// does from the same inputs, ties included, is speculation_cuda_test's.
const std::vector<std::string> kSharedPromptsNoNearTie = {
    "Once upon a time there was a little girl who lived in a village near the forest. One day",
    "Once upon a time there was a little girl who lived in a village near the forest. She"};

INSTANTIATE_TEST_SUITE_P(
    Runs, CudaCli,
    ::testing::Values(
        CliCase{"gpu", {"--policy", "gpu"}}, CliCase{"full", {"--policy", "full"}},
        CliCase{"full_host_gather", {"--policy", "full", "--gather", "host"}},
        CliCase{"full_streamed_weights", {"--policy", "full", "--weights-gpu-percent", "50"}},
        CliCase{"gpu_streamed_weights", {"--policy", "gpu", "--weights-gpu-percent", "50"}},
        CliCase{"full_llama", {"--model", "llama-tiny", "--policy", "full"}},
        CliCase{"gpu_llama", {"--model", "llama-tiny", "--policy", "gpu"}},
        CliCase{"full_mixed_lengths", {"--policy", "full"}, kMixedPrompts},
        CliCase{"gpu_mixed_lengths", {"--policy", "gpu"}, kMixedPrompts},
        CliCase{
            "full_shared_prefix", {"--policy", "full", "--kv-block-tokens", "4"}, kSharedPrompts},
        CliCase{"gpu_shared_prefix", {"--policy", "gpu", "--kv-block-tokens", "4"}, kSharedPrompts},
        // h2o scores, keeps and evicts on the device: budgets that evict in the prefill (the
        // longer prompt) and in every decode step once the rows fill.
        CliCase{"h2o_mixed_lengths", {"--policy", "h2o", "--h2o-budget", "0.3"}, kMixedPrompts},
        CliCase{"h2o_llama",
                {"--model", "llama-tiny", "--policy", "h2o", "--h2o-budget", "0.3"},
                kMixedPrompts},
        CliCase{"h2o_host_gather", {"--policy", "h2o", "--h2o-budget", "0.2", "--gather", "host"}},
        CliCase{"int4", {"--policy", "int4"}},
        CliCase{"int4_mixed_lengths", {"--policy", "int4"}, kMixedPrompts},
        CliCase{"int4_llama", {"--model", "llama-tiny", "--policy", "int4"}, kLlamaPrompts},
        CliCase{"int4_llama_poisoned",
                {"--model", "llama-tiny", "--policy", "int4"},
                kLlamaPrompts,
                {"INFINIGEN_DEBUG_NAN=1"}},
        CliCase{"int4_host_gather_streamed_weights",
                {"--policy", "int4", "--gather", "host", "--weights-gpu-percent", "50"}},
        // infinigen speculates, selects and gathers on the device (the default policy).
        CliCase{"infinigen", {"--policy", "infinigen"}},
        CliCase{"infinigen_mixed_lengths", {"--policy", "infinigen"}, kMixedPrompts},
        CliCase{"infinigen_alpha_large", {"--alpha", "1e9"}, kMixedPrompts},
        CliCase{"infinigen_fetch_rule_batch", {"--fetch-rule", "batch"}, kMixedPrompts},
        CliCase{"infinigen_f16_partial_keys", {"--partial-key-dtype", "f16"}, kMixedPrompts},
        // Not the built-in prompts: their third ends on a near-tie for the built-in Llama (" ."
        // or " `" after "the :func:`sys") that some machines' CPU GEMMs tip the other way.
        CliCase{"infinigen_llama", {"--model", "builtin-llama"}, kLlamaPrompts},
        CliCase{"infinigen_llama_tiny", {"--model", "llama-tiny"}, kLlamaPrompts},
        CliCase{"infinigen_skewed", {}, kMixedPrompts, {}, "builtin"},
        CliCase{"infinigen_skewed_llama", {}, kMixedPrompts, {}, "builtin-llama"},
        CliCase{"infinigen_skewed_llama_alpha_large", {"--alpha", "1e9"}, {}, {}, "builtin-llama"},
        // Prompts in chunks (a sequence all padding in the first ones): extension passes over
        // the rows stored so far, the column rule summed over every chunk.
        CliCase{"full_chunked", {"--policy", "full", "--prefill-chunk", "3"}, kMixedPrompts},
        CliCase{"gpu_chunked", {"--policy", "gpu", "--prefill-chunk", "5"}, kMixedPrompts},
        CliCase{"int4_chunked_llama_poisoned",
                {"--model", "llama-tiny", "--policy", "int4", "--prefill-chunk", "4"},
                kLlamaPrompts,
                {"INFINIGEN_DEBUG_NAN=1"}},
        CliCase{"infinigen_chunked", {"--prefill-chunk", "4"}, kMixedPrompts},
        // Chunks of 8 tokens or more: the tiled extension kernel.
        CliCase{"full_chunked_tiled", {"--policy", "full", "--prefill-chunk", "8"}, kMixedPrompts},
        CliCase{"infinigen_chunked_tiled_llama_poisoned",
                {"--model", "builtin-llama", "--prefill-chunk", "8"},
                {},
                {"INFINIGEN_DEBUG_NAN=1"}},
        CliCase{"infinigen_chunked_tiled_shared_prefix",
                {"--kv-block-tokens", "4", "--prefill-chunk", "9"},
                kSharedPromptsNoNearTie},
        // Where the KV and the partial keys live: the dense layers' KV loaded every step (on the
        // device, the default that fits, elsewhere), and speculated layers' partial keys in
        // mapped host memory, read by the speculation kernels in place (poisoned: a row the
        // device did not write shows).
        CliCase{"infinigen_dense_kv_host", {"--dense-kv", "host"}, kMixedPrompts},
        CliCase{"infinigen_partial_keys_on_host",
                {"--partial-key-host-layers", "3", "--prefill-chunk", "5"},
                kMixedPrompts,
                {"INFINIGEN_DEBUG_NAN=1"}},
        CliCase{"infinigen_partial_keys_on_host_llama",
                {"--model", "builtin-llama", "--partial-key-host-layers", "100"},
                kSharedPromptsNoNearTie},
        CliCase{"infinigen_chunked_llama", {"--model", "builtin-llama", "--prefill-chunk", "6"}},
        CliCase{"infinigen_chunked_shared_prefix",
                {"--kv-block-tokens", "4", "--prefill-chunk", "3"},
                kSharedPromptsNoNearTie},
        CliCase{"infinigen_shared_prefix", {"--kv-block-tokens", "4"}, kSharedPromptsNoNearTie},
        CliCase{"infinigen_llama_shared_prefix",
                {"--model", "builtin-llama", "--kv-block-tokens", "4"},
                kSharedPrompts},
        // A capped pool: position tables and counters on the host, the token table on the
        // device following them, every eviction rule, evicting in the prompt and in decode.
        CliCase{"infinigen_capped_counter",
                {"--kv-pool-limit", "0.5", "--eviction", "counter"},
                kMixedPrompts},
        CliCase{
            "infinigen_capped_lru", {"--kv-pool-limit", "0.5", "--eviction", "lru"}, kMixedPrompts},
        CliCase{"infinigen_capped_fifo",
                {"--kv-pool-limit", "0.5", "--eviction", "fifo"},
                kMixedPrompts},
        CliCase{"infinigen_llama_capped_counter",
                {"--model", "builtin-llama", "--kv-pool-limit", "0.3", "--eviction", "counter"}},
        // The default prompts reach a near-tie under LRU on the built-in Llama (a different token
        // from the fourth step on between the backends); these do not.
        CliCase{"infinigen_llama_capped_lru",
                {"--model", "builtin-llama", "--kv-pool-limit", "0.3", "--eviction", "lru"},
                kMixedPrompts},
        CliCase{"infinigen_skewed_llama_capped_fifo_poisoned",
                {"--kv-pool-limit", "0.3", "--eviction", "fifo"},
                {},
                {"INFINIGEN_DEBUG_NAN=1"},
                "builtin-llama"},
        CliCase{"infinigen_poisoned_streamed_weights",
                {"--weights-gpu-percent", "50"},
                kMixedPrompts,
                {"INFINIGEN_DEBUG_NAN=1"}}),
    [](const ::testing::TestParamInfo<CliCase>& run) { return std::string(run.param.name); });

}  // namespace
}  // namespace infinigen
