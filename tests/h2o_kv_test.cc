// tests: the `h2o` baseline: with the whole budget it gives the engine's logits; with 20% every row
// keeps exactly its slots, the recent window stays and evicted tokens never return; the victim
// choice on hand-built scores; the bytes each step loads and stores; no read of unloaded KV (NaN
// mode); and the same logits from run to run and under an emulated link. On a CUDA device (label
// gpu, H2oGpu.*): the device's scores, keep choice, victims and stores against the CPU's.
#include "offload/h2o_kv.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <iostream>
#include <memory>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "core/generation.h"
#include "core/model_loader.h"
#include "core/ops.h"
#include "core/stream.h"
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

// ---- on the device ----

// Normal(0, scale) values of `shape` (fp32, CPU).
Tensor normal(const Shape& shape, std::mt19937_64& rng, float scale) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> values(static_cast<size_t>(shape_numel(shape)));
  for (float& x : values) x = dist(rng);
  return Tensor::from_floats(shape, values);
}

// What one layer's observe and append receive in a pass: queries (B * n, H * d), keys and values
// (B * n, H_kv * d), fp32.
struct LayerInput {
  Tensor q, k, v;
};

// The inputs of a prefill of n tokens and then `steps` decode steps, random normal except in
// sequence 0, which is built to tie: its keys are zero but that of its first valid token (e_0),
// and its queries are 200 e_0. Every other key of it gets probability exactly 0 (exp(-200)
// underflows), so their scores tie at 0 for good, and the choices fall to the token index (the
// prefill keeps the newer, decode evicts the oldest outside the recent window).
std::vector<std::vector<LayerInput>> make_inputs(const ModelConfig& c, int64_t B, int64_t n,
                                                 int64_t steps, int32_t sink, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const int64_t H = c.num_heads, H_kv = c.kv_heads(), d = c.head_dim();
  std::vector<std::vector<LayerInput>> passes;
  for (int64_t pass = 0; pass <= steps; ++pass) {
    const int64_t rows = pass == 0 ? n : 1;
    std::vector<LayerInput> layers;
    for (int64_t l = 0; l < c.num_layers; ++l) {
      LayerInput in{normal({B * rows, H * d}, rng, 0.5f), normal({B * rows, H_kv * d}, rng, 1.0f),
                    normal({B * rows, H_kv * d}, rng, 1.0f)};
      float* q = in.q.data<float>();
      float* k = in.k.data<float>();
      for (int64_t i = 0; i < rows; ++i) {  // sequence 0's rows are its first `rows`
        const int64_t t = pass == 0 ? i : n + pass - 1;
        std::fill(q + i * H * d, q + (i + 1) * H * d, 0.0f);
        std::fill(k + i * H_kv * d, k + (i + 1) * H_kv * d, 0.0f);
        for (int64_t h = 0; h < H; ++h) q[(i * H + h) * d] = 200.0f;
        if (t == sink) {
          for (int64_t h = 0; h < H_kv; ++h) k[(i * H_kv + h) * d] = 1.0f;
        }
      }
      layers.push_back(std::move(in));
    }
    passes.push_back(std::move(layers));
  }
  return passes;
}

// A layer's staged keys and values as attention reads them in a decode step (the rows the load
// brought and the new one), per (b, h): rows [first_valid[b], slots + 1) of each, as floats.
std::vector<std::vector<float>> staged_rows(const KvStore::View& view, int64_t B, int64_t H,
                                            int64_t d) {
  std::vector<std::vector<float>> out;
  for (const Tensor* staging : {view.keys, view.values}) {
    const std::vector<float> all = staging->to(Device::Cpu).to_floats();
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < H; ++h) {
        const int64_t first = (*view.first_valid)[static_cast<size_t>(b)];
        const auto begin = static_cast<size_t>(((b * H + h) * view.length + first) * d);
        const auto end = static_cast<size_t>(((b * H + h) * view.length + view.length) * d);
        out.emplace_back(all.begin() + static_cast<std::ptrdiff_t>(begin),
                         all.begin() + static_cast<std::ptrdiff_t>(end));
      }
    }
  }
  return out;
}

// What a run of an H2oKv showed after each pass: per (layer, b, h) the kept tokens and their
// scores, and in decode steps per layer what attention read.
struct Observed {
  std::vector<std::vector<std::vector<int32_t>>> tokens;  // [pass][(l, b, h)]
  std::vector<std::vector<std::vector<float>>> scores;
  std::vector<std::vector<std::vector<std::vector<float>>>> staged;  // [pass][layer][(K/V, b, h)]
};

// Drives `kv` through the passes as the model would (begin_pass, per layer begin_layer, observe,
// append and, in decode, view; end_pass), with the inputs copied to `device`. On CUDA the caller
// makes the engine's compute stream current.
Observed drive(H2oKv& kv, TransferEngine& engine, const ModelConfig& c,
               const std::vector<int32_t>& first_valid,
               const std::vector<std::vector<LayerInput>>& passes, Device device) {
  const int64_t B = kv.batch(), H_kv = c.kv_heads(), d = c.head_dim(), L = c.num_layers;
  Observed seen;
  kv.set_first_valid(first_valid);
  const Tensor none;
  const std::vector<int32_t> positions;
  for (const std::vector<LayerInput>& layers : passes) {
    const int64_t n = layers.front().q.dim(0) / B;
    const bool decode = kv.length() > 0;
    kv.begin_pass(n);
    std::vector<std::vector<std::vector<float>>> staged;
    for (int64_t l = 0; l < L; ++l) {
      const LayerInput& in = layers[static_cast<size_t>(l)];
      const Tensor q = in.q.to(device), k = in.k.to(device), v = in.v.to(device);
      kv.begin_layer(l);
      kv.observe(l, {none, q, none, none, none, positions, none});
      kv.append(l, k, v);
      if (decode) {
        const KvStore::View view = kv.view(l);
        engine.compute_stream().synchronize();  // the view is read on the compute stream's terms
        staged.push_back(staged_rows(view, B, H_kv, d));
      }
    }
    kv.end_pass(n);
    std::vector<std::vector<int32_t>> tokens;
    std::vector<std::vector<float>> scores;
    for (int64_t l = 0; l < L; ++l) {
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t h = 0; h < H_kv; ++h) {
          tokens.push_back(kv.kept_tokens(l, b, h));
          scores.push_back(kv.kept_scores(l, b, h));
        }
      }
    }
    seen.tokens.push_back(std::move(tokens));
    seen.scores.push_back(std::move(scores));
    seen.staged.push_back(std::move(staged));
  }
  engine.synchronize();
  return seen;
}

// The device's scores are the CPU's up to fp32 rounding in another order (kernels/cuda/h2o.h):
// within 1e-5 relative, with a floor of 1e-5 for the small ones.
constexpr double kScoreTolerance = 1e-5;

void expect_same_scores(const std::vector<float>& cuda, const std::vector<float>& cpu,
                        const std::string& what) {
  ASSERT_EQ(cuda.size(), cpu.size()) << what;
  for (size_t i = 0; i < cpu.size(); ++i) {
    ASSERT_NEAR(cuda[i], cpu[i], kScoreTolerance * std::max(1.0f, std::abs(cpu[i])))
        << what << ", entry " << i;
  }
}

// The CUDA store keeps and stores what the CPU's does, with the same scores up to rounding: the
// opt-tiny (H = H_kv = 4) and llama-tiny (4 query heads over 2 KV heads) shapes, the three KV
// dtypes, sequences with padding whose prompts do not fit (the prefill's choice), fit (decode
// steps fill the rows, then evict), and tie (sequence 0: exact ties, probabilities that are 0 on
// both), over enough steps that every row evicts. The random sequences' choices have no near-tie
// (scores within the rounding of each other at the boundary) for this seed; the kept sets are
// compared exactly.
TEST(H2oGpu, DeviceScoresKeepsAndStoresWhatTheCpuDoes) {
  INFINIGEN_SKIP_WITHOUT_CUDA_DEVICE();
  const int64_t B = 3, n = 12, steps = 10;
  const std::vector<int32_t> first_valid = {2, 0, 9};  // 10, 12 and 3 prompt tokens
  for (const char* model : {"opt-tiny", "llama-tiny"}) {
    const ModelConfig config = load_preset(model);
    const auto inputs = make_inputs(config, B, n, steps, first_valid[0], 7);
    for (DType kv_dtype : {DType::F16, DType::F32, DType::BF16}) {
      const std::string what = cat(model, " ", dtype_name(kv_dtype));
      const double budget = 0.3;  // 6 slots of 23 positions, 3 of them recent
      OffloadStats cpu_stats, cuda_stats;
      TransferEngine cpu_engine(Device::Cpu, {});
      Observed cpu, cuda;
      {
        H2oKv store(config, B, n + steps + 1, kv_dtype, Device::Cpu, budget, cpu_engine, cpu_stats);
        ASSERT_EQ(store.slots(), 6);
        cpu = drive(store, cpu_engine, config, first_valid, inputs, Device::Cpu);
      }
      TransferEngine cuda_engine(Device::Cuda, {});
      {
        CudaStreamScope scope(cuda_engine.compute_stream().cuda_handle());
        H2oKv store(config, B, n + steps + 1, kv_dtype, Device::Cuda, budget, cuda_engine,
                    cuda_stats);
        cuda = drive(store, cuda_engine, config, first_valid, inputs, Device::Cuda);
      }
      ASSERT_EQ(cuda.tokens.size(), cpu.tokens.size());
      for (size_t pass = 0; pass < cpu.tokens.size(); ++pass) {
        const std::string at = cat(what, ", pass ", pass);
        ASSERT_EQ(cuda.tokens[pass], cpu.tokens[pass]) << at;
        for (size_t row = 0; row < cpu.scores[pass].size(); ++row) {
          expect_same_scores(cuda.scores[pass][row], cpu.scores[pass][row], cat(at, ", row ", row));
        }
        // The rows loaded from the pool (stored there by the previous steps) and the new one.
        ASSERT_EQ(cuda.staged[pass].size(), cpu.staged[pass].size()) << at;
        for (size_t l = 0; l < cpu.staged[pass].size(); ++l) {
          EXPECT_EQ(cuda.staged[pass][l], cpu.staged[pass][l]) << at << ", layer " << l;
        }
      }
      // Every row evicted something (sequence 2 after its rows filled), and the ties chose by
      // token: sequence 0 keeps its sink and the newest tokens.
      const std::vector<int32_t>& last = cpu.tokens.back()[0];
      std::vector<int32_t> sorted = last;
      std::sort(sorted.begin(), sorted.end());
      const int32_t length = static_cast<int32_t>(n + steps);
      EXPECT_EQ(sorted, (std::vector<int32_t>{first_valid[0], length - 5, length - 4, length - 3,
                                              length - 2, length - 1}))
          << what;
      // The same bytes moved.
      EXPECT_EQ(cuda_engine.counters().h2d_bytes, cpu_engine.counters().h2d_bytes) << what;
      EXPECT_EQ(cuda_engine.counters().d2h_bytes, cpu_engine.counters().d2h_bytes) << what;
    }
  }
}

// One layer's prefill on the device (ops::h2o_prefill) against a double-precision reference: every
// valid key's score (the scratch key_scores) within kScoreTolerance, and the kept rows (tokens,
// scores, K and V) where the reference's choice has no near-tie. Several 64-token tiles with a
// partial last one, left padding (none, some, all but one token), grouped query heads, head
// dimensions that are not a multiple of the kernels' 32-dim chunks, and the three KV dtypes.
TEST(H2oGpu, PrefillScoresEveryKeyAndKeepsTheHeaviest) {
  INFINIGEN_SKIP_WITHOUT_CUDA_DEVICE();
  struct Shape {
    int64_t H, H_kv, d;
    DType kv;
  };
  const int64_t B = 3, n = 150, slots = 40, recent = 10, rows = slots + 1;
  const std::vector<int32_t> first_valid = {0, 37, n - 1};
  for (const Shape& shape :
       {Shape{4, 2, 80, DType::F16}, Shape{2, 2, 128, DType::BF16}, Shape{3, 1, 16, DType::F32}}) {
    const int64_t H = shape.H, H_kv = shape.H_kv, d = shape.d, group = H / H_kv;
    const std::string what = cat("H ", H, ", H_kv ", H_kv, ", d ", d, ", ", dtype_name(shape.kv));
    std::mt19937_64 rng(static_cast<uint64_t>(5 + d));
    const Tensor q = normal({B * n, H * d}, rng, 1.5f / std::sqrt(static_cast<float>(d)));
    const Tensor k = normal({B * n, H_kv * d}, rng, 1.0f);
    const Tensor v = normal({B * n, H_kv * d}, rng, 1.0f);
    Tensor keys_out = Tensor::zeros({B, H_kv, rows, d}, shape.kv, Device::Cuda);
    Tensor values_out = Tensor::zeros({B, H_kv, rows, d}, shape.kv, Device::Cuda);
    Tensor scores = Tensor::zeros({B, H_kv, rows}, DType::F32, Device::Cuda);
    Tensor tokens = Tensor::zeros({B, H_kv, rows}, DType::I32, Device::Cuda);
    Tensor row_stats = Tensor::zeros({2, B, H, n}, DType::F32, Device::Cuda);
    Tensor key_scores = Tensor::zeros({B, H_kv, n}, DType::F32, Device::Cuda);
    Tensor kept = Tensor::zeros({B, H_kv, n}, DType::I32, Device::Cuda);
    ops::h2o_prefill(q.to(Device::Cuda), k.to(Device::Cuda), v.to(Device::Cuda), keys_out,
                     values_out, scores, tokens, row_stats, key_scores, kept, first_valid, slots,
                     recent);
    const std::vector<float> got = key_scores.to_floats();
    const std::vector<float> got_scores = scores.to_floats();
    const std::vector<float> got_keys = keys_out.to_floats(), got_values = values_out.to_floats();
    const Tensor got_tokens = tokens.to(Device::Cpu);
    // The keys and values as the KV dtype stores them.
    const std::vector<float> qs = q.to_floats();
    const std::vector<float> ks = k.to_dtype(shape.kv).to_floats();
    const std::vector<float> vs = v.to_dtype(shape.kv).to_floats();
    for (int64_t b = 0; b < B; ++b) {
      const int64_t start = first_valid[static_cast<size_t>(b)], valid = n - start;
      for (int64_t h = 0; h < H_kv; ++h) {
        const std::string at = cat(what, " (", b, ", ", h, ")");
        const auto key = [&](int64_t t) { return ks.data() + (b * n + t) * H_kv * d + h * d; };
        std::vector<double> want(static_cast<size_t>(valid), 0.0);
        for (int64_t head = h * group; head < (h + 1) * group; ++head) {
          for (int64_t i = start; i < n; ++i) {
            const float* query = qs.data() + (b * n + i) * H * d + head * d;
            std::vector<double> p(static_cast<size_t>(i + 1 - start));
            for (int64_t t = start; t <= i; ++t) {
              double logit = 0.0;
              for (int64_t e = 0; e < d; ++e) logit += double{query[e]} * double{key(t)[e]};
              p[static_cast<size_t>(t - start)] = logit;
            }
            const double top = *std::max_element(p.begin(), p.end());
            double sum = 0.0;
            for (double& x : p) sum += (x = std::exp(x - top));
            for (size_t j = 0; j < p.size(); ++j) want[j] += p[j] / sum;
          }
        }
        for (int64_t j = 0; j < valid; ++j) {
          const double w = want[static_cast<size_t>(j)];
          ASSERT_NEAR(got[static_cast<size_t>((b * H_kv + h) * n + start + j)], w,
                      kScoreTolerance * std::max(1.0, w))
              << at << ", token " << start + j;
        }
        // The reference's choice: all valid tokens, or the recent ones and the heaviest older.
        std::vector<int64_t> keep(static_cast<size_t>(std::min(valid, slots)));
        std::iota(keep.begin(), keep.end(), valid - static_cast<int64_t>(keep.size()));
        if (valid > slots) {
          std::vector<int64_t> order(static_cast<size_t>(valid - recent));
          std::iota(order.begin(), order.end(), int64_t{0});
          std::sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
            return want[static_cast<size_t>(x)] > want[static_cast<size_t>(y)];
          });
          const double last = want[static_cast<size_t>(order[slots - recent - 1])];
          const double next = want[static_cast<size_t>(order[slots - recent])];
          ASSERT_GT(last - next, 10 * kScoreTolerance * std::max(1.0, last))
              << at << ": the inputs have a near-tie at the boundary; choose others";
          keep.assign(order.begin(), order.begin() + (slots - recent));
          for (int64_t j = valid - recent; j < valid; ++j) keep.push_back(j);
          std::sort(keep.begin(), keep.end());
        }
        const int64_t row0 = slots - static_cast<int64_t>(keep.size());
        for (size_t r = 0; r < keep.size(); ++r) {
          const int64_t row = (b * H_kv + h) * rows + row0 + static_cast<int64_t>(r);
          const int64_t t = start + keep[r];
          ASSERT_EQ(got_tokens.data<int32_t>()[row], t) << at << ", row " << row0 + r;
          EXPECT_NEAR(got_scores[static_cast<size_t>(row)], want[static_cast<size_t>(keep[r])],
                      kScoreTolerance * std::max(1.0, want[static_cast<size_t>(keep[r])]))
              << at;
          for (int64_t e = 0; e < d; ++e) {
            const auto from = static_cast<size_t>((b * n + t) * H_kv * d + h * d + e);
            ASSERT_EQ(got_keys[static_cast<size_t>(row * d + e)], ks[from]) << at;
            ASSERT_EQ(got_values[static_cast<size_t>(row * d + e)], vs[from]) << at;
          }
        }
      }
    }
  }
}

// The device's victim is h2o_choose_victim's on hand-built scores with many ties, rows spread
// over every lane of the choosing warp, tokens out of row order and recent windows of every width;
// a sequence with room takes the row before its first. Zero queries and keys make every
// probability 1 / rows, so the scores the choice sees are known exactly.
TEST(H2oGpu, DeviceVictimIsTheCpuChoiceAmongTies) {
  INFINIGEN_SKIP_WITHOUT_CUDA_DEVICE();
  const int64_t B = 3, H = 4, H_kv = 2, d = 8, rows = 70;
  std::mt19937_64 rng(11);
  const Tensor queries = Tensor::zeros({B, H * d}, DType::F32, Device::Cuda);
  const Tensor keys = Tensor::zeros({B, H_kv, rows, d}, DType::F16, Device::Cuda);
  Tensor probs = Tensor::zeros({B, H_kv, rows}, DType::F32, Device::Cuda);
  Tensor placed = Tensor::zeros({B, H_kv}, DType::I32, Device::Cuda);
  const std::vector<int32_t> first_row = {0, 9, 0};  // sequence 1 has room
  for (int trial = 0; trial < 12; ++trial) {
    std::vector<float> scores(static_cast<size_t>(B * H_kv * rows));
    std::vector<int32_t> tokens(scores.size());
    std::uniform_int_distribution<int> level(0, 3);
    for (float& s : scores) s = 0.25f * static_cast<float>(level(rng));
    const int32_t token = 100;  // the new one, in row rows - 1
    for (int64_t i = 0; i < B * H_kv; ++i) {
      std::vector<int32_t> order(static_cast<size_t>(token));
      std::iota(order.begin(), order.end(), 0);
      std::shuffle(order.begin(), order.end(), rng);
      std::copy_n(order.begin(), rows, tokens.begin() + i * rows);
    }
    const auto recent_start = static_cast<int32_t>(40 + 5 * trial);
    Tensor scores_d = Tensor::from_floats({B, H_kv, rows}, scores).to(Device::Cuda);
    Tensor tokens_d = Tensor::empty({B, H_kv, rows}, DType::I32);
    std::copy(tokens.begin(), tokens.end(), tokens_d.data<int32_t>());
    tokens_d = tokens_d.to(Device::Cuda);
    ops::h2o_decode(queries, keys, scores_d, tokens_d, probs, placed, first_row, token,
                    recent_start);
    const std::vector<float> got_scores = scores_d.to_floats();
    const Tensor got_tokens = tokens_d.to(Device::Cpu), got_placed = placed.to(Device::Cpu);
    for (int64_t b = 0; b < B; ++b) {
      const int64_t row0 = first_row[static_cast<size_t>(b)];
      const float p = 1.0f / static_cast<float>(rows - row0);
      for (int64_t h = 0; h < H_kv; ++h) {
        const int64_t base = (b * H_kv + h) * rows;
        // The rows scored: the kept ones and the new one (score 0, token `token`), each head of
        // the group adding p.
        std::vector<float> want(static_cast<size_t>(rows), 0.0f);
        std::vector<int32_t> want_tokens(static_cast<size_t>(rows), -1);
        for (int64_t r = row0; r < rows; ++r) {
          const bool fresh = r == rows - 1;
          want[static_cast<size_t>(r)] = fresh ? 0.0f : scores[static_cast<size_t>(base + r)];
          want_tokens[static_cast<size_t>(r)] =
              fresh ? token : tokens[static_cast<size_t>(base + r)];
          for (int64_t g = 0; g < H / H_kv; ++g) want[static_cast<size_t>(r)] += p;
        }
        int64_t to = row0 - 1;
        if (row0 == 0) {
          to = h2o_choose_victim(want, want_tokens, recent_start);
          ASSERT_GE(to, 0);
        }
        want[static_cast<size_t>(to)] = want.back();
        want_tokens[static_cast<size_t>(to)] = token;
        const std::string at = cat("trial ", trial, " (", b, ", ", h, ")");
        EXPECT_EQ(got_placed.data<int32_t>()[b * H_kv + h], to) << at;
        for (int64_t r = std::min(to, row0); r < rows; ++r) {
          EXPECT_EQ(got_scores[static_cast<size_t>(base + r)], want[static_cast<size_t>(r)])
              << at << " row " << r;
          EXPECT_EQ(got_tokens.data<int32_t>()[base + r], want_tokens[static_cast<size_t>(r)])
              << at << " row " << r;
        }
      }
    }
  }
}

}  // namespace
}  // namespace infinigen
