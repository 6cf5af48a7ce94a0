// tests: the `infinigen` KV policy: selecting everything reproduces `full`, bytes follow the
// selection, nothing reads unfetched KV, and the flags are validated.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "core/model_loader.h"
#include "offload/infinigen_kv.h"
#include "offload/run_summary.h"
#include "offload/runtime.h"
#include "tests/test_util.h"

namespace infinigen {
namespace {

double logit_error(const GenerationResult& a, const GenerationResult& b) {
  const std::vector<float> x = a.last_logits.to_floats(), y = b.last_logits.to_floats();
  return testing_util::relative_error(x.data(), y.data(), x.size());
}

class InfinigenPolicy : public testing_util::SmallRunTest {
 protected:
  OffloadRun run(const std::string& policy, const SpeculationOptions& speculation = {},
                 KvPlacement dense_kv = KvPlacement::Auto) {
    OffloadOptions options;
    options.policy = policy;
    options.speculation = speculation;
    options.kv_block_tokens = 4;
    options.dense_kv = dense_kv;
    return run_offloaded(source_, request_, options, Device::Cpu);
  }

  // Runs `full` and `infinigen` with `speculation`, which selects every token: the same tokens and
  // logits, and every layer fetches all it stores.
  void expect_infinigen_reproduces_full(const SpeculationOptions& speculation) {
    const OffloadRun full = run("full");
    const OffloadRun infinigen = run("infinigen", speculation);
    EXPECT_EQ(infinigen.result.tokens, full.result.tokens);
    EXPECT_LT(logit_error(infinigen.result, full.result), 1e-6);
    for (size_t i = 1; i < infinigen.stats.steps().size(); ++i) {
      for (const LayerTraffic& layer : infinigen.stats.steps()[i].layers) {
        EXPECT_EQ(layer.tokens_fetched, layer.tokens_stored) << "step " << i;
      }
    }
  }
};

// Speculation under which every stored token passes the threshold and fits the fetch.
SpeculationOptions select_everything() {
  SpeculationOptions everything;
  everything.alpha = 1e9;
  everything.max_num_kv = 1000;
  return everything;
}

TEST_F(InfinigenPolicy, SelectingEverythingReproducesFull) {
  expect_infinigen_reproduces_full(select_everything());
}

TEST_F(InfinigenPolicy, MixedLengthBatchSelectingEverythingReproducesFull) {
  // Left padding: the sequences hold 12, 4 and 8 tokens. With every token above the threshold,
  // each sequence's fetch is its own token count, so the batch computes exactly what `full` does.
  request_.prompts = {{2, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20},
                      {2, 700, 800, 900},
                      {2, 33, 44, 55, 66, 77, 88, 99}};
  request_.gen_len = 8;
  SpeculationOptions everything = select_everything();
  expect_infinigen_reproduces_full(everything);
  // The paper's batch-wide mean gives the longest sequence fewer rows than it holds.
  everything.fetch_rule = FetchRule::Batch;
  const OffloadRun batch_rule = run("infinigen", everything);
  const LayerTraffic& speculated = batch_rule.stats.steps()[1].layers[3];
  EXPECT_LT(speculated.tokens_fetched, speculated.tokens_stored);
}

// Selecting everything, a speculated layer fetches at each step all it fetched at the step before
// and the token stored since: every row but one per (sequence, KV head) is fetched again. Not
// known for dense layers and at the first decode step; never more than fetched when sparse.
TEST_F(InfinigenPolicy, RowsFetchedAgainAreCountedAgainstTheStepBefore) {
  const SpeculationOptions everything = select_everything();
  const OffloadRun r = run("infinigen", everything);
  const uint64_t rows = request_.prompts.size() * static_cast<uint64_t>(source_.config.kv_heads());
  const auto& steps = r.stats.steps();
  ASSERT_GT(steps.size(), 2u);
  for (size_t i = 1; i < steps.size(); ++i) {
    for (size_t l = 0; l < steps[i].layers.size(); ++l) {
      const LayerTraffic& t = steps[i].layers[l];
      if (static_cast<int64_t>(l) < everything.dense_layers || i == 1) {
        EXPECT_EQ(t.tokens_fetched_again, -1) << "step " << i << ", layer " << l;
      } else {
        EXPECT_EQ(t.tokens_fetched_again, static_cast<int64_t>(t.tokens_fetched - rows))
            << "step " << i << ", layer " << l;
      }
    }
  }
  const double share = summarize(r).fetched_again_fraction;
  EXPECT_GT(share, 0.5);
  EXPECT_LT(share, 1.0);

  SpeculationOptions sparse;
  sparse.alpha = 1.0;
  sparse.max_num_kv = 4;
  const OffloadRun s = run("infinigen", sparse);
  for (size_t i = 2; i < s.stats.steps().size(); ++i) {
    for (size_t l = 2; l < s.stats.steps()[i].layers.size(); ++l) {
      const LayerTraffic& t = s.stats.steps()[i].layers[l];
      EXPECT_GE(t.tokens_fetched_again, 0);
      EXPECT_LE(t.tokens_fetched_again, static_cast<int64_t>(t.tokens_fetched));
    }
  }
}

TEST_F(InfinigenPolicy, SpeculatedLayersLoadOnlyTheSelectedRows) {
  SpeculationOptions sparse;
  sparse.alpha = 0.5;
  sparse.max_num_kv = 4;
  const OffloadRun r = run("infinigen", sparse, KvPlacement::Host);
  const ModelConfig& c = source_.config;
  const uint64_t row_bytes = static_cast<uint64_t>(c.head_dim()) * 2;  // fp16
  for (size_t i = 1; i < r.stats.steps().size(); ++i) {
    const auto& layers = r.stats.steps()[i].layers;
    for (size_t l = 0; l < layers.size(); ++l) {
      // Every layer's bytes are its fetched rows of K and V, less those the row cache held;
      // dense layers fetch them all.
      EXPECT_EQ(layers[l].kv_h2d_bytes,
                2 * (layers[l].tokens_fetched - layers[l].tokens_from_row_cache) * row_bytes)
          << l;
      if (l < 2) {
        EXPECT_EQ(layers[l].tokens_fetched, layers[l].tokens_stored) << l;
      } else {
        EXPECT_GE(layers[l].tokens_fetched, 2u * c.num_heads) << l;      // n' >= 1
        EXPECT_LE(layers[l].tokens_fetched, 2u * c.num_heads * 4) << l;  // n' <= max_num_kv
      }
    }
  }
}

// The dense layers' KV kept on the device: the same tokens and logits as when it is loaded every
// step, with a shared prefix, left padding and the prompt in chunks, and not a byte of it loaded
// after the prompt; the pool still receives every row (sessions read it there).
TEST_F(InfinigenPolicy, DenseLayersKeptOnTheDeviceComputeTheSameAndLoadNothing) {
  set_debug_poison(true);  // a resident row no pass wrote would be NaN
  request_.prompts = {{2, 10, 11, 12, 13, 14, 15, 16, 17, 30, 31, 32, 33},
                      {2, 10, 11, 12, 13, 14, 15, 16, 17, 50},
                      {2, 60, 61}};
  request_.gen_len = 6;
  SpeculationOptions sparse;
  sparse.alpha = 1.0;
  sparse.max_num_kv = 5;
  for (int64_t chunk : {0, 3}) {
    OffloadOptions options;
    options.policy = "infinigen";
    options.speculation = sparse;
    options.kv_block_tokens = 4;
    options.prefill_chunk = chunk;
    options.dense_kv = KvPlacement::Host;
    const OffloadRun loaded = run_offloaded(source_, request_, options, Device::Cpu);
    options.dense_kv = KvPlacement::Auto;  // fits: the device
    const OffloadRun resident = run_offloaded(source_, request_, options, Device::Cpu);
    ASSERT_EQ(resident.plan.dense_kv, KvPlacement::Device);
    EXPECT_EQ(resident.shared_prefixes.num_groups(), 1);
    EXPECT_EQ(resident.result.tokens, loaded.result.tokens) << "chunk " << chunk;
    EXPECT_EQ(logit_error(resident.result, loaded.result), 0.0) << "chunk " << chunk;
    ASSERT_EQ(resident.stats.steps().size(), loaded.stats.steps().size());
    for (size_t i = 1; i < resident.stats.steps().size(); ++i) {
      const auto& ours = resident.stats.steps()[i].layers;
      const auto& theirs = loaded.stats.steps()[i].layers;
      for (size_t l = 0; l < ours.size(); ++l) {
        if (l < 2) {
          EXPECT_EQ(ours[l].kv_h2d_bytes, 0u) << "step " << i << " layer " << l;
          EXPECT_GT(theirs[l].kv_h2d_bytes, 0u) << "step " << i << " layer " << l;
        } else {
          EXPECT_EQ(ours[l].kv_h2d_bytes, theirs[l].kv_h2d_bytes) << "step " << i;
        }
        EXPECT_EQ(ours[l].kv_d2h_bytes, theirs[l].kv_d2h_bytes) << "step " << i << " layer " << l;
        EXPECT_EQ(ours[l].tokens_fetched, theirs[l].tokens_fetched) << "step " << i;
      }
    }
  }
}

// Once the prompt's passes are done, a store whose dense layers' KV stays on the device loads no
// layer whole: its staging shrinks to a speculated layer's rows (n' cap and the new token), and
// decode steps compute in it the same as in a whole staging (DenseLayersKeptOnTheDevice... above
// compares their logits). With the dense layers loaded whole, the staging keeps every row.
TEST_F(InfinigenPolicy, TheStagingShrinksAfterThePromptWhenNoLayerLoadsWhole) {
  const ModelConfig& config = source_.config;
  const int64_t B = 2, n = 12, steps = 4, capacity = n + steps;
  SpeculationOptions speculation;
  speculation.alpha = 1.0;
  speculation.max_num_kv = 5;
  const auto model = make_model(config, load_weights(source_, Device::Cpu), Device::Cpu);
  set_debug_poison(true);  // a row the staging lost would be NaN
  for (int64_t resident : {0, 2}) {
    TransferEngine engine(Device::Cpu, {});
    OffloadStats stats;
    InfinigenKv kv(config, B, capacity, DType::F16, Device::Cpu, 4, engine, stats, speculation,
                   false, {}, nullptr, InfinigenPlacement{resident, 0});
    EXPECT_EQ(kv.staging_rows(), capacity);
    std::vector<int32_t> first_valid;
    const std::vector<int32_t> tokens =
        left_pad(request_.prompts, config.pad_token_id, &first_valid);
    model->prefill(tokens, first_valid, kv, false, /*chunk=*/5);
    EXPECT_EQ(kv.staging_rows(), resident == 2 ? 6 : capacity) << "resident " << resident;
    for (int32_t step = 0; step < steps; ++step) {
      const Tensor logits = model->decode({5 + step, 40 + step}, kv);
      const float* v = logits.data<float>();
      EXPECT_TRUE(std::all_of(v, v + logits.numel(), [](float x) { return std::isfinite(x); }))
          << "resident " << resident << " step " << step;
    }
  }
  set_debug_poison(false);
}

// Partial keys in host memory change nothing a step computes; on the CPU backend they are the
// same memory, and each step counts their bytes as the layer's loads (the link a GPU reads them
// over).
TEST_F(InfinigenPolicy, PartialKeysInHostMemoryCountTheirBytesAndComputeTheSame) {
  SpeculationOptions sparse;
  sparse.alpha = 1.0;
  sparse.max_num_kv = 5;
  OffloadOptions options;
  options.policy = "infinigen";
  options.speculation = sparse;
  options.kv_block_tokens = 4;
  options.dense_kv = KvPlacement::Host;
  options.row_cache = RowCacheUse::Off;  // decided after the partial keys (row_cache_test.cc)
  const OffloadRun device = run_offloaded(source_, request_, options, Device::Cpu);
  ASSERT_EQ(device.plan.partial_key_host_layers, 0);
  options.partial_key_host_layers = 1;
  const OffloadRun host = run_offloaded(source_, request_, options, Device::Cpu);
  ASSERT_EQ(host.plan.partial_key_host_layers, 1);
  EXPECT_EQ(host.result.tokens, device.result.tokens);
  EXPECT_EQ(logit_error(host.result, device.result), 0.0);
  // Left to the planner on a device one byte short of the first plan, they go to host memory
  // (the fewest layers: one), and the run follows the plan.
  options.partial_key_host_layers = -1;
  options.device_memory = device.plan.device_total() - 1;
  const OffloadRun planned = run_offloaded(source_, request_, options, Device::Cpu);
  ASSERT_EQ(planned.plan.partial_key_host_layers, 1);
  for (size_t i = 1; i < host.stats.steps().size(); ++i) {
    EXPECT_EQ(planned.stats.steps()[i].h2d_bytes, host.stats.steps()[i].h2d_bytes) << i;
  }
  const ModelConfig& c = source_.config;  // 4 layers: the last one's partial keys on the host
  const int64_t r = partial_columns(sparse.partial_ratio, c.head_dim());
  for (size_t i = 1; i < host.stats.steps().size(); ++i) {
    const auto& ours = host.stats.steps()[i].layers;
    const auto& theirs = device.stats.steps()[i].layers;
    for (size_t l = 0; l < 3; ++l) EXPECT_EQ(ours[l].kv_h2d_bytes, theirs[l].kv_h2d_bytes);
    // Every stored position's partial key of the layer: B * H_kv * positions * r * 2 bytes.
    const int64_t positions = 12 + static_cast<int64_t>(i) - 1;
    EXPECT_EQ(ours[3].kv_h2d_bytes - theirs[3].kv_h2d_bytes,
              static_cast<uint64_t>(2 * c.kv_heads() * positions * r * 2))
        << "step " << i;
  }
}

TEST_F(InfinigenPolicy, NothingReadsKvThatWasNotTransferred) {
  SpeculationOptions sparse;
  sparse.alpha = 1.0;
  sparse.max_num_kv = 5;
  const auto expected = run("infinigen", sparse).result.tokens;
  set_debug_poison(true);
  EXPECT_EQ(run("infinigen", sparse).result.tokens, expected);
}

TEST_F(InfinigenPolicy, RecallIsMeasuredOnSpeculatedLayers) {
  OffloadOptions options;
  options.policy = "infinigen";
  options.check_recall = true;
  options.speculation = select_everything();
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
  options.policy = "infinigen";
  options.speculation = select_everything();
  options.kv_pool_limit = 17.5 / 18.0;  // floor(0.972 * 18) = 17 positions
  options.kv_block_tokens = 4;
  const OffloadRun capped = run_offloaded(source_, request_, options, Device::Cpu);
  const OffloadRun full = run("full");
  EXPECT_EQ(capped.result.tokens, full.result.tokens);
  // Same rows in the same order: the same arithmetic up to vectorisation (buffer offsets).
  EXPECT_LT(logit_error(capped.result, full.result), 1e-6);
}

TEST_F(InfinigenPolicy, CappedPoolEvictsAndReadsOnlyWhatItHolds) {
  for (EvictionPolicy eviction :
       {EvictionPolicy::Counter, EvictionPolicy::Lru, EvictionPolicy::Fifo}) {
    OffloadOptions options;
    options.policy = "infinigen";
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

TEST_F(InfinigenPolicy, MixedLengthsPoisonedGiveTheSameTokensCappedOrNot) {
  request_.prompts = {{2, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20},
                      {2, 700, 800, 900},
                      {2, 33, 44, 55, 66, 77, 88, 99}};
  request_.gen_len = 8;
  for (double limit : {0.0, 0.5}) {
    OffloadOptions options;
    options.policy = "infinigen";
    options.speculation.alpha = 2.0;
    options.kv_pool_limit = limit;  // 0.5: 9 of 19 positions, below the longest prompt
    options.kv_block_tokens = 4;
    const OffloadRun plain = run_offloaded(source_, request_, options, Device::Cpu);
    set_debug_poison(true);
    const OffloadRun poisoned = run_offloaded(source_, request_, options, Device::Cpu);
    set_debug_poison(false);
    EXPECT_EQ(poisoned.result.tokens, plain.result.tokens) << "limit " << limit;
    EXPECT_LT(logit_error(poisoned.result, plain.result), 1e-6) << "limit " << limit;
  }
}

// After evictions, every speculated layer's partial key cache holds, at each position, the
// partial columns of the key the pool holds there (to the pool's fp16 rounding).
TEST_F(InfinigenPolicy, PartialKeysFollowThePoolThroughEvictions) {
  const ModelConfig& config = source_.config;
  const int64_t B = 2, n = 12, steps = 10, capacity = n + steps, slots = 7;
  for (EvictionPolicy eviction : {EvictionPolicy::Counter, EvictionPolicy::Lru}) {
    TransferEngine engine(Device::Cpu, {});
    OffloadStats stats;
    SpeculationOptions speculation;
    speculation.alpha = 3.0;
    InfinigenKv kv(config, B, capacity, DType::F16, Device::Cpu, 4, engine, stats, speculation,
                   false, KvPoolLimit{slots, eviction});
    const auto model = make_model(config, load_weights(source_, Device::Cpu), Device::Cpu);
    std::vector<int32_t> first_valid;
    const std::vector<int32_t> tokens =
        left_pad(request_.prompts, config.pad_token_id, &first_valid);
    model->prefill(tokens, first_valid, kv);
    for (int32_t step = 0; step < steps; ++step) model->decode({5 + step, 40 + step}, kv);
    engine.synchronize();

    const int64_t H = config.num_heads, d = config.head_dim();
    int64_t compared = 0;
    for (int64_t l = 2; l < config.num_layers; ++l) {
      const PartialLayer& partial = kv.partial(l);
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t h = 0; h < H; ++h) {
          for (int64_t p = 0; p < slots; ++p) {
            if (kv.token_at(l, b, h, p) < first_valid[b]) continue;
            std::vector<float> key(static_cast<size_t>(d));
            convert_to_f32(kv.pool().row(l, KvKind::Key, b, h, p), DType::F16, key.data(),
                           key.size());
            const std::vector<float> stored = partial.partial_key(b, h, p);
            for (int64_t j = 0; j < partial.r(); ++j) {
              const float expected = key[partial.columns()[h * partial.r() + j]];
              EXPECT_NEAR(stored[j], expected, 1e-3f * (1.0f + std::fabs(expected)))
                  << eviction_policy_name(eviction) << " layer " << l << " (" << b << ", " << h
                  << ") position " << p;
              ++compared;
            }
          }
        }
      }
    }
    // Every position of every speculated layer's pool was compared (the pools are full).
    EXPECT_EQ(compared, 2 * B * H * slots * partial_columns(0.3, d));
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
      return testing_util::cli_message(e);
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
  EXPECT_EQ(message(SpeculationOptions{}), "");
}

}  // namespace
}  // namespace infinigen
