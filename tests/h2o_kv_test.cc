// tests: the `h2o` baseline: with the whole budget it gives the engine's logits; with 20% every row
// keeps exactly its slots, the recent window stays and evicted tokens never return; the victim
// choice on hand-built scores; the bytes each step loads and stores; no read of unloaded KV (NaN
// mode); and the same logits from run to run and under an emulated link.
#include "offload/h2o_kv.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <iostream>
#include <memory>
#include <set>
#include <vector>

#include "core/generation.h"
#include "core/model_loader.h"
#include "tests/test_util.h"

namespace infinigen {
namespace {

// Records, after every pass, the tokens each (layer, sequence, head) keeps.
class RecordingH2oKv : public H2oKv {
 public:
  using H2oKv::H2oKv;
  void end_pass(int64_t n_new) override {
    H2oKv::end_pass(n_new);
    std::vector<std::vector<int32_t>> rows;
    for (int64_t l = 0; l < num_layers; ++l) {
      for (int64_t b = 0; b < batch(); ++b) {
        for (int64_t h = 0; h < num_heads; ++h) rows.push_back(kept_tokens(l, b, h));
      }
    }
    history.push_back(std::move(rows));
    lengths.push_back(length());
  }
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  std::vector<std::vector<std::vector<int32_t>>> history;  // per pass, per row: kept tokens
  std::vector<int64_t> lengths;                            // length() after each pass
};

class H2o : public testing_util::OptTinyTest {
 protected:
  void SetUp() override {
    OptTinyTest::SetUp();
    request_.prompts = {{2, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20},
                        {2,    500,  600,  700,  800,  900,  1000, 1100, 1200, 1300,
                         1400, 1500, 1600, 1700, 1800, 1900, 2000, 40,   41,   42},
                        {2, 7, 8}};
    request_.gen_len = 20;
    request_.kv_dtype = DType::F32;
  }

  GenerationResult run(const KvStoreFactory& factory = {}) {
    const auto model = make_model(source_.config, load_weights(source_, Device::Cpu), Device::Cpu);
    return generate(*model, request_, {}, factory);
  }

  // Runs with an H2oKv of `budget` moving its KV through `engine` (engine_ by default); `store`
  // receives the store (alive until the fixture ends).
  GenerationResult run_h2o(double budget, RecordingH2oKv** store = nullptr,
                           TransferEngine* engine = nullptr) {
    TransferEngine& transfers = engine ? *engine : engine_;
    return run([&](int64_t batch, int64_t capacity) -> std::unique_ptr<KvStore> {
      auto kv = std::make_unique<RecordingH2oKv>(source_.config, batch, capacity, request_.kv_dtype,
                                                 Device::Cpu, budget, transfers, stats_);
      kv->num_layers = source_.config.num_layers;
      kv->num_heads = source_.config.num_heads;
      if (store) *store = kv.get();
      stores_.push_back(std::move(kv));
      return std::make_unique<Forwarding>(*stores_.back());
    });
  }

  // Lets the test keep the store after generate() is done with it.
  class Forwarding : public KvStore {
   public:
    explicit Forwarding(KvStore& inner) : KvStore(inner.batch(), inner.capacity()), inner_(inner) {}
    void observe(int64_t layer, const AttentionInput& input) override {
      inner_.observe(layer, input);
    }
    void start_pass(int64_t n_new) override {
      inner_.set_first_valid(first_valid());
      KvStore::start_pass(n_new);
      inner_.begin_pass(n_new);
    }
    void start_layer(int64_t layer) override { inner_.begin_layer(layer); }
    void append(int64_t layer, const Tensor& keys, const Tensor& values) override {
      inner_.append(layer, keys, values);
    }
    View view(int64_t layer) override { return inner_.view(layer); }
    void end_pass(int64_t n_new) override {
      KvStore::end_pass(n_new);
      inner_.end_pass(n_new);
    }

   private:
    KvStore& inner_;
  };

  TransferEngine engine_{Device::Cpu, {}};
  // A slow link with a long latency: loads and stores finish well after the compute that follows
  // them, so an ordering that only holds at memory speed breaks here.
  TransferEngine slow_engine_{Device::Cpu, {0.05, 300.0}};
  OffloadStats stats_;
  std::vector<std::unique_ptr<RecordingH2oKv>> stores_;
};

TEST(H2oVictim, LowestScoreOutsideTheRecentWindowTiesToTheOldest) {
  // Tokens out of row order, as the compact cache keeps them after moves.
  const std::vector<int32_t> tokens = {7, 3, 12, 5, 9, 10};
  // Token 12 has the lowest score but is recent (window from 10).
  EXPECT_EQ(h2o_choose_victim(std::vector<float>{0.5f, 0.4f, 0.1f, 0.3f, 0.2f, 0.05f}, tokens, 10),
            4);
  // Ties: tokens 7, 3 and 5 share the lowest score; the oldest (3) goes.
  EXPECT_EQ(h2o_choose_victim(std::vector<float>{0.2f, 0.2f, 0.9f, 0.2f, 0.6f, 0.0f}, tokens, 10),
            1);
  // Everything recent: nothing to evict.
  EXPECT_EQ(h2o_choose_victim(std::vector<float>{0.1f, 0.2f}, std::vector<int32_t>{4, 5}, 4), -1);
  // One candidate.
  EXPECT_EQ(h2o_choose_victim(std::vector<float>{9.0f, 0.0f}, std::vector<int32_t>{1, 5}, 4), 0);
}

TEST_F(H2o, WholeBudgetGivesTheEngineTokensAndLogits) {
  for (DType kv : {DType::F32, DType::F16}) {
    request_.kv_dtype = kv;
    const GenerationResult expected = run();
    RecordingH2oKv* store = nullptr;
    const GenerationResult got = run_h2o(1.0, &store);
    EXPECT_EQ(got.tokens, expected.tokens) << dtype_name(kv);
    const std::vector<float> a = got.last_logits.to_floats(), b = expected.last_logits.to_floats();
    const double error = testing_util::relative_error(a.data(), b.data(), a.size());
    EXPECT_LT(error, 1e-5) << dtype_name(kv);
    std::cout << "[ h2o 1.0 ] " << dtype_name(kv) << " last-logits relative error " << error
              << "\n";
    // Nothing evicted: every row holds all its valid tokens.
    const int64_t prompt = got.prompt_len, total = prompt + got.gen_len - 1;
    ASSERT_NE(store, nullptr);
    for (int64_t s = 0; s < got.batch; ++s) {
      EXPECT_EQ(store->kept(s), total - store->first_valid()[static_cast<size_t>(s)]);
    }
  }
}

TEST_F(H2o, FifthBudgetKeepsSlotsAndRecentAndNeverRevives) {
  RecordingH2oKv* store = nullptr;
  const GenerationResult got = run_h2o(0.2, &store);
  ASSERT_NE(store, nullptr);
  const int64_t capacity = got.prompt_len + got.gen_len;
  const int64_t slots = store->slots(), recent = store->recent();
  EXPECT_EQ(slots, std::max<int64_t>(2, capacity / 5));
  EXPECT_EQ(recent, slots / 2);
  ASSERT_GT(slots, 2);
  const int64_t L = source_.config.num_layers, H = source_.config.num_heads, B = got.batch;
  const auto& history = store->history;
  ASSERT_EQ(history.size(), static_cast<size_t>(got.gen_len));  // prefill + gen_len - 1 decodes
  std::vector<std::set<int32_t>> evicted(static_cast<size_t>(L * B * H));
  for (size_t pass = 0; pass < history.size(); ++pass) {
    const int64_t length = store->lengths[pass];
    for (int64_t l = 0; l < L; ++l) {
      for (int64_t b = 0; b < B; ++b) {
        const int32_t start = store->first_valid()[static_cast<size_t>(b)];
        const int64_t seen = length - start;
        for (int64_t h = 0; h < H; ++h) {
          const size_t row = static_cast<size_t>((l * B + b) * H + h);
          std::vector<int32_t> kept = history[pass][row];
          std::sort(kept.begin(), kept.end());
          ASSERT_EQ(std::adjacent_find(kept.begin(), kept.end()), kept.end()) << "duplicate";
          EXPECT_EQ(static_cast<int64_t>(kept.size()), std::min(seen, slots))
              << "pass " << pass << " row " << row;
          // Never padding, never past the stored tokens.
          EXPECT_GE(kept.front(), start);
          EXPECT_LT(kept.back(), length);
          // The recent window (the last `recent` valid tokens) is kept.
          for (int64_t t = std::max<int64_t>(start, length - recent); t < length; ++t) {
            EXPECT_TRUE(std::binary_search(kept.begin(), kept.end(), static_cast<int32_t>(t)))
                << "recent token " << t << " dropped at pass " << pass;
          }
          for (int32_t t : kept) EXPECT_EQ(evicted[row].count(t), 0u) << "token " << t << " back";
          if (pass > 0) {
            std::vector<int32_t> before = history[pass - 1][row];
            std::sort(before.begin(), before.end());
            for (int32_t t : before) {
              if (!std::binary_search(kept.begin(), kept.end(), t)) evicted[row].insert(t);
            }
          }
        }
      }
    }
  }
  // Something was evicted, and the stats report the budget.
  size_t total_evicted = 0;
  for (const auto& row : evicted) total_evicted += row.size();
  EXPECT_GT(total_evicted, 0u);
  // Every row is full at the last step: each layer loads all its slots, everything the pool holds.
  const uint64_t row_bytes = static_cast<uint64_t>(source_.config.head_dim()) * 4;  // fp32 KV
  const StepStats& last = stats_.steps().back();
  for (const LayerTraffic& layer : last.layers) {
    EXPECT_EQ(layer.tokens_fetched, static_cast<uint64_t>(B * H * slots));
    EXPECT_EQ(layer.tokens_stored, layer.tokens_fetched);
    EXPECT_EQ(layer.kv_h2d_bytes, 2 * layer.tokens_fetched * row_bytes);
    EXPECT_EQ(layer.kv_d2h_bytes, static_cast<uint64_t>(2 * B * H) * row_bytes);
  }
}

TEST_F(H2o, BytesPerStepAndLayerAreTheKeptRows) {
  request_.kv_dtype = DType::F16;
  RecordingH2oKv* store = nullptr;
  const GenerationResult got = run_h2o(0.2, &store);
  ASSERT_NE(store, nullptr);
  engine_.synchronize();
  const uint64_t L = source_.config.num_layers, H = source_.config.num_heads;
  const uint64_t B = static_cast<uint64_t>(got.batch);
  const uint64_t row_bytes = static_cast<uint64_t>(source_.config.head_dim()) * 2;  // fp16
  const int64_t slots = store->slots();
  // Entries the pool holds per (layer, head) summed over the sequences, after `stored` tokens.
  const auto kept_rows = [&](int64_t stored) {
    uint64_t rows = 0;
    for (int32_t start : store->first_valid()) {
      rows += static_cast<uint64_t>(std::min<int64_t>(stored - start, slots));
    }
    return rows;
  };
  const auto& steps = stats_.steps();
  ASSERT_EQ(steps.size(), static_cast<size_t>(got.gen_len));
  uint64_t h2d = 0, d2h = 0;
  for (size_t i = 0; i < steps.size(); ++i) {
    const bool prefill = i == 0;
    // Rows each layer loads: the pool before the step (none in the prefill).
    const uint64_t loaded = prefill ? 0 : kept_rows(got.prompt_len + static_cast<int64_t>(i) - 1);
    // Rows each layer stores: the prefill's kept rows, then one new row per (sequence, head).
    const uint64_t stored_rows = prefill ? kept_rows(got.prompt_len) * H : B * H;
    EXPECT_EQ(steps[i].h2d_bytes, 2 * L * loaded * H * row_bytes) << "step " << i;
    EXPECT_EQ(steps[i].d2h_bytes, 2 * L * stored_rows * row_bytes) << "step " << i;
    ASSERT_EQ(steps[i].layers.size(), L);
    for (const LayerTraffic& layer : steps[i].layers) {
      EXPECT_EQ(layer.kv_h2d_bytes, 2 * loaded * H * row_bytes) << "step " << i;
      EXPECT_EQ(layer.kv_d2h_bytes, 2 * stored_rows * row_bytes) << "step " << i;
      EXPECT_EQ(layer.tokens_fetched, loaded * H) << "step " << i;
      EXPECT_EQ(layer.tokens_stored, prefill ? stored_rows : loaded * H) << "step " << i;
    }
    h2d += steps[i].h2d_bytes;
    d2h += steps[i].d2h_bytes;
  }
  // The decode steps load less than the whole KV once the budget is full.
  EXPECT_LT(steps.back().h2d_bytes,
            2 * L * B * H * row_bytes * static_cast<uint64_t>(got.prompt_len + got.gen_len - 2));
  // What the statistics count is what the transfer engine moved.
  const TransferCounters moved = engine_.counters();
  EXPECT_EQ(moved.h2d_bytes, h2d);
  EXPECT_EQ(moved.d2h_bytes, d2h);
}

TEST_F(H2o, DebugPoisonGivesTheSameLogits) {
  // Staging rows the loads do not bring are NaN in this mode: any read of one would change the
  // logits (or make them NaN).
  request_.kv_dtype = DType::F16;
  const GenerationResult plain = run_h2o(0.2);
  set_debug_poison(true);
  const GenerationResult poisoned = run_h2o(0.2);
  EXPECT_EQ(poisoned.tokens, plain.tokens);
  EXPECT_EQ(poisoned.last_logits.to_floats(), plain.last_logits.to_floats());
}

TEST_F(H2o, RepeatedRunsAreIdentical) {
  // Loads, stores and compute overlap on three threads; a missing ordering between them (a
  // staging row rewritten before its store read it, a victim's row stored over before its load)
  // shows up as run-to-run differences.
  request_.kv_dtype = DType::F16;
  request_.gen_len = 10;
  const std::vector<float> first = run_h2o(0.2).last_logits.to_floats();
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(run_h2o(0.2).last_logits.to_floats(), first) << "run " << i;
  }
}

TEST_F(H2o, EmulatedLinkGivesTheSameResults) {
  request_.kv_dtype = DType::F16;
  request_.gen_len = 12;
  const GenerationResult fast = run_h2o(0.2);
  const GenerationResult slow = run_h2o(0.2, nullptr, &slow_engine_);
  EXPECT_EQ(slow.tokens, fast.tokens);
  EXPECT_EQ(slow.last_logits.to_floats(), fast.last_logits.to_floats());
  EXPECT_GT(slow_engine_.counters().h2d_transfers, 0u);
}

TEST_F(H2o, DebugPoisonRunsCompleteWithoutNaN) {
  set_debug_poison(true);
  for (DType kv : {DType::F16, DType::F32}) {
    request_.kv_dtype = kv;
    for (double budget : {0.2, 1.0}) {
      const GenerationResult got = run_h2o(budget);
      for (float x : got.last_logits.to_floats()) {
        ASSERT_TRUE(std::isfinite(x)) << dtype_name(kv) << " budget " << budget;
      }
    }
  }
}

}  // namespace
}  // namespace infinigen
