// tests: a prompt prefix the batch shares (KvStore::share_prefix), computed and kept once: the
// tokens equal an unshared run's, the pool and the link carry the prefix once, and a batch that
// shares nothing costs nothing extra.
#include "core/generation.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string_view>

#include "core/model.h"
#include "core/model_loader.h"
#include "core/trace.h"
#include "offload/runtime.h"
#include "tests/test_util.h"

namespace infinigen {
namespace {

// Three prompts sharing their first 9 tokens, with own parts of 3, 6 and 1 tokens: with blocks
// of 4 tokens, 8 are shared and each sequence's own tokens start after its padding.
std::vector<std::vector<int32_t>> shared_prompts() {
  const std::vector<int32_t> prefix = {2, 10, 11, 12, 13, 14, 15, 16, 17};
  std::vector<std::vector<int32_t>> prompts;
  for (const std::vector<int32_t>& own :
       std::vector<std::vector<int32_t>>{{30, 31, 32}, {500, 600, 700, 800, 900, 1000}, {7}}) {
    prompts.push_back(prefix);
    prompts.back().insert(prompts.back().end(), own.begin(), own.end());
  }
  return prompts;
}

constexpr int64_t kBlock = 4;

TEST(CommonPrefixRows, WholeBlocksThatLeaveEverySequenceATokenOfItsOwn) {
  EXPECT_EQ(common_prefix_rows(shared_prompts(), 4), 8);
  EXPECT_EQ(common_prefix_rows(shared_prompts(), 3), 9);
  EXPECT_EQ(common_prefix_rows(shared_prompts(), 16), 0);
  EXPECT_EQ(common_prefix_rows({shared_prompts()[0]}, 4), 0);  // one sequence shares nothing
  // Identical prompts keep their last token their own.
  EXPECT_EQ(common_prefix_rows({{1, 2, 3, 4, 5}, {1, 2, 3, 4, 5}}, 2), 4);
  EXPECT_EQ(common_prefix_rows({{1, 2, 3, 4}, {1, 2, 3, 4}}, 2), 2);
  EXPECT_EQ(common_prefix_rows({{1, 2, 3, 4}, {9, 2, 3, 4}}, 1), 0);
}

OffloadOptions options_for(const std::string& policy, bool share) {
  OffloadOptions options;
  options.policy = policy;
  options.kv_block_tokens = kBlock;
  options.share_prefix = share;
  if (policy == "infinigen") {
    // Every token within alpha of the top one: InfiniGen must then equal the full cache.
    options.speculation.alpha = 1000.0;
    options.speculation.max_num_kv = 100000;
  }
  return options;
}

class SharedPrefix : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    source_ = resolve_model(GetParam(), {});
    request_.prompts = shared_prompts();
    request_.gen_len = 6;
    request_.sampling.temperature = 0;
  }
  void TearDown() override { set_debug_poison(false); }
  ModelSource source_;
  GenerationRequest request_;
};

TEST_P(SharedPrefix, TokensEqualAnUnsharedRun) {
  // Staging rows the loads do not bring are NaN: a sequence that read sequence 0's prefix rows
  // anywhere but from sequence 0 would turn its tokens into garbage.
  set_debug_poison(true);
  for (const std::string policy : {"full", "gpu", "infinigen"}) {
    const OffloadRun unshared =
        run_offloaded(source_, request_, options_for(policy, false), Device::Cpu);
    const OffloadRun shared =
        run_offloaded(source_, request_, options_for(policy, true), Device::Cpu);
    EXPECT_EQ(shared.result.tokens, unshared.result.tokens) << policy;
    // The prompt is one step of the statistics either way.
    EXPECT_EQ(shared.stats.steps().size(), unshared.stats.steps().size()) << policy;
  }
}

TEST_P(SharedPrefix, TheResidentCacheComputesThePrefixOnce) {
  ModelWeights weights = load_weights(source_, Device::Cpu);
  const std::unique_ptr<Model> model = make_model(source_.config, std::move(weights), Device::Cpu);
  const GenerationResult unshared = generate(*model, request_);
  GenerationRequest shared = request_;
  shared.shared_prefix = 8;
  // One pass of the prefix at batch 1, then the own tokens of 3 sequences.
  Trace trace(/*dry=*/false);
  GenerationResult result;
  {
    TraceScope scope(trace);
    result = generate(*model, shared);
  }
  EXPECT_EQ(result.tokens, unshared.tokens);
  int64_t prefill_prefix_rows = 0;
  for (const TracedOp& op : trace.ops()) {
    if (op.step == 0 && std::string_view(op.name) == "attention_prefill") {
      prefill_prefix_rows += op.sizes[0] * op.sizes[2];
    }
  }
  EXPECT_EQ(prefill_prefix_rows, 8 * source_.config.num_layers);  // B 1 x 8 rows per layer
}

TEST_P(SharedPrefix, ThePoolAndTheLinkCarryThePrefixOnce) {
  const OffloadRun unshared =
      run_offloaded(source_, request_, options_for("full", false), Device::Cpu);
  const OffloadRun shared = run_offloaded(source_, request_, options_for("full", true), Device::Cpu);
  const ModelConfig& c = source_.config;
  // Each layer's load in a decode step: K and V of every row before the step, the 8 shared rows
  // once (padding rows of the own part included, as in the unshared layout).
  const uint64_t row_bytes = static_cast<uint64_t>(2 * c.kv_heads() * c.head_dim() * 2);
  const uint64_t B = 3, longest = 15, P = 8;
  const auto& steps = shared.stats.steps();
  ASSERT_EQ(steps.size(), static_cast<size_t>(request_.gen_len));
  for (size_t s = 1; s < steps.size(); ++s) {
    const uint64_t length = longest + s - 1;
    for (const LayerTraffic& layer : steps[s].layers) {
      EXPECT_EQ(layer.kv_h2d_bytes, row_bytes * (P + B * (length - P))) << "step " << s;
    }
    for (const LayerTraffic& layer : unshared.stats.steps()[s].layers) {
      EXPECT_EQ(layer.kv_h2d_bytes, row_bytes * B * length) << "step " << s;
    }
  }
  // The prefill stores the prefix once.
  EXPECT_EQ(steps[0].d2h_bytes, row_bytes * (P + B * (longest - P)) * c.num_layers);
  EXPECT_EQ(unshared.stats.steps()[0].d2h_bytes, row_bytes * B * longest * c.num_layers);
}

TEST_P(SharedPrefix, InfinigenFetchesASharedRowOnceForTheBatch) {
  // Every sequence selects every token (alpha 1000), the 8 shared rows among them.
  const OffloadRun unshared =
      run_offloaded(source_, request_, options_for("infinigen", false), Device::Cpu);
  const OffloadRun shared =
      run_offloaded(source_, request_, options_for("infinigen", true), Device::Cpu);
  const ModelConfig& c = source_.config;
  const uint64_t row_bytes = static_cast<uint64_t>(2 * c.kv_heads() * c.head_dim() * 2);
  const uint64_t B = 3, P = 8;
  const std::vector<uint64_t> prompt = {12, 15, 10};  // prompt tokens per sequence
  const int64_t dense = SpeculationOptions{}.dense_layers;
  for (size_t s = 1; s < shared.stats.steps().size(); ++s) {
    const auto& layers = shared.stats.steps()[s].layers;
    const auto& unshared_layers = unshared.stats.steps()[s].layers;
    uint64_t tokens = 0;  // rows of every sequence before the step, padding excluded
    for (uint64_t n : prompt) tokens += n + s - 1;
    for (size_t l = static_cast<size_t>(dense); l < layers.size(); ++l) {
      EXPECT_EQ(unshared_layers[l].kv_h2d_bytes, row_bytes * tokens) << "step " << s;
      EXPECT_EQ(layers[l].kv_h2d_bytes, row_bytes * (tokens - (B - 1) * P)) << "step " << s;
      EXPECT_EQ(layers[l].tokens_fetched, unshared_layers[l].tokens_fetched);
    }
  }
}

TEST_P(SharedPrefix, ABatchThatSharesNothingCostsNothingExtra) {
  request_.prompts = {{2, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20},
                      {2, 500, 600, 700, 800, 900, 1000, 1100, 1200, 1300, 1400, 1500}};
  for (const std::string policy : {"full", "gpu"}) {
    const OffloadRun off = run_offloaded(source_, request_, options_for(policy, false), Device::Cpu);
    const OffloadRun on = run_offloaded(source_, request_, options_for(policy, true), Device::Cpu);
    EXPECT_EQ(on.result.tokens, off.result.tokens);
    ASSERT_EQ(on.stats.steps().size(), off.stats.steps().size());
    for (size_t s = 0; s < on.stats.steps().size(); ++s) {
      EXPECT_EQ(on.stats.steps()[s].h2d_bytes, off.stats.steps()[s].h2d_bytes) << policy;
      EXPECT_EQ(on.stats.steps()[s].d2h_bytes, off.stats.steps()[s].d2h_bytes) << policy;
    }
  }
}

TEST_P(SharedPrefix, APromptThatDoesNotContinueThePrefixIsRefused) {
  ModelWeights weights = load_weights(source_, Device::Cpu);
  const std::unique_ptr<Model> model = make_model(source_.config, std::move(weights), Device::Cpu);
  request_.shared_prefix = 8;
  request_.prompts[2][3] = 99;
  testing_util::expect_error([&] { generate(*model, request_); },
                             {"prompt 3 does not continue the 8-token prefix"});
  request_.prompts = shared_prompts();
  request_.shared_prefix = 10;  // beyond what the prompts share
  testing_util::expect_error([&] { generate(*model, request_); },
                             {"prompt 2 does not continue the 10-token prefix"});
}

TEST(SharedPrefixCli, AStatedPrefixIsKeptOnceAndChangesNoToken) {
  // The first 2000 characters of a held-out text before each of three questions: at least one
  // whole block of 128 tokens is shared.
  testing_util::TempDir dir("shared-prefix");
  std::ifstream text(std::string(INFINIGEN_FIXTURES_DIR) + "/heldout/kjv_Hosea.txt");
  std::string prefix(2000, '\0');
  text.read(prefix.data(), static_cast<std::streamsize>(prefix.size()));
  const std::string prefix_file = (dir.path() / "prefix.txt").string();
  const std::string prompt_file = (dir.path() / "prompts.txt").string();
  std::ofstream(prefix_file) << prefix;
  std::ofstream(prompt_file) << "Who is the prophet?\nWhat did the LORD say?\nAnd then\n";
  const auto run = [&](const std::string& share) {
    const testing_util::CommandResult result = testing_util::run_infinigen(
        {"run", "--shared-prefix", prefix_file, "--prompt-file", prompt_file, "--gen-len", "6",
         "--temperature", "0", "--policy", "full", "--share-prefix", share, "--json"});
    EXPECT_EQ(result.exit_code, 0) << result.err;
    return nlohmann::json::parse(result.out);
  };
  const nlohmann::json shared = run("on"), unshared = run("off");
  EXPECT_GE(shared["transfer"]["shared_prefix_tokens"].get<int64_t>(), 128);
  EXPECT_EQ(unshared["transfer"]["shared_prefix_tokens"].get<int64_t>(), 0);
  EXPECT_LT(shared["transfer"]["host_kv_bytes"].get<double>(),
            unshared["transfer"]["host_kv_bytes"].get<double>());
  for (size_t b = 0; b < 3; ++b) {
    EXPECT_EQ(shared["outputs"][b]["tokens"], unshared["outputs"][b]["tokens"]);
    EXPECT_EQ(shared["outputs"][b]["prompt"], unshared["outputs"][b]["prompt"]);
  }
  const testing_util::CommandResult missing =
      testing_util::run_infinigen({"run", "--shared-prefix", (dir.path() / "none").string()});
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_NE(missing.err.find("--shared-prefix"), std::string::npos) << missing.err;
  EXPECT_EQ(std::count(missing.err.begin(), missing.err.end(), '\n'), 1) << missing.err;
}

INSTANTIATE_TEST_SUITE_P(Families, SharedPrefix, ::testing::Values("opt-tiny", "llama-tiny"),
                         [](const auto& param) { return param.param == "opt-tiny" ? "Opt" : "Llama"; });

}  // namespace
}  // namespace infinigen
