// tests: the prompt tokens a capped pool keeps (speculate/prompt_keep.h), the eviction history
// they are seeded with (EvictionTable::seed_row), and the selection of speculation itself.
#include "speculate/prompt_keep.h"

#include <gtest/gtest.h>

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <sstream>
#include <utility>

#include "core/ops.h"
#include "core/rope.h"
#include "speculate/speculation.h"

namespace infinigen {
namespace {

// A prompt of n tokens, d = 4: every query attends strongly to token `sink` (a large logit),
// and otherwise to its own recent past only weakly (random small logits).
struct Prompt {
  int64_t n = 0, d = 4;
  std::vector<float> q, k;  // (n, d)
};

Prompt prompt_with_sink(int64_t n, int64_t sink, uint32_t seed) {
  Prompt p;
  p.n = n;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> small(-0.1f, 0.1f);
  p.q.resize(static_cast<size_t>(n * p.d));
  p.k.resize(static_cast<size_t>(n * p.d));
  for (int64_t t = 0; t < n; ++t) {
    p.q[t * p.d] = 1.0f;  // every query looks along the first column
    p.k[t * p.d] = t == sink ? 10.0f : small(rng);
    for (int64_t c = 1; c < p.d; ++c) {
      p.q[t * p.d + c] = small(rng);
      p.k[t * p.d + c] = small(rng);
    }
  }
  return p;
}

std::vector<int32_t> range(int32_t from, int32_t to) {
  std::vector<int32_t> v(static_cast<size_t>(to - from));
  std::iota(v.begin(), v.end(), from);
  return v;
}

TEST(PromptKeep, EverythingFitsIsKeptWithItsCounts) {
  const Prompt p = prompt_with_sink(6, 0, 1);
  const PromptKeep keep = keep_prompt_tokens(p.q.data(), p.d, 1, p.k.data(), p.d, 0, 6, p.d, 8, 1.0,
                                             EvictionPolicy::Counter);
  EXPECT_EQ(keep.tokens, range(0, 6));
  // Every position fetches the sink (logit 10, the rest near 0): 6 fetches, the last at 5. Each
  // other token is fetched by itself only... (logit > top - 1 is false for ~0 against 10).
  EXPECT_EQ(keep.fetches[0], 6);
  EXPECT_EQ(keep.last_fetch[0], 5);
  for (size_t t = 1; t < 6; ++t) {
    EXPECT_EQ(keep.fetches[t], 0) << t;
    EXPECT_EQ(keep.last_fetch[t], -1) << t;
  }
}

TEST(PromptKeep, CounterAndLruKeepTheSinkFifoKeepsTheNewest) {
  const int64_t n = 20, capacity = 8;  // 4 candidates from the older 16, the newest 4 protected
  const Prompt p = prompt_with_sink(n, 0, 2);
  for (EvictionPolicy policy : {EvictionPolicy::Counter, EvictionPolicy::Lru}) {
    const PromptKeep keep =
        keep_prompt_tokens(p.q.data(), p.d, 1, p.k.data(), p.d, 0, n, p.d, capacity, 1.0, policy);
    ASSERT_EQ(keep.tokens.size(), 8u);
    EXPECT_EQ(keep.tokens.front(), 0) << eviction_policy_name(policy);  // the sink survives
    EXPECT_TRUE(std::is_sorted(keep.tokens.begin(), keep.tokens.end()));
    // The protected half: the newest capacity - floor(capacity / 2) tokens.
    const std::vector<int32_t> newest = range(16, 20);
    EXPECT_TRUE(
        std::includes(keep.tokens.begin(), keep.tokens.end(), newest.begin(), newest.end()));
  }
  const PromptKeep fifo = keep_prompt_tokens(p.q.data(), p.d, 1, p.k.data(), p.d, 0, n, p.d,
                                             capacity, 1.0, EvictionPolicy::Fifo);
  EXPECT_EQ(fifo.tokens, range(12, 20));
}

TEST(PromptKeep, PaddingIsNeverKeptAndAShortSequenceKeepsAll) {
  const Prompt p = prompt_with_sink(12, 9, 3);
  // Valid tokens [9, 12): 3 of them fit a capacity of 5.
  const PromptKeep keep = keep_prompt_tokens(p.q.data(), p.d, 1, p.k.data(), p.d, 9, 12, p.d, 5,
                                             1.0, EvictionPolicy::Counter);
  EXPECT_EQ(keep.tokens, range(9, 12));
  EXPECT_EQ(keep.fetches[0], 3);  // token 9 is the sink of this sequence
  EXPECT_EQ(keep.last_fetch[0], 11);
  // Valid tokens [4, 12) into 4 positions, the sink first: counter keeps it, the protected
  // 10 and 11, and one more; nothing of the padding.
  const Prompt sunk = prompt_with_sink(12, 4, 4);
  const PromptKeep tight = keep_prompt_tokens(sunk.q.data(), sunk.d, 1, sunk.k.data(), sunk.d, 4,
                                              12, sunk.d, 4, 1.0, EvictionPolicy::Counter);
  ASSERT_EQ(tight.tokens.size(), 4u);
  EXPECT_EQ(tight.tokens.front(), 4);
  EXPECT_EQ(tight.tokens[2], 10);
  EXPECT_EQ(tight.tokens[3], 11);
}

// A pass that extends a pool (a resumed conversation's turn) keeps what one prompt over the same
// tokens keeps: the first 5 tokens held with what a prompt over them recorded, then the other 11
// as the pass's rows (at positions 5 to 15, its rows 2 to 12 after 2 of history in the pass).
TEST(PromptKeep, AnExtensionOverHeldTokensKeepsWhatOnePromptKeeps) {
  const int64_t n = 16, held_n = 5, capacity = 7;
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> any(-1.0f, 1.0f);
  const int64_t d = 4;
  std::vector<float> q(static_cast<size_t>(n * d)), k(q.size());
  for (float& x : q) x = any(rng);
  for (float& x : k) x = any(rng);
  for (const EvictionPolicy policy : kEvictionPolicies) {
    const PromptKeep first =
        keep_prompt_tokens(q.data(), d, 1, k.data(), d, 0, held_n, d, held_n, 0.5, policy);
    ASSERT_EQ(first.tokens, range(0, held_n));
    HeldEntries held{first.tokens, first.fetches, first.last_fetch,
                     std::vector<float>(k.begin(), k.begin() + held_n * d)};
    // The pass's rows start 2 tokens before its first new one (history it computes again).
    const int64_t row0 = held_n - 2;
    const PromptKeep extended =
        keep_extension_tokens(held, q.data() + row0 * d, d, 1, k.data() + row0 * d, d, 2, n - row0,
                              d, row0, capacity, 0.5, policy);
    const PromptKeep once =
        keep_prompt_tokens(q.data(), d, 1, k.data(), d, 0, n, d, capacity, 0.5, policy);
    EXPECT_EQ(extended.tokens, once.tokens) << eviction_policy_name(policy);
    EXPECT_EQ(extended.fetches, once.fetches) << eviction_policy_name(policy);
    EXPECT_EQ(extended.last_fetch, once.last_fetch) << eviction_policy_name(policy);
    EXPECT_EQ(std::ssize(extended.tokens), capacity);
  }
}

TEST(EvictionSeed, CountersShiftTogetherAndLruTakesTheLastFetch) {
  EvictionTable counter(EvictionPolicy::Counter, 1, 4, /*counter_bits=*/4);  // max 15
  for (int64_t slot = 0; slot < 4; ++slot) counter.on_insert(0, slot, slot);
  counter.seed_row(0, {40, 3, 0, 15}, {9, 9, -1, 9});
  // 40 needs two halvings to fit 15: 10, 0, 0, 3.
  EXPECT_EQ(counter.counter(0, 0), 10);
  EXPECT_EQ(counter.counter(0, 1), 0);
  EXPECT_EQ(counter.counter(0, 3), 3);
  EXPECT_EQ(counter.victim(0, 10), 1);  // candidates 0 and 1 (the older half): 1 has fewer

  EvictionTable lru(EvictionPolicy::Lru, 1, 4);
  for (int64_t slot = 0; slot < 4; ++slot) lru.on_insert(0, slot, slot);
  lru.seed_row(0, {1, 0, 1, 1}, {7, -1, 3, 3});
  EXPECT_EQ(lru.last_use(0, 0), 7);
  EXPECT_EQ(lru.last_use(0, 1), 1);  // never fetched: its insertion
  EXPECT_EQ(lru.victim(0, 8), 1);
  EXPECT_THROW(lru.seed_row(0, {1, 2, 3, 4, 5}, {0, 0, 0, 0, 0}), Error);
}

// Normal(0, 1) values from one seeded stream: `random(shape)` is an F32 tensor of them,
// `random.value()` one value.
class NormalDraws {
 public:
  explicit NormalDraws(uint32_t seed) : rng_(seed) {}
  float value() { return normal_(rng_); }
  Tensor operator()(Shape shape) {
    Tensor t = Tensor::empty(std::move(shape), DType::F32);
    for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = value();
    return t;
  }

 private:
  std::mt19937 rng_;
  std::normal_distribution<float> normal_{0.0f, 1.0f};
};

// Speculation's shapes: query heads, KV heads, and whether the model rotates (RoPE) and carries
// a skew beside its weights.
struct SpeculationCase {
  int64_t heads, kv_heads;
  bool rotary, skewed;
};

std::string case_name(const ::testing::TestParamInfo<SpeculationCase>& info) {
  const SpeculationCase& c = info.param;
  std::ostringstream name;
  name << "H" << c.heads << "_Hkv" << c.kv_heads << (c.rotary ? "_rope" : "")
       << (c.skewed ? "_skew" : "");
  return name.str();
}

class SpeculationRatioOne : public ::testing::TestWithParam<SpeculationCase> {};

// With ratio 1 and the layer's own input, speculation is exact: the estimated logits are the
// true ones (for a group, the maximum over its query heads), whatever the rotation and the skew
// (orthogonal, so it changes no dot product), and the selection is the exact top-n' of every
// row.
TEST_P(SpeculationRatioOne, TheLayersOwnInputGivesTheTrueLogitsAndTheExactTopN) {
  const SpeculationCase c = GetParam();
  const int64_t B = 2, H = c.heads, Hkv = c.kv_heads, G = H / Hkv, d = 8, D = 16, n = 24;
  NormalDraws random(7);
  const Tensor x_prompt = random({B * n, D}), wq = random({H * d, D}), bq = random({H * d});
  Tensor keys = random({B * n, Hkv * d});
  Tensor queries = Tensor::empty({B * n, H * d}, DType::F32);
  ops::linear(x_prompt, wq, bq, queries);
  const std::vector<int32_t> first_valid = {0, 5};  // sequence 1 is left-padded
  std::vector<int32_t> prompt_positions(static_cast<size_t>(B * n));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t t = 0; t < n; ++t) {
      prompt_positions[static_cast<size_t>(b * n + t)] =
          static_cast<int32_t>(std::max<int64_t>(0, t - first_valid[static_cast<size_t>(b)]));
    }
  }
  Tensor inv_freq, skew;
  if (c.rotary) {
    RopeConfig rope;
    rope.theta = 100.0;
    inv_freq = Tensor::from_floats({d / 2}, rope_inv_freq(rope, d));
    ops::rope(queries, prompt_positions, inv_freq);
    ops::rope(keys, prompt_positions, inv_freq);
  }
  if (c.skewed) {  // a random orthogonal matrix per KV head
    skew = Tensor::empty({Hkv, d, d}, DType::F32);
    for (int64_t g = 0; g < Hkv; ++g) {
      Eigen::MatrixXf m(d, d);
      for (int64_t i = 0; i < d * d; ++i) m.data()[i] = random.value();
      const Eigen::MatrixXf a = Eigen::HouseholderQR<Eigen::MatrixXf>(m).householderQ();
      for (int64_t i = 0; i < d; ++i) {
        for (int64_t j = 0; j < d; ++j) skew.data<float>()[(g * d + i) * d + j] = a(i, j);
      }
    }
  }
  ops::scale_inplace(queries, 1.0f / std::sqrt(static_cast<float>(d)));
  PartialLayer layer;
  layer.build({queries, keys, wq, bq, inv_freq, skew}, first_valid, H, Hkv, n, d,
              PartialIndexRule::QK);

  // The decode token of each sequence, at its next position.
  const Tensor x = random({B, D});
  Tensor q = Tensor::empty({B, H * d}, DType::F32);
  ops::linear(x, wq, bq, q);
  const std::vector<int32_t> positions = {static_cast<int32_t>(n - first_valid[0]),
                                          static_cast<int32_t>(n - first_valid[1])};
  if (c.rotary) ops::rope(q, positions, inv_freq);
  const std::vector<float> logits = layer.estimate_logits(x, positions, n, first_valid);
  ASSERT_EQ(logits.size(), static_cast<size_t>(B * Hkv * n));
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t g = 0; g < Hkv; ++g) {
      for (int64_t t = 0; t < n; ++t) {
        const float estimate = logits[static_cast<size_t>((b * Hkv + g) * n + t)];
        if (t < first_valid[b]) {
          EXPECT_EQ(estimate, -INFINITY);
          continue;
        }
        float best = -INFINITY;
        for (int64_t h = g * G; h < (g + 1) * G; ++h) {
          float dot = 0.0f;
          for (int64_t e = 0; e < d; ++e) {
            dot += q.data<float>()[b * H * d + h * d + e] *
                   keys.data<float>()[(b * n + t) * Hkv * d + g * d + e];
          }
          best = std::max(best, dot * scale);
        }
        EXPECT_NEAR(estimate, best, 1e-4f * (1.0f + std::fabs(best))) << b << " " << g << " " << t;
      }
    }
  }

  // The same cache kept in fp16 estimates the same logits to fp16 rounding of the keys.
  PartialLayer half;
  half.build({queries, keys, wq, bq, inv_freq, skew}, first_valid, H, Hkv, n, d,
             PartialIndexRule::QK, nullptr, DType::F16);
  const std::vector<float> rounded = half.estimate_logits(x, positions, n, first_valid);
  for (size_t i = 0; i < logits.size(); ++i) {
    if (logits[i] == -INFINITY) {
      EXPECT_EQ(rounded[i], -INFINITY);
    } else {
      EXPECT_NEAR(rounded[i], logits[i], 2e-3f * (1.0f + std::fabs(logits[i])));
    }
  }

  SpeculationOptions options;
  options.alpha = 1.5;
  options.max_num_kv = n;
  const PartialLayer::Selection sel = layer.select(logits, n, options);
  for (int64_t b = 0; b < B; ++b) {
    // n' of sequence b: floor of the mean over its KV heads of the alpha counts.
    int64_t total = 0;
    for (int64_t g = 0; g < Hkv; ++g) {
      const float* s = logits.data() + (b * Hkv + g) * n;
      const float top = *std::max_element(s, s + n);
      total += std::count_if(s, s + n, [&](float v) { return v > top - options.alpha; });
    }
    EXPECT_EQ(sel.take[b], std::max<int64_t>(1, total / Hkv)) << b;
    for (int64_t g = 0; g < Hkv; ++g) {
      const float* s = logits.data() + (b * Hkv + g) * n;
      std::vector<int32_t> order =
          range(static_cast<int32_t>(first_valid[b]), static_cast<int32_t>(n));
      std::stable_sort(order.begin(), order.end(),
                       [&](int32_t a, int32_t e) { return s[a] > s[e]; });
      order.resize(static_cast<size_t>(sel.take[b]));
      std::sort(order.begin(), order.end());
      const int32_t* chosen = sel.tokens.data() + (b * Hkv + g) * sel.fetch;
      EXPECT_EQ(std::vector<int32_t>(chosen, chosen + sel.take[b]), order) << b << " " << g;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, SpeculationRatioOne,
                         ::testing::Values(SpeculationCase{2, 2, false, false},
                                           SpeculationCase{4, 2, false, false},
                                           SpeculationCase{4, 2, true, false},
                                           SpeculationCase{4, 1, true, true},
                                           SpeculationCase{2, 2, true, true}),
                         case_name);

// Below ratio 1 without a skew, a rotary model's partial queries need the rotary pair of each
// partial column: the weights keep at most 2r rows per head, and the estimated logits are the
// exact dot products over the partial columns.
TEST(Speculation, RotaryPartialColumnsAreExactOverTheirColumns) {
  const int64_t B = 1, H = 2, d = 8, D = 8, n = 10, r = 2;
  NormalDraws random(3);
  const Tensor wq = random({H * d, D}), bq = random({H * d}), x_prompt = random({n, D});
  Tensor queries = Tensor::empty({n, H * d}, DType::F32);
  ops::linear(x_prompt, wq, bq, queries);
  Tensor keys = random({n, H * d});
  RopeConfig rope;
  rope.theta = 50.0;
  const Tensor inv_freq = Tensor::from_floats({d / 2}, rope_inv_freq(rope, d));
  std::vector<int32_t> prompt_positions(static_cast<size_t>(n));
  std::iota(prompt_positions.begin(), prompt_positions.end(), 0);
  ops::rope(queries, prompt_positions, inv_freq);
  ops::rope(keys, prompt_positions, inv_freq);
  const Tensor none;
  PartialLayer layer;
  layer.build({queries, keys, wq, bq, inv_freq, none}, {0}, H, H, n, r, PartialIndexRule::QK);
  const Tensor x = random({B, D});
  Tensor q = Tensor::empty({B, H * d}, DType::F32);
  ops::linear(x, wq, bq, q);
  const std::vector<int32_t> position = {static_cast<int32_t>(n)};
  ops::rope(q, position, inv_freq);
  const std::vector<float> logits = layer.estimate_logits(x, position, n, {0});
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t t = 0; t < n; ++t) {
      float dot = 0.0f;
      for (int64_t j = 0; j < r; ++j) {
        const int32_t col = layer.columns()[static_cast<size_t>(h * r + j)];
        dot += q.data<float>()[h * d + col] * keys.data<float>()[t * H * d + h * d + col];
      }
      EXPECT_NEAR(logits[static_cast<size_t>(h * n + t)], dot / std::sqrt(static_cast<float>(d)),
                  1e-4f);
    }
  }
}

}  // namespace
}  // namespace infinigen
