// tests: the offloading runtime against the non-offloaded engine: same tokens for every policy and
// weight placement, bytes moved equal to the formulas, and no read of untransferred KV (NaN mode).
#include <gtest/gtest.h>

#include "core/generation.h"
#include "core/model_loader.h"
#include "core/ops.h"
#include "offload/kv_policy.h"
#include "offload/runtime.h"
#include "offload/transfer_engine.h"
#include "tests/test_util.h"

namespace infinigen {
namespace {

class OffloadRuntime : public testing_util::MixedLengthRunTest {
 protected:
  // The non-offloaded engine (resident weights and KV cache).
  GenerationResult reference(DType kv_dtype) {
    const auto model = make_model(source_.config, load_weights(source_, Device::Cpu), Device::Cpu);
    GenerationRequest request = request_;
    request.kv_dtype = kv_dtype;
    return generate(*model, request);
  }
  std::vector<std::vector<int32_t>> reference_tokens(DType kv_dtype) {
    return reference(kv_dtype).tokens;
  }

  OffloadRun run(const std::string& policy, double weights_gpu_percent,
                 DType kv_dtype = DType::F16) {
    OffloadOptions options;
    options.policy = policy;
    options.weights_gpu_percent = weights_gpu_percent;
    options.kv_block_tokens = 4;  // several blocks per sequence
    GenerationRequest request = request_;
    request.kv_dtype = kv_dtype;
    return run_offloaded(source_, request, options, Device::Cpu);
  }
};

TEST_F(OffloadRuntime, EveryPolicyAndPlacementGivesTheEngineTokensAndLogits) {
  for (DType kv : {DType::F16, DType::F32}) {
    const GenerationResult expected = reference(kv);
    const std::vector<float> expected_logits = expected.last_logits.to_floats();
    for (const std::string policy : {"full", "gpu"}) {
      for (double percent : {100.0, 50.0, 0.0}) {
        const GenerationResult got = run(policy, percent, kv).result;
        EXPECT_EQ(got.tokens, expected.tokens)
            << policy << " " << percent << "% " << dtype_name(kv);
        const std::vector<float> logits = got.last_logits.to_floats();
        EXPECT_LT(
            testing_util::relative_error(logits.data(), expected_logits.data(), logits.size()),
            1e-6)
            << policy << " " << percent << "% " << dtype_name(kv);
      }
    }
  }
}

TEST_F(OffloadRuntime, Int4PolicyMovesQuarterSizeKvAndKeepsTheTokens) {
  const OffloadRun r = run("int4", 100.0);
  EXPECT_EQ(r.result.tokens, reference_tokens(DType::F16));  // 4-bit KV, same greedy choices
  const ModelConfig& c = source_.config;
  const uint64_t L = c.num_layers, B = request_.prompts.size(), H = c.num_heads, d = c.head_dim();
  const uint64_t row = d / 2 + 4;  // packed codes + fp16 min and scale of one group (d < 64)
  const auto& steps = r.stats.steps();
  for (size_t i = 1; i < steps.size(); ++i) {
    const uint64_t n = 9 + i - 1;
    EXPECT_EQ(steps[i].h2d_bytes, 2 * L * B * n * H * row) << "step " << i;
  }
}

TEST_F(OffloadRuntime, H2oKeepsItsBudgetAndWithEverythingKeptGivesTheEngineTokens) {
  OffloadOptions options;
  options.policy = "h2o";
  options.h2o_budget = 1.0;
  EXPECT_EQ(run_offloaded(source_, request_, options, Device::Cpu).result.tokens,
            reference_tokens(DType::F16));
  options.h2o_budget = 0.3;  // 4 of the 14 positions of prompt + generation
  const OffloadRun r = run_offloaded(source_, request_, options, Device::Cpu);
  EXPECT_GT(r.totals.h2d_bytes, 0u);  // the kept entries are loaded from the host pool
  const uint64_t H = source_.config.num_heads, B = request_.prompts.size();
  const auto& last = r.stats.steps().back();
  for (const LayerTraffic& layer : last.layers) {
    EXPECT_EQ(layer.tokens_fetched, B * H * 4);  // the kept tokens (the new one is computed)
  }
}

TEST_F(OffloadRuntime, RepeatedRunsAreIdentical) {
  // Loads, stores and compute overlap on three threads; any missing ordering between them shows
  // up as run-to-run differences in the logits (a store buffer reused before its store had read
  // it did, once).
  request_.gen_len = 10;
  const std::vector<float> first = run("full", 100.0).result.last_logits.to_floats();
  for (int i = 0; i < 8; ++i) {
    EXPECT_EQ(run("full", 100.0).result.last_logits.to_floats(), first) << "run " << i;
  }
}

TEST_F(OffloadRuntime, FullPolicyMovesExactlyTheFormulaBytes) {
  const ModelConfig& c = source_.config;
  const uint64_t L = c.num_layers, B = request_.prompts.size(), H = c.num_heads, d = c.head_dim();
  const uint64_t prompt = 9;  // the longest prompt, padding included
  const OffloadRun r = run("full", 100.0);
  const auto& steps = r.stats.steps();
  ASSERT_EQ(steps.size(), static_cast<size_t>(request_.gen_len));
  EXPECT_EQ(steps[0].h2d_bytes, 0u);
  EXPECT_EQ(steps[0].d2h_bytes, 2 * L * B * prompt * H * d * 2);  // the prompt's KV, once
  for (size_t i = 1; i < steps.size(); ++i) {
    const uint64_t n = prompt + i - 1;  // tokens in the pool when decode step i starts
    EXPECT_EQ(steps[i].h2d_bytes, 2 * L * B * n * H * d * 2) << "step " << i;
    EXPECT_EQ(steps[i].d2h_bytes, 2 * L * B * 1 * H * d * 2) << "step " << i;
    for (const LayerTraffic& layer : steps[i].layers) {
      EXPECT_EQ(layer.kv_h2d_bytes, 2 * B * n * H * d * 2);
      EXPECT_EQ(layer.weight_h2d_bytes, 0u);
    }
  }
  uint64_t total_h2d = 0;
  for (const StepStats& s : steps) total_h2d += s.h2d_bytes;
  EXPECT_EQ(r.totals.h2d_bytes, total_h2d);
}

TEST_F(OffloadRuntime, GpuPolicyMovesNoKvAndStreamedWeightsAreCounted) {
  const OffloadRun resident = run("gpu", 100.0);
  EXPECT_EQ(resident.totals.h2d_bytes, 0u);
  EXPECT_EQ(resident.totals.d2h_bytes, 0u);
  // With every weight on the host, each decode step loads every layer's weights once (with more
  // layers than the two staging buffers; two layers would simply stay staged).
  for (int64_t layers : {4, 5}) {
    source_.config.num_layers = layers;
    const OffloadRun streamed = run("gpu", 0.0);
    const ModelConfig& c = source_.config;
    const uint64_t D = c.hidden_size, F = c.ffn_dim;
    const uint64_t matrices = (4 * D * D + 2 * D * F) * 2;  // fp16
    const uint64_t vectors = (4 * D + F + D + 4 * D) * 4;   // biases and LayerNorms, fp32
    const auto& steps = streamed.stats.steps();
    for (size_t i = 1; i < steps.size(); ++i) {
      uint64_t weights = 0;
      for (const LayerTraffic& layer : steps[i].layers) weights += layer.weight_h2d_bytes;
      EXPECT_EQ(weights, static_cast<uint64_t>(layers) * (matrices + vectors))
          << layers << " layers, step " << i;
    }
  }
}

TEST_F(OffloadRuntime, NothingReadsKvThatWasNotTransferred) {
  set_debug_poison(true);  // every staging buffer is NaN until a transfer fills it
  const auto expected = reference_tokens(DType::F16);
  EXPECT_EQ(run("full", 100.0).result.tokens, expected);
  EXPECT_EQ(run("full", 0.0).result.tokens, expected);
}

TEST_F(OffloadRuntime, PlansThatCannotFitAreRefusedBeforeAllocating) {
  OffloadOptions options;
  options.policy = "gpu";
  options.device_memory = 64 * 1024;  // 64 KiB of "device" memory
  try {
    run_offloaded(source_, request_, options, Device::Cpu);
    FAIL() << "expected the plan to be refused";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    EXPECT_NE(message.find("does not fit"), std::string::npos) << message;
  }
}

// The per-policy gate of --device: on the CPU backend everything runs; on CUDA a policy runs
// when the model's ops do (each policy's own steps have CUDA kernels: int4's codec, h2o's scores,
// InfiniGen's speculation and gather).
// An extension's stores read its rows from the staging, which the next pass's loads overwrite (a
// load waits for its own layer's last store only, and a later layer of the same parity may still
// be storing): its end waits for them, as the prefill's does. With every transfer taking 20 ms
// (copy, then the link's latency) the last layer's store is still in flight when the pass ends
// unless the end waits (no attention reads the views here, so nothing else waits for them); each
// layer's rows are its own value, so the rows the next pass stages tell what the pool holds.
TEST(LayerPipelineOrder, AnExtensionsStoresLandBeforeTheNextPass) {
  ModelConfig config = resolve_model("opt-tiny", {}).config;
  config.num_layers = 4;  // two per staging buffer (parity); no model runs
  OffloadOptions options;
  options.policy = "full";
  options.link.latency_us = 20000.0;
  TransferEngine engine(Device::Cpu, options.link);
  OffloadStats stats;
  const int64_t width = config.kv_heads() * config.head_dim(), n = 4, L = config.num_layers;
  std::unique_ptr<KvStore> store = kv_policy("full").make_store(
      {config, 1, 16, DType::F32, Device::Cpu, options, 0, engine, stats});
  const auto rows = [&](int64_t layer, int64_t pass, int64_t count) {
    return Tensor::from_floats({count, width},
                               std::vector<float>(static_cast<size_t>(count * width),
                                                  static_cast<float>(10 * layer + pass)));
  };
  for (int64_t pass = 0; pass < 2; ++pass) {  // the prefill, then an extension
    store->begin_pass(n);
    for (int64_t l = 0; l < L; ++l) {
      store->begin_layer(l);
      store->append(l, rows(l, pass, n), rows(l, pass, n));
    }
    store->end_pass(n);
    EXPECT_EQ(engine.counters().d2h_transfers, static_cast<uint64_t>(L * (pass + 1)))
        << "stores landed by the end of pass " << pass;
  }
  store->begin_pass(1);
  for (int64_t l = 0; l < L; ++l) {
    store->begin_layer(l);
    store->append(l, rows(l, 2, 1), rows(l, 2, 1));
    const KvStore::View view = store->view(l);
    const float* keys = view.keys->data<float>();  // (1, H_kv, 16, d)
    for (int64_t h = 0; h < config.kv_heads(); ++h) {
      for (int64_t t = 0; t < 2 * n; ++t) {
        ASSERT_EQ(keys[(h * 16 + t) * config.head_dim()], static_cast<float>(10 * l + t / n))
            << "layer " << l << ", head " << h << ", token " << t;
      }
    }
  }
  store->end_pass(1);
  engine.synchronize();
}

TEST(PolicyGate, EachPolicySaysWhetherItsStepsRunOnTheDevice) {
  const bool model_on_cuda = ops::device_runs_transformer(Device::Cuda);
  for (const std::string policy : {"gpu", "full", "int4", "h2o", "infinigen"}) {
    EXPECT_TRUE(policy_runs_on(policy, Device::Cpu));
    EXPECT_EQ(policy_runs_on(policy, Device::Cuda), model_on_cuda) << policy;
  }
}

}  // namespace
}  // namespace infinigen
