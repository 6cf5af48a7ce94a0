// tests: the `infinigen` KV policy: selecting everything reproduces `full`, bytes follow the
// selection, nothing reads unfetched KV, and the flags are validated.
#include <gtest/gtest.h>

#include "offload/runtime.h"
#include "tests/test_util.h"

namespace infinigen {
namespace {

double logit_error(const GenerationResult& a, const GenerationResult& b) {
  const std::vector<float> x = a.last_logits.to_floats(), y = b.last_logits.to_floats();
  return testing_util::relative_error(x.data(), y.data(), x.size());
}

class InfinigenPolicy : public ::testing::Test {
 protected:
  void SetUp() override {
    source_ = resolve_model("opt-tiny", {});
    source_.config.num_layers = 4;  // two dense layers and two speculated ones
    // Equal lengths: with left padding the mean alpha count is below the longest sequence's.
    request_.prompts = {{2, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20},
                        {2, 500, 600, 700, 800, 900, 1000, 1100, 1200, 1300, 1400, 1500}};
    request_.gen_len = 6;
  }
  void TearDown() override { set_debug_poison(false); }

  OffloadRun run(KvPolicy policy, const SpeculationOptions& speculation = {}) {
    OffloadOptions options;
    options.policy = policy;
    options.speculation = speculation;
    options.kv_block_tokens = 4;
    return run_offloaded(source_, request_, options, Device::Cpu);
  }

  ModelSource source_;
  GenerationRequest request_;
};

TEST_F(InfinigenPolicy, SelectingEverythingReproducesFull) {
  SpeculationOptions everything;
  everything.alpha = 1e9;
  everything.max_num_kv = 1000;
  const OffloadRun full = run(KvPolicy::Full);
  const OffloadRun infinigen = run(KvPolicy::Infinigen, everything);
  EXPECT_EQ(infinigen.result.tokens, full.result.tokens);
  EXPECT_LT(logit_error(infinigen.result, full.result), 1e-6);
  for (size_t i = 1; i < infinigen.stats.steps().size(); ++i) {
    for (const LayerTraffic& layer : infinigen.stats.steps()[i].layers) {
      EXPECT_EQ(layer.tokens_fetched, layer.tokens_stored);
    }
  }
}

TEST_F(InfinigenPolicy, SpeculatedLayersLoadOnlyTheSelectedRows) {
  SpeculationOptions sparse;
  sparse.alpha = 0.5;
  sparse.max_num_kv = 4;
  const OffloadRun r = run(KvPolicy::Infinigen, sparse);
  const ModelConfig& c = source_.config;
  const uint64_t row_bytes = static_cast<uint64_t>(c.head_dim()) * 2;  // fp16
  for (size_t i = 1; i < r.stats.steps().size(); ++i) {
    const auto& layers = r.stats.steps()[i].layers;
    for (size_t l = 0; l < layers.size(); ++l) {
      // Every layer's bytes are its fetched rows of K and V; dense layers fetch them all.
      EXPECT_EQ(layers[l].kv_h2d_bytes, 2 * layers[l].tokens_fetched * row_bytes) << l;
      if (l < 2) {
        EXPECT_EQ(layers[l].tokens_fetched, layers[l].tokens_stored) << l;
      } else {
        EXPECT_GE(layers[l].tokens_fetched, 2u * c.num_heads) << l;      // n' >= 1
        EXPECT_LE(layers[l].tokens_fetched, 2u * c.num_heads * 4) << l;  // n' <= max_num_kv
      }
    }
  }
}

TEST_F(InfinigenPolicy, NothingReadsKvThatWasNotTransferred) {
  SpeculationOptions sparse;
  sparse.alpha = 1.0;
  sparse.max_num_kv = 5;
  const auto expected = run(KvPolicy::Infinigen, sparse).result.tokens;
  set_debug_poison(true);
  EXPECT_EQ(run(KvPolicy::Infinigen, sparse).result.tokens, expected);
}

TEST_F(InfinigenPolicy, RecallIsMeasuredOnSpeculatedLayers) {
  OffloadOptions options;
  options.policy = KvPolicy::Infinigen;
  options.check_recall = true;
  options.speculation.alpha = 1e9;
  options.speculation.max_num_kv = 1000;
  const OffloadRun r = run_offloaded(source_, request_, options, Device::Cpu);
  for (size_t i = 1; i < r.stats.steps().size(); ++i) {
    const auto& layers = r.stats.steps()[i].layers;
    EXPECT_LT(layers[0].recall, 0.0);          // dense: not measured
    EXPECT_NEAR(layers[3].recall, 1.0, 1e-9);  // everything fetched: all of the weight
  }
}

TEST_F(InfinigenPolicy, CappedPoolWithoutEvictionsReproducesFull) {
  // capacity = prompt + gen = 18 tokens, of which the cache ever holds 17: a pool of 17 positions
  // runs the capped code paths (position bookkeeping, compact dense loads) but never evicts.
  OffloadOptions options;
  options.policy = KvPolicy::Infinigen;
  options.speculation.alpha = 1e9;
  options.speculation.max_num_kv = 1000;
  options.kv_pool_limit = 17.5 / 18.0;  // floor(0.972 * 18) = 17 positions
  options.kv_block_tokens = 4;
  const OffloadRun capped = run_offloaded(source_, request_, options, Device::Cpu);
  const OffloadRun full = run(KvPolicy::Full);
  EXPECT_EQ(capped.result.tokens, full.result.tokens);
  // Same rows in the same order: the same arithmetic up to vectorisation (buffer offsets).
  EXPECT_LT(logit_error(capped.result, full.result), 1e-6);
}

TEST_F(InfinigenPolicy, CappedPoolEvictsAndReadsOnlyWhatItHolds) {
  for (EvictionPolicy eviction :
       {EvictionPolicy::Counter, EvictionPolicy::Lru, EvictionPolicy::Fifo}) {
    OffloadOptions options;
    options.policy = KvPolicy::Infinigen;
    options.kv_pool_limit = 0.5;  // 9 of 18 positions: the prompt alone overflows it
    options.eviction = eviction;
    options.kv_block_tokens = 4;
    options.check_recall = true;
    const OffloadRun plain = run_offloaded(source_, request_, options, Device::Cpu);
    set_debug_poison(true);
    const OffloadRun poisoned = run_offloaded(source_, request_, options, Device::Cpu);
    set_debug_poison(false);
    EXPECT_EQ(poisoned.result.tokens, plain.result.tokens) << eviction_policy_name(eviction);
    const uint64_t H = source_.config.num_heads, B = request_.prompts.size();
    for (size_t i = 1; i < plain.stats.steps().size(); ++i) {
      for (const LayerTraffic& layer : plain.stats.steps()[i].layers) {
        EXPECT_EQ(layer.tokens_stored, B * H * 9) << "step " << i;  // the pool stays full
        EXPECT_LE(layer.tokens_fetched, layer.tokens_stored);
      }
      const double recall = plain.stats.steps()[i].layers[3].recall;
      EXPECT_GT(recall, 0.0);
      EXPECT_LE(recall, 1.0 + 1e-9);
    }
  }
}

TEST(KvPoolLimit, FractionsAndBytesBecomePositions) {
  const ModelConfig c = load_preset("opt-tiny");  // L 2, D 64
  EXPECT_EQ(kv_pool_positions(0, c, 2, 100, DType::F16), 0);
  EXPECT_EQ(kv_pool_positions(0.5, c, 2, 100, DType::F16), 50);
  EXPECT_EQ(kv_pool_positions(1.0, c, 2, 100, DType::F16), 100);
  // Bytes: 2 (K, V) * L * B * D * 2 bytes = 1024 bytes per position.
  EXPECT_EQ(kv_pool_positions(10 * 1024.0, c, 2, 100, DType::F16), 10);
  EXPECT_EQ(kv_pool_positions(1e12, c, 2, 100, DType::F16), 100);
  EXPECT_THROW(kv_pool_positions(0.01, c, 2, 100, DType::F16), Error);  // 1 position
  EXPECT_THROW(kv_pool_positions(-1, c, 2, 100, DType::F16), Error);
}

TEST(SpeculationOptions, BadValuesNameTheFlag) {
  const auto message = [](SpeculationOptions o) {
    try {
      o.validate();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  SpeculationOptions o;
  o.alpha = -1;
  EXPECT_NE(message(o).find("--alpha"), std::string::npos);
  o = {};
  o.partial_ratio = 0;
  EXPECT_NE(message(o).find("--partial-ratio"), std::string::npos);
  o.partial_ratio = 1.5;
  EXPECT_NE(message(o).find("--partial-ratio"), std::string::npos);
  o = {};
  o.dense_layers = 0;
  EXPECT_NE(message(o).find("--dense-layers"), std::string::npos);
  EXPECT_THROW(parse_partial_index_rule("kq"), Error);
  EXPECT_EQ(message(SpeculationOptions{}), "");
}

}  // namespace
}  // namespace infinigen
