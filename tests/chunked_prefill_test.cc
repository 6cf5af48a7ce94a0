// tests: a prompt computed in chunks (Model::prefill's chunk, OffloadOptions::prefill_chunk): the
// exact policies equal one pass, chunks of one token decode the prompt, InfiniGen chooses its
// columns from the whole prompt, int4 stays within its quantisation error, shared prefixes and
// left padding (a sequence all padding in the first chunks) keep working, and the prompt stays
// one step of the statistics.
#include <cmath>
#include <string>
#include <vector>

#include "core/generation.h"
#include "core/kv_cache.h"
#include "core/model.h"
#include "core/model_loader.h"
#include "offload/runtime.h"
#include "tests/test_util.h"

namespace infinigen {
namespace {

// Three prompts of 14, 9 and 3 tokens: left-padded, the shortest is all padding in chunks that
// end before row 11.
std::vector<std::vector<int32_t>> mixed_prompts() {
  return {{2, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22},
          {2, 500, 600, 700, 800, 900, 1000, 1100, 1200},
          {2, 40, 41}};
}

// The largest difference between two runs' log-probabilities of the tokens they generated.
double largest_difference(const GenerationResult& a, const GenerationResult& b) {
  double largest = 0.0;
  for (size_t s = 0; s < a.token_log_probs.size(); ++s) {
    for (size_t i = 0; i < a.token_log_probs[s].size(); ++i) {
      largest = std::max(largest, std::fabs(a.token_log_probs[s][i] - b.token_log_probs[s][i]));
    }
  }
  return largest;
}

class ChunkedPrefill : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    source_ = resolve_model(GetParam(), {});
    request_.prompts = mixed_prompts();
    request_.gen_len = 5;
    request_.sampling.temperature = 0;
    request_.score_tokens = true;
    request_.kv_dtype = DType::F32;  // earlier chunks' rows are read back as the pool keeps them
  }
  void TearDown() override { set_debug_poison(false); }

  OffloadRun run(const std::string& policy, int64_t chunk, const GenerationRequest& request,
                 OffloadOptions options = {}) const {
    options.policy = policy;
    options.kv_block_tokens = 4;
    options.prefill_chunk = chunk;
    return run_offloaded(source_, request, options, Device::Cpu);
  }

  ModelSource source_;
  GenerationRequest request_;
};

TEST_P(ChunkedPrefill, ExactPoliciesEqualOnePass) {
  // Staging rows a load does not bring are NaN: a chunk that read a row no pass stored shows.
  set_debug_poison(true);
  for (const std::string policy : {"full", "gpu"}) {
    const OffloadRun whole = run(policy, 0, request_);
    for (int64_t chunk : {1, 3, 5, 13, 14, 100}) {
      const OffloadRun chunked = run(policy, chunk, request_);
      EXPECT_EQ(chunked.result.tokens, whole.result.tokens) << policy << " chunk " << chunk;
      EXPECT_LT(largest_difference(chunked.result, whole.result), 1e-4)
          << policy << " chunk " << chunk;
      // The prompt is one step of the statistics however many passes it takes.
      EXPECT_EQ(chunked.stats.steps().size(), whole.stats.steps().size()) << policy;
    }
  }
}

TEST_P(ChunkedPrefill, ChunksOfOneTokenDecodeThePrompt) {
  // Prompts of one length: the run that decodes them from their first token, teacher-forced, is
  // the same computation as a prompt in chunks of one, pass for pass.
  const std::vector<std::vector<int32_t>> prompts = {{2, 10, 11, 12, 13, 14, 15},
                                                     {2, 500, 600, 700, 800, 900, 1000}};
  const std::vector<std::vector<int32_t>> continuation = {{30, 31, 32, 33}, {40, 41, 42, 43}};
  GenerationRequest chunked = request_;
  chunked.prompts = prompts;
  chunked.gen_len = 4;
  chunked.forced_tokens = continuation;
  chunked.kv_dtype = DType::F16;
  GenerationRequest decoded = chunked;
  decoded.forced_tokens.clear();
  for (size_t b = 0; b < prompts.size(); ++b) {
    decoded.prompts[b] = {prompts[b][0]};
    decoded.forced_tokens.emplace_back(prompts[b].begin() + 1, prompts[b].end());
    decoded.forced_tokens[b].insert(decoded.forced_tokens[b].end(), continuation[b].begin(),
                                    continuation[b].end());
  }
  decoded.gen_len = std::ssize(decoded.forced_tokens[0]);
  const auto prompt_steps = static_cast<size_t>(prompts[0].size() - 1);
  for (const std::string policy : {"full", "gpu", "int4"}) {
    const GenerationResult a = run(policy, 1, chunked).result;
    const GenerationResult b = run(policy, 0, decoded).result;
    for (size_t s = 0; s < prompts.size(); ++s) {
      for (size_t i = 0; i < continuation[s].size(); ++i) {
        EXPECT_EQ(a.token_log_probs[s][i], b.token_log_probs[s][prompt_steps + i])
            << policy << " sequence " << s << " token " << i;
      }
    }
  }
}

TEST_P(ChunkedPrefill, InfinigenChoosesItsColumnsFromTheWholePrompt) {
  set_debug_poison(true);
  OffloadOptions everything;  // every token within alpha of the top one: equal to full
  everything.speculation.alpha = 1000.0;
  everything.speculation.max_num_kv = 100000;
  const OffloadRun full = run("full", 0, request_);
  for (const OffloadOptions& options : {OffloadOptions{}, everything}) {
    const OffloadRun whole = run("infinigen", 0, request_, options);
    for (int64_t chunk : {1, 4, 9}) {
      const OffloadRun chunked = run("infinigen", chunk, request_, options);
      EXPECT_EQ(chunked.result.tokens, whole.result.tokens) << "chunk " << chunk;
      EXPECT_LT(largest_difference(chunked.result, whole.result), 1e-4) << "chunk " << chunk;
      // The same columns select the same tokens at every decode step and layer.
      ASSERT_EQ(chunked.stats.steps().size(), whole.stats.steps().size());
      for (size_t s = 1; s < whole.stats.steps().size(); ++s) {
        const auto& a = chunked.stats.steps()[s].layers;
        const auto& b = whole.stats.steps()[s].layers;
        for (size_t l = 0; l < a.size(); ++l) {
          EXPECT_EQ(a[l].tokens_fetched, b[l].tokens_fetched) << "step " << s << " layer " << l;
        }
      }
    }
    if (&options == &everything) {
      EXPECT_EQ(run("infinigen", 4, request_, options).result.tokens, full.result.tokens);
    }
  }
}

TEST_P(ChunkedPrefill, Int4ChunksDifferByTheQuantisationErrorOfTheEarlierOnes) {
  const GenerationResult full = run("full", 0, request_).result;
  const GenerationResult whole = run("int4", 0, request_).result;
  const GenerationResult chunked = run("int4", 4, request_).result;
  // Quantised early chunks move the log-probabilities about as much as quantising moves them at
  // all; an error in the chunks' bookkeeping (a row read from the wrong place) moves them by far
  // more.
  const double quantisation = largest_difference(whole, full);
  EXPECT_GT(quantisation, 0.0);
  EXPECT_LT(largest_difference(chunked, whole), 4 * quantisation + 1e-3);
}

TEST_P(ChunkedPrefill, SharedPrefixesThenChunksOfTheOwnTokens) {
  set_debug_poison(true);
  GenerationRequest request = request_;
  // Two prompts share their first 9 tokens (8 in blocks of 4).
  request.prompts = {{2, 10, 11, 12, 13, 14, 15, 16, 17, 30, 31, 32, 33, 34},
                     {2, 10, 11, 12, 13, 14, 15, 16, 17, 50}};
  for (const std::string policy : {"full", "gpu", "infinigen"}) {
    OffloadOptions unshared;
    unshared.share_prefix = false;
    const OffloadRun reference = run(policy, 0, request, unshared);
    for (int64_t chunk : {2, 5}) {
      const OffloadRun chunked = run(policy, chunk, request);
      EXPECT_EQ(chunked.shared_prefixes.num_groups(), 1) << policy;
      EXPECT_EQ(chunked.result.tokens, reference.result.tokens) << policy << " chunk " << chunk;
      EXPECT_LT(largest_difference(chunked.result, reference.result), 1e-4) << policy;
      EXPECT_EQ(chunked.stats.steps().size(), reference.stats.steps().size()) << policy;
    }
  }
}

TEST_P(ChunkedPrefill, EveryPositionsLogitsComeBackInOrder) {
  ModelWeights weights = load_weights(source_, Device::Cpu);
  const std::unique_ptr<Model> model = make_model(source_.config, std::move(weights), Device::Cpu);
  const std::vector<int32_t> tokens = {0, 0, 2, 10, 11, 12, 13, 14, 2, 5, 6, 7, 8, 9, 10, 11};
  const std::vector<int32_t> first_valid = {2, 0};
  const auto logits = [&](int64_t chunk) {
    KvCache cache(source_.config, 2, 8, DType::F32, Device::Cpu);
    return model->prefill(tokens, first_valid, cache, /*all_positions=*/true, chunk);
  };
  const Tensor whole = logits(0);
  for (int64_t chunk : {1, 3, 8}) {
    const Tensor chunked = logits(chunk);
    ASSERT_EQ(chunked.shape(), whole.shape());
    const float* a = chunked.data<float>();
    const float* b = whole.data<float>();
    const int64_t V = source_.config.vocab_size;
    for (int64_t row = 0; row < 16; ++row) {
      if (row < 2) continue;  // padding rows: their logits mean nothing
      for (int64_t v = 0; v < V; ++v) {
        ASSERT_NEAR(a[row * V + v], b[row * V + v], 1e-4) << "chunk " << chunk << " row " << row;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Families, ChunkedPrefill, ::testing::Values("opt-tiny", "llama-tiny"),
                         [](const auto& param) {
                           return param.param == "opt-tiny" ? "Opt" : "Llama";
                         });

TEST(ChunkedPrefillOptions, RefusedWhereThePolicyNeedsTheWholePromptInOnePass) {
  OffloadOptions options;
  options.prefill_chunk = -1;
  testing_util::expect_error([&] { options.validate(); }, {"--prefill-chunk", ">= 0"});
  options.prefill_chunk = 64;
  options.policy = "h2o";
  testing_util::expect_error([&] { options.validate(); }, {"--prefill-chunk", "h2o"});
  options.policy = "infinigen";
  options.kv_pool_limit = 0.5;
  testing_util::expect_error([&] { options.validate(); },
                             {"--prefill-chunk", "--kv-pool-limit"});
  options.kv_pool_limit = 0;
  options.validate();
}

}  // namespace
}  // namespace infinigen
