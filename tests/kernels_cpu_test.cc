// tests: CPU kernels against naive fp64 loops on random inputs.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "kernels/cpu/attention.h"
#include "kernels/cpu/convert.h"
#include "kernels/cpu/layer_norm.h"
#include "kernels/cpu/linear.h"
#include "tests/test_util.h"

namespace infinigen::kernels::cpu {
namespace {

using testing_util::relative_error;

std::vector<float> random_values(size_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = normal(rng);
  return v;
}

class LinearTest : public ::testing::TestWithParam<Element> {};

TEST_P(LinearTest, MatchesNaiveProduct) {
  const int64_t M = 5, N = 131, K = 67;  // N not a multiple of the block size
  const std::vector<float> x = random_values(M * K, 1), w = random_values(N * K, 2);
  const std::vector<float> bias = random_values(N, 3);
  const Element type = GetParam();
  // Store w in the tested type and compute the reference from the rounded values.
  std::vector<uint16_t> w16(w.size());
  std::vector<float> w_rounded(w.size());
  const void* w_ptr = w.data();
  if (type == Element::F16) {
    f32_to_f16(w.data(), w16.data(), w.size());
    f16_to_f32(w16.data(), w_rounded.data(), w.size());
    w_ptr = w16.data();
  } else if (type == Element::BF16) {
    f32_to_bf16(w.data(), w16.data(), w.size());
    bf16_to_f32(w16.data(), w_rounded.data(), w.size());
    w_ptr = w16.data();
  } else {
    w_rounded = w;
  }
  for (bool relu : {false, true}) {
    std::vector<float> y(M * N), expected(M * N);
    linear(x.data(), w_ptr, type, bias.data(), y.data(), M, N, K, relu);
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t n = 0; n < N; ++n) {
        double acc = bias[n];
        for (int64_t k = 0; k < K; ++k)
          acc += static_cast<double>(x[m * K + k]) * w_rounded[n * K + k];
        expected[m * N + n] = static_cast<float>(relu ? std::max(acc, 0.0) : acc);
      }
    }
    EXPECT_LT(relative_error(y.data(), expected.data(), y.size()), 1e-6) << "relu " << relu;
  }
}

INSTANTIATE_TEST_SUITE_P(WeightTypes, LinearTest,
                         ::testing::Values(Element::F32, Element::F16, Element::BF16));

TEST(LayerNorm, MatchesNaive) {
  const int64_t rows = 7, cols = 96;
  std::vector<float> x = random_values(rows * cols, 4, 3.0f);
  x[5] = 400.0f;  // an outlier channel
  const std::vector<float> gamma = random_values(cols, 5), beta = random_values(cols, 6);
  std::vector<float> y(x.size()), expected(x.size());
  layer_norm(x.data(), gamma.data(), beta.data(), y.data(), rows, cols, 1e-5f);
  for (int64_t r = 0; r < rows; ++r) {
    double mean = 0, var = 0;
    for (int64_t c = 0; c < cols; ++c) mean += x[r * cols + c];
    mean /= cols;
    for (int64_t c = 0; c < cols; ++c) var += std::pow(x[r * cols + c] - mean, 2);
    var /= cols;
    for (int64_t c = 0; c < cols; ++c) {
      expected[r * cols + c] =
          static_cast<float>((x[r * cols + c] - mean) / std::sqrt(var + 1e-5) * gamma[c] + beta[c]);
    }
  }
  EXPECT_LT(relative_error(y.data(), expected.data(), y.size()), 1e-6);
}

// Naive causal attention of one (sequence, head) over keys [start, i].
std::vector<float> naive_attention(const std::vector<float>& q, const std::vector<float>& k,
                                   const std::vector<float>& v, int64_t B, int64_t n, int64_t H,
                                   int64_t d, const std::vector<int32_t>& first_valid) {
  std::vector<float> out(q.size(), 0.0f);
  const int64_t D = H * d;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t i = first_valid[b]; i < n; ++i) {
        std::vector<double> s;
        double top = -std::numeric_limits<double>::infinity();
        for (int64_t j = first_valid[b]; j <= i; ++j) {
          double dot = 0;
          for (int64_t c = 0; c < d; ++c) {
            dot += static_cast<double>(q[(b * n + i) * D + h * d + c]) *
                   k[(b * n + j) * D + h * d + c];
          }
          s.push_back(dot);
          top = std::max(top, dot);
        }
        double total = 0;
        for (double& x : s) total += (x = std::exp(x - top));
        for (int64_t c = 0; c < d; ++c) {
          double acc = 0;
          for (size_t j = 0; j < s.size(); ++j) {
            acc += s[j] / total *
                   v[(b * n + first_valid[b] + static_cast<int64_t>(j)) * D + h * d + c];
          }
          out[(b * n + i) * D + h * d + c] = static_cast<float>(acc);
        }
      }
    }
  }
  return out;
}

TEST(Attention, PrefillMatchesNaiveWithPadding) {
  const int64_t B = 3, n = 150, H = 2, d = 16;  // n spans several query blocks
  const std::vector<int32_t> first_valid = {0, 37, 149};
  const auto q = random_values(B * n * H * d, 7), k = random_values(B * n * H * d, 8),
             v = random_values(B * n * H * d, 9);
  std::vector<float> out(q.size(), std::nanf(""));
  attention_prefill(q.data(), k.data(), v.data(), out.data(), B, n, H, H, d, first_valid.data());
  const std::vector<float> expected = naive_attention(q, k, v, B, n, H, d, first_valid);
  EXPECT_LT(relative_error(out.data(), expected.data(), out.size()), 1e-5);
}

// Attention over a cache in fp64, query by query: (B, n, H, d) queries, the cache's rows as
// attention_decode reads them (a prefix of `prefix_end` rows from each sequence's leader, then its
// own rows from first_valid); padding queries are zero.
std::vector<float> reference_over_cache(const std::vector<float>& q,
                                        const std::vector<float>& k_cache,
                                        const std::vector<float>& v_cache, int64_t B, int64_t n,
                                        int64_t H, int64_t H_kv, int64_t d, int64_t capacity,
                                        int64_t length, const std::vector<int32_t>& first_valid,
                                        const std::vector<int32_t>& begin,
                                        const std::vector<int32_t>& source, int64_t rows) {
  const int64_t group = H / H_kv;
  std::vector<float> expected(q.size(), 0.0f);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t row = length - n + i;
      if (row < first_valid[b]) continue;  // padding: zeros
      for (int64_t h = 0; h < H; ++h) {
        std::vector<const float*> keys, values;  // the rows query (b, i, h) attends to, in order
        const auto rows_of = [&](int64_t sequence, int64_t t0, int64_t t1) {
          for (int64_t t = t0; t < t1; ++t) {
            const size_t at =
                static_cast<size_t>(((sequence * H_kv + h / group) * capacity + t) * d);
            keys.push_back(&k_cache[at]);
            values.push_back(&v_cache[at]);
          }
        };
        if (rows > 0) rows_of(source[b], begin[b], rows);
        rows_of(b, first_valid[b], row + 1);
        const float* query = &q[((b * n + i) * H + h) * d];
        std::vector<double> weights;
        double top = -1e300, total = 0;
        for (const float* key : keys) {
          double dot = 0;
          for (int64_t c = 0; c < d; ++c) dot += query[c] * key[c];
          weights.push_back(dot);
          top = std::max(top, dot);
        }
        for (double& w : weights) total += (w = std::exp(w - top));
        for (size_t r = 0; r < keys.size(); ++r) {
          for (int64_t c = 0; c < d; ++c) {
            expected[((b * n + i) * H + h) * d + c] +=
                static_cast<float>(weights[r] / total * values[r][c]);
          }
        }
      }
    }
  }
  return expected;
}

TEST(Attention, ReadsEachGroupsPrefixFromItsLeaderOnly) {
  // Rows [0, 8) hold two groups' prefixes, each in its leader's rows alone: sequences 0 and 2
  // share 8 rows (leader 0), sequences 1 and 3 share rows [4, 8) (leader 1), sequence 4 shares
  // nothing. Every other row below a sequence's first_valid is NaN: never read. Three new rows
  // per sequence, causal; sequence 3's first new row is padding (zeros).
  const int64_t B = 5, n = 3, H = 4, H_kv = 2, d = 8, capacity = 24, length = 20, rows = 8;
  const std::vector<int32_t> first_valid = {8, 11, 15, 18, 9};
  const std::vector<int32_t> begin = {0, 4, 0, 4, 8}, source = {0, 1, 0, 1, 4};
  std::vector<float> k_cache = random_values(B * H_kv * capacity * d, 20);
  std::vector<float> v_cache = random_values(k_cache.size(), 21);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H_kv; ++h) {
      for (int64_t t = 0; t < first_valid[b]; ++t) {
        const bool leader_row = source[b] == b && t >= begin[b] && t < rows;
        for (int64_t c = 0; c < d && !leader_row; ++c) {
          k_cache[((b * H_kv + h) * capacity + t) * d + c] = std::nanf("");
          v_cache[((b * H_kv + h) * capacity + t) * d + c] = std::nanf("");
        }
      }
    }
  }
  const std::vector<float> q = random_values(B * n * H * d, 22);
  std::vector<float> out(q.size(), std::nanf(""));
  attention_decode(q.data(), k_cache.data(), v_cache.data(), Element::F32, out.data(), B, n, H,
                   H_kv, d, capacity, length, first_valid.data(), begin.data(), source.data(),
                   rows);
  const std::vector<float> expected = reference_over_cache(
      q, k_cache, v_cache, B, n, H, H_kv, d, capacity, length, first_valid, begin, source, rows);
  EXPECT_LT(relative_error(out.data(), expected.data(), out.size()), 1e-5);
}

// Long contexts: the rows in many blocks of 64, and a sequence's rows split into parts scored by
// different threads and merged (few (sequence, KV head) pairs: parts whatever the thread count),
// with grouped queries and multi-head.
// fp16 rows; a prefix shared by sequences 0 and 2 (B = 3), padding, decode steps and 3 new rows.
TEST(Attention, LongContextsInBlocksAndPartsMatchTheReference) {
  const int64_t H = 8, d = 64, capacity = 3000;
  const int32_t prefix = 700;
  for (const int64_t H_kv : {int64_t{2}, int64_t{8}}) {  // grouped queries, and multi-head
    for (const int64_t B : {int64_t{1}, int64_t{3}}) {
      for (const int64_t n : {int64_t{1}, int64_t{3}}) {
        const int64_t length = capacity - 5 + n;
        // Sequence 1 (no group) starts its prefix where it ends: no shared rows.
        std::vector<int32_t> first_valid = {1000, 1250, 2000}, prefix_begin = {0, prefix, 0},
                             prefix_source = {0, 1, 0};
        for (auto* v : {&first_valid, &prefix_begin, &prefix_source}) v->resize(B);
        const int64_t rows = B == 3 ? prefix : 0;  // the prefix's end (none when B is 1)
        const std::vector<float> values = random_values(B * H_kv * capacity * d, 40);
        std::vector<uint16_t> k16(values.size()), v16(values.size());
        f32_to_f16(values.data(), k16.data(), k16.size());
        const std::vector<float> other = random_values(values.size(), 41);
        f32_to_f16(other.data(), v16.data(), v16.size());
        // The reference reads the rounded rows.
        std::vector<float> k_cache(values.size()), v_cache(values.size());
        f16_to_f32(k16.data(), k_cache.data(), k_cache.size());
        f16_to_f32(v16.data(), v_cache.data(), v_cache.size());
        const std::vector<float> q = random_values(B * n * H * d, 42, 0.3f);
        std::vector<float> out(q.size(), std::nanf(""));
        attention_decode(q.data(), k16.data(), v16.data(), Element::F16, out.data(), B, n, H, H_kv,
                         d, capacity, length, first_valid.data(), prefix_begin.data(),
                         prefix_source.data(), rows);
        const std::vector<float> expected =
            reference_over_cache(q, k_cache, v_cache, B, n, H, H_kv, d, capacity, length,
                                 first_valid, prefix_begin, prefix_source, rows);
        EXPECT_LT(relative_error(out.data(), expected.data(), out.size()), 1e-5)
            << "H_kv " << H_kv << ", B " << B << ", n " << n;
      }
    }
  }
}

// An extension's rows attend over the cache as the prefill's last rows attend over the prompt:
// causal among themselves, padding rows zero.
TEST(Attention, ExtensionOverCacheMatchesLastPrefillRows) {
  const int64_t B = 2, n = 20, m = 7, H = 4, H_kv = 2, d = 8, capacity = 32;
  const std::vector<int32_t> first_valid = {0, 15};  // sequence 1: 2 of the last 7 are padding
  const auto q = random_values(B * n * H * d, 30), k = random_values(B * n * H_kv * d, 31),
             v = random_values(B * n * H_kv * d, 32);
  std::vector<float> expected(q.size());
  attention_prefill(q.data(), k.data(), v.data(), expected.data(), B, n, H, H_kv, d,
                    first_valid.data());
  std::vector<float> k_cache(B * H_kv * capacity * d), v_cache(k_cache.size());
  cache_store(k.data(), k_cache.data(), Element::F32, B, n, H_kv, d, capacity, 0);
  cache_store(v.data(), v_cache.data(), Element::F32, B, n, H_kv, d, capacity, 0);
  std::vector<float> q_last(B * m * H * d), out(q_last.size(), std::nanf("")),
      expected_last(q_last.size());
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t c = 0; c < m * H * d; ++c) {
      q_last[b * m * H * d + c] = q[(b * n + n - m) * H * d + c];
      expected_last[b * m * H * d + c] = expected[(b * n + n - m) * H * d + c];
    }
  }
  attention_decode(q_last.data(), k_cache.data(), v_cache.data(), Element::F32, out.data(), B, m, H,
                   H_kv, d, capacity, n, first_valid.data());
  EXPECT_LT(relative_error(out.data(), expected_last.data(), out.size()), 1e-5);
}

TEST(Attention, DecodeOverCacheMatchesLastPrefillRow) {
  const int64_t B = 2, n = 20, H = 3, d = 8, capacity = 32;
  const std::vector<int32_t> first_valid = {0, 6};
  const auto q = random_values(B * n * H * d, 10), k = random_values(B * n * H * d, 11),
             v = random_values(B * n * H * d, 12);
  const std::vector<float> expected = naive_attention(q, k, v, B, n, H, d, first_valid);
  for (Element type : {Element::F32, Element::F16}) {
    std::vector<uint16_t> k16(B * H * capacity * d), v16(k16.size());
    std::vector<float> k32(k16.size()), v32(k16.size());
    void* k_cache = type == Element::F32 ? static_cast<void*>(k32.data()) : k16.data();
    void* v_cache = type == Element::F32 ? static_cast<void*>(v32.data()) : v16.data();
    cache_store(k.data(), k_cache, type, B, n, H, d, capacity, 0);
    cache_store(v.data(), v_cache, type, B, n, H, d, capacity, 0);
    // The last token's query, (B, H, d).
    std::vector<float> q_last(B * H * d), out(B * H * d), expected_last(B * H * d);
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t c = 0; c < H * d; ++c) {
        q_last[b * H * d + c] = q[(b * n + n - 1) * H * d + c];
        expected_last[b * H * d + c] = expected[(b * n + n - 1) * H * d + c];
      }
    }
    attention_decode(q_last.data(), k_cache, v_cache, type, out.data(), B, 1, H, H, d, capacity, n,
                     first_valid.data());
    const double tolerance = type == Element::F32 ? 1e-5 : 2e-3;
    EXPECT_LT(relative_error(out.data(), expected_last.data(), out.size()), tolerance);
  }
}

// Grouped-query attention equals multi-head attention over K/V whose heads are repeated for
// every query head of their group (what transformers' repeat_kv does).
TEST(Attention, GroupedQueriesEqualRepeatedKeysAndValues) {
  const int64_t B = 2, n = 40, H = 6, H_kv = 2, d = 8, capacity = 48, group = H / H_kv;
  const std::vector<int32_t> first_valid = {0, 9};
  const auto q = random_values(B * n * H * d, 13), k = random_values(B * n * H_kv * d, 14),
             v = random_values(B * n * H_kv * d, 15);
  std::vector<float> k_rep(B * n * H * d), v_rep(k_rep.size());
  for (int64_t row = 0; row < B * n; ++row) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t c = 0; c < d; ++c) {
        k_rep[(row * H + h) * d + c] = k[(row * H_kv + h / group) * d + c];
        v_rep[(row * H + h) * d + c] = v[(row * H_kv + h / group) * d + c];
      }
    }
  }
  std::vector<float> grouped(q.size(), std::nanf("")), repeated(q.size(), std::nanf(""));
  attention_prefill(q.data(), k.data(), v.data(), grouped.data(), B, n, H, H_kv, d,
                    first_valid.data());
  attention_prefill(q.data(), k_rep.data(), v_rep.data(), repeated.data(), B, n, H, H, d,
                    first_valid.data());
  EXPECT_LT(relative_error(grouped.data(), repeated.data(), grouped.size()), 1e-6);

  std::vector<float> k_cache(B * H_kv * capacity * d), v_cache(k_cache.size());
  cache_store(k.data(), k_cache.data(), Element::F32, B, n, H_kv, d, capacity, 0);
  cache_store(v.data(), v_cache.data(), Element::F32, B, n, H_kv, d, capacity, 0);
  std::vector<float> q_last(B * H * d), out(B * H * d), expected(B * H * d);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t c = 0; c < H * d; ++c) {
      q_last[b * H * d + c] = q[(b * n + n - 1) * H * d + c];
      expected[b * H * d + c] = repeated[(b * n + n - 1) * H * d + c];
    }
  }
  attention_decode(q_last.data(), k_cache.data(), v_cache.data(), Element::F32, out.data(), B, 1, H,
                   H_kv, d, capacity, n, first_valid.data());
  EXPECT_LT(relative_error(out.data(), expected.data(), out.size()), 1e-5);
}

}  // namespace
}  // namespace infinigen::kernels::cpu
