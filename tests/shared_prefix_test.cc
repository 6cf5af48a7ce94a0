// tests: prompt prefixes that groups of a batch share (core/shared_prefixes.h), each computed and
// kept once: which groups are found, the tokens equal an unshared run's, the pool and the link
// carry each prefix once, and a batch that shares nothing costs nothing extra.
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string_view>

#include "core/generation.h"
#include "core/model.h"
#include "core/model_loader.h"
#include "core/shared_prefixes.h"
#include "core/trace.h"
#include "offload/runtime.h"
#include "tests/test_util.h"

namespace infinigen {
namespace {

std::vector<std::vector<int32_t>> with_own(const std::vector<int32_t>& prefix,
                                           const std::vector<std::vector<int32_t>>& own_parts) {
  std::vector<std::vector<int32_t>> prompts;
  for (const std::vector<int32_t>& own : own_parts) {
    prompts.push_back(prefix);
    prompts.back().insert(prompts.back().end(), own.begin(), own.end());
  }
  return prompts;
}

// Three prompts sharing their first 9 tokens, with own parts of 3, 6 and 1 tokens: with blocks
// of 4 tokens, 8 are shared and each sequence's own tokens start after its padding.
std::vector<std::vector<int32_t>> shared_prompts() {
  return with_own({2, 10, 11, 12, 13, 14, 15, 16, 17},
                  {{30, 31, 32}, {500, 600, 700, 800, 900, 1000}, {7}});
}

// Five prompts in two groups and one alone: sequences 0 and 2 share 9 tokens (8 in blocks of
// 4), sequences 1 and 3 share 5 (4 in blocks), sequence 4 shares a single token with everyone.
// The longest prompt is in the group with the longest prefix, so both prefixes fit within its
// rows (8 shared rows, then at most 7 own).
std::vector<std::vector<int32_t>> grouped_prompts() {
  const auto a = with_own({2, 10, 11, 12, 13, 14, 15, 16, 17}, {{30, 31, 32, 33, 34, 35}, {7}});
  const auto b = with_own({2, 40, 41, 42, 43}, {{500, 600, 700, 800, 900, 1000}, {50, 51}});
  return {a[0], b[0], a[1], b[1], {2, 90, 91, 92, 93, 94}};
}

constexpr int64_t kBlock = 4;

TEST(FindSharedPrefixes, OneGroupInWholeBlocksThatLeaveEverySequenceATokenOfItsOwn) {
  const auto kept = [](const std::vector<std::vector<int32_t>>& prompts, int64_t block) {
    const SharedPrefixes shared = find_shared_prefixes(prompts, block);
    EXPECT_LE(shared.num_groups(), 1);
    return shared.kept_tokens();
  };
  EXPECT_EQ(kept(shared_prompts(), 4), 8);
  EXPECT_EQ(kept(shared_prompts(), 3), 9);
  EXPECT_EQ(kept(shared_prompts(), 16), 0);
  EXPECT_EQ(kept({shared_prompts()[0]}, 4), 0);  // one sequence shares nothing
  // Identical prompts keep their last token their own.
  EXPECT_EQ(kept({{1, 2, 3, 4, 5}, {1, 2, 3, 4, 5}}, 2), 4);
  EXPECT_EQ(kept({{1, 2, 3, 4}, {1, 2, 3, 4}}, 2), 2);
  EXPECT_EQ(kept({{1, 2, 3, 4}, {9, 2, 3, 4}}, 1), 0);
  const SharedPrefixes shared = find_shared_prefixes(shared_prompts(), 4);
  EXPECT_EQ(shared.groups(), std::vector<int32_t>({0, 0, 0}));
  EXPECT_EQ(shared.leaders(), std::vector<int32_t>({0}));
}

TEST(FindSharedPrefixes, GroupsLedByTheirFirstSequenceWithTheirPrefixesLeftPadded) {
  const SharedPrefixes shared = find_shared_prefixes(grouped_prompts(), kBlock);
  EXPECT_EQ(shared.groups(), std::vector<int32_t>({0, 1, 0, 1, -1}));
  EXPECT_EQ(shared.lengths(), std::vector<int64_t>({8, 4}));
  EXPECT_EQ(shared.rows(), 8);
  EXPECT_EQ(shared.leaders(), std::vector<int32_t>({0, 1}));
  EXPECT_EQ(shared.begin(), std::vector<int32_t>({0, 4, 0, 4, 8}));
  EXPECT_EQ(shared.source(), std::vector<int32_t>({0, 1, 0, 1, 4}));
  EXPECT_EQ(shared.leader_first_valid(), std::vector<int32_t>({0, 4}));
  EXPECT_EQ(shared.kept_tokens(), 12);
  EXPECT_EQ(shared.member_tokens(), 24);
  EXPECT_TRUE(shared.in_prefix(3, 4));
  EXPECT_FALSE(shared.in_prefix(3, 3));
  EXPECT_FALSE(shared.in_prefix(4, 7));
}

TEST(FindSharedPrefixes, SplitsARunWhereTheSavingIsLarger) {
  // Four prompts share one block of 2; two of them share three. Grouping all four saves 3 x 2 =
  // 6 tokens, the pair and the other pair 6 + 2 = 8.
  const auto prompts = std::vector<std::vector<int32_t>>{
      {1, 2, 3, 4, 5, 6, 7}, {1, 2, 3, 4, 5, 6, 8}, {1, 2, 9}, {1, 2, 8}};
  const SharedPrefixes shared = find_shared_prefixes(prompts, 2);
  EXPECT_EQ(shared.groups(), std::vector<int32_t>({0, 0, 1, 1}));
  EXPECT_EQ(shared.lengths(), std::vector<int64_t>({6, 2}));
}

TEST(FindSharedPrefixes, ShortensPrefixesRatherThanNeedMoreRowsThanUnshared) {
  // Sequences 0 and 1 share 8 tokens and have 1 of their own; sequence 2 shares nothing and has
  // 9. Rows for 8 shared and 9 own would exceed the 9 of the longest prompt: sharing them costs
  // more than it saves, so nothing is shared.
  const std::vector<std::vector<int32_t>> prompts = {
      {1, 2, 3, 4, 5, 6, 7, 8, 9}, {1, 2, 3, 4, 5, 6, 7, 8, 10}, {5, 5, 5, 5, 5, 5, 5, 5, 5}};
  EXPECT_TRUE(find_shared_prefixes(prompts, 2).empty());
  // With own parts of 6 (a prefix of 4 shared then), rows stay within the longest prompt.
  const std::vector<std::vector<int32_t>> longer = {
      {1, 2, 3, 4, 5, 6, 7, 8, 9, 11}, {1, 2, 3, 4, 5, 6, 7, 8, 10, 12}, {5, 5, 5, 5, 5, 5}};
  const SharedPrefixes shared = find_shared_prefixes(longer, 2);
  EXPECT_EQ(shared.lengths(), std::vector<int64_t>({4}));
  EXPECT_EQ(shared.groups(), std::vector<int32_t>({0, 0, -1}));
}

TEST(SharedPrefixesShape, RefusesGroupsWithoutMembersOrTokens) {
  testing_util::expect_error([] { SharedPrefixes({0, 0}, {0}); }, {"0 tokens"});
  testing_util::expect_error([] { SharedPrefixes({0, 2}, {4, 4}); }, {"group 2 of 2"});
  testing_util::expect_error([] { SharedPrefixes({0, 0}, {4, 4}); }, {"prefix 2 has no sequence"});
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
    grouped_ = request_;
    grouped_.prompts = grouped_prompts();
  }
  void TearDown() override { set_debug_poison(false); }
  ModelSource source_;
  GenerationRequest request_;
  GenerationRequest grouped_;  // the grouped prompts
};

TEST_P(SharedPrefix, TokensEqualAnUnsharedRun) {
  // Staging rows the loads do not bring are NaN: a sequence that read its prefix's rows anywhere
  // but from its group's leader would turn its tokens into garbage.
  set_debug_poison(true);
  for (const GenerationRequest* request : {&request_, &grouped_}) {
    for (const std::string policy : {"full", "gpu", "infinigen"}) {
      const OffloadRun unshared =
          run_offloaded(source_, *request, options_for(policy, false), Device::Cpu);
      const OffloadRun shared =
          run_offloaded(source_, *request, options_for(policy, true), Device::Cpu);
      EXPECT_EQ(shared.shared_prefixes.num_groups(), request == &grouped_ ? 2 : 1) << policy;
      EXPECT_EQ(shared.result.tokens, unshared.result.tokens) << policy;
      // The prompt is one step of the statistics either way.
      EXPECT_EQ(shared.stats.steps().size(), unshared.stats.steps().size()) << policy;
    }
  }
}

TEST_P(SharedPrefix, TheResidentCacheComputesEachPrefixOnce) {
  ModelWeights weights = load_weights(source_, Device::Cpu);
  const std::unique_ptr<Model> model = make_model(source_.config, std::move(weights), Device::Cpu);
  const GenerationResult unshared = generate(*model, grouped_);
  GenerationRequest shared = grouped_;
  shared.shared_prefixes = find_shared_prefixes(grouped_.prompts, kBlock);
  // One pass of the two prefixes as a batch of their leaders (8 rows, the shorter left-padded),
  // then the own tokens of the 5 sequences (7 rows each, the longest own part) in one
  // extension, each row attending to its prefix and its own rows so far.
  Trace trace(/*dry=*/false);
  GenerationResult result;
  {
    TraceScope scope(trace);
    result = generate(*model, shared);
  }
  EXPECT_EQ(result.tokens, unshared.tokens);
  int64_t prefill_prefix_rows = 0, extensions = 0;
  for (const TracedOp& op : trace.ops()) {
    if (op.step == 0 && std::string_view(op.name) == "attention_prefill") {
      prefill_prefix_rows += op.sizes[0] * op.sizes[2];
    }
    if (op.step == 0 && std::string_view(op.name) == "attention_extend") ++extensions;
  }
  EXPECT_EQ(prefill_prefix_rows, 2 * 8 * source_.config.num_layers);
  EXPECT_EQ(extensions, source_.config.num_layers);
}

TEST_P(SharedPrefix, ThePoolAndTheLinkCarryEachPrefixOnce) {
  const ModelConfig& c = source_.config;
  const uint64_t row_bytes = static_cast<uint64_t>(2 * c.kv_heads() * c.head_dim() * 2);
  // (prompts, sequences, rows of the longest prompt, shared rows, tokens the prefixes keep)
  struct Case {
    const GenerationRequest& request;
    uint64_t B, longest, S, kept;
  };
  for (const Case& k : {Case{request_, 3, 15, 8, 8}, Case{grouped_, 5, 15, 8, 12}}) {
    const OffloadRun unshared =
        run_offloaded(source_, k.request, options_for("full", false), Device::Cpu);
    const OffloadRun shared =
        run_offloaded(source_, k.request, options_for("full", true), Device::Cpu);
    // Each layer's load in a decode step: K and V of every row before the step, each prefix's
    // rows once, then every sequence's rows after the shared ones (padding of the own part
    // included, as in the unshared layout; the shared region's padding is not stored at all).
    const auto& steps = shared.stats.steps();
    ASSERT_EQ(steps.size(), static_cast<size_t>(k.request.gen_len));
    for (size_t s = 1; s < steps.size(); ++s) {
      const uint64_t length = k.longest + s - 1;
      for (const LayerTraffic& layer : steps[s].layers) {
        EXPECT_EQ(layer.kv_h2d_bytes, row_bytes * (k.kept + k.B * (length - k.S))) << "step " << s;
      }
      for (const LayerTraffic& layer : unshared.stats.steps()[s].layers) {
        EXPECT_EQ(layer.kv_h2d_bytes, row_bytes * k.B * length) << "step " << s;
      }
    }
    // The prefill stores each prefix once.
    EXPECT_EQ(steps[0].d2h_bytes, row_bytes * (k.kept + k.B * (k.longest - k.S)) * c.num_layers);
    EXPECT_EQ(unshared.stats.steps()[0].d2h_bytes, row_bytes * k.B * k.longest * c.num_layers);
    // The pool: the prefixes' blocks once, then every sequence's blocks of the rows after them,
    // pinned for every row the run can hold before its first decode step.
    const uint64_t stored = k.longest + k.request.gen_len;
    const uint64_t blocks = k.kept / kBlock + k.B * ((stored - k.S + kBlock - 1) / kBlock);
    EXPECT_EQ(steps.back().host_kv_bytes, 2 * c.num_layers * blocks * kBlock * row_bytes / 2);
  }
}

TEST_P(SharedPrefix, InfinigenFetchesASharedRowOncePerGroup) {
  // Every sequence selects every token (alpha 1000), its prefix's among them: group 0's 8 rows
  // cross the link once for its 2 sequences, group 1's 4 once for its 2. Without the row cache,
  // which would serve most of them from the step before (tests/row_cache_test.cc: with it, a
  // shared row still crosses at most once).
  OffloadOptions unshared_options = options_for("infinigen", false);
  OffloadOptions shared_options = options_for("infinigen", true);
  unshared_options.row_cache = shared_options.row_cache = RowCacheUse::Off;
  const OffloadRun unshared = run_offloaded(source_, grouped_, unshared_options, Device::Cpu);
  const OffloadRun shared = run_offloaded(source_, grouped_, shared_options, Device::Cpu);
  const ModelConfig& c = source_.config;
  const uint64_t row_bytes = static_cast<uint64_t>(2 * c.kv_heads() * c.head_dim() * 2);
  const uint64_t saved = 8 + 4;
  const std::vector<uint64_t> prompt = {15, 11, 10, 7, 6};  // prompt tokens per sequence
  const int64_t dense = SpeculationOptions{}.dense_layers;
  for (size_t s = 1; s < shared.stats.steps().size(); ++s) {
    const auto& layers = shared.stats.steps()[s].layers;
    const auto& unshared_layers = unshared.stats.steps()[s].layers;
    uint64_t tokens = 0;  // rows of every sequence before the step, padding excluded
    for (uint64_t n : prompt) tokens += n + s - 1;
    for (size_t l = static_cast<size_t>(dense); l < layers.size(); ++l) {
      EXPECT_EQ(unshared_layers[l].kv_h2d_bytes, row_bytes * tokens) << "step " << s;
      EXPECT_EQ(layers[l].kv_h2d_bytes, row_bytes * (tokens - saved)) << "step " << s;
      EXPECT_EQ(layers[l].tokens_fetched, unshared_layers[l].tokens_fetched);
    }
  }
}

TEST_P(SharedPrefix, ABatchThatSharesNothingCostsNothingExtra) {
  request_.prompts = {{2, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20},
                      {2, 500, 600, 700, 800, 900, 1000, 1100, 1200, 1300, 1400, 1500}};
  for (const std::string policy : {"full", "gpu"}) {
    const OffloadRun off =
        run_offloaded(source_, request_, options_for(policy, false), Device::Cpu);
    const OffloadRun on = run_offloaded(source_, request_, options_for(policy, true), Device::Cpu);
    EXPECT_EQ(on.result.tokens, off.result.tokens);
    ASSERT_EQ(on.stats.steps().size(), off.stats.steps().size());
    for (size_t s = 0; s < on.stats.steps().size(); ++s) {
      EXPECT_EQ(on.stats.steps()[s].h2d_bytes, off.stats.steps()[s].h2d_bytes) << policy;
      EXPECT_EQ(on.stats.steps()[s].d2h_bytes, off.stats.steps()[s].d2h_bytes) << policy;
    }
  }
}

TEST_P(SharedPrefix, APromptThatDoesNotContinueItsPrefixIsRefused) {
  ModelWeights weights = load_weights(source_, Device::Cpu);
  const std::unique_ptr<Model> model = make_model(source_.config, std::move(weights), Device::Cpu);
  grouped_.shared_prefixes = find_shared_prefixes(grouped_.prompts, kBlock);
  grouped_.prompts[3][3] = 99;
  testing_util::expect_error([&] { generate(*model, grouped_); },
                             {"prompt 4 does not continue the 4-token prefix", "prompt 2"});
  request_.shared_prefixes = SharedPrefixes({0, 0, 0}, {10});  // beyond what the prompts share
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

TEST(SharedPrefixCli, GroupsOfPromptsSharingDifferentPrefixesKeepEachOnce) {
  // Two held-out texts, each before two of four questions: two groups, found from the token
  // ids, each prefix kept once in blocks of 16 tokens.
  testing_util::TempDir dir("shared-prefix-groups");
  const auto opening = [](const std::string& name) {
    std::ifstream text(std::string(INFINIGEN_FIXTURES_DIR) + "/heldout/" + name);
    std::string prefix(600, '\0');
    text.read(prefix.data(), static_cast<std::streamsize>(prefix.size()));
    for (char& c : prefix) c = c == '\n' ? ' ' : c;  // one prompt per line
    return prefix;
  };
  const std::string hosea = opening("kjv_Hosea.txt");
  const std::string curses = opening("python-doc_howto_curses.rst.txt");
  const std::string prompt_file = (dir.path() / "prompts.txt").string();
  std::ofstream(prompt_file) << hosea << " Who is the prophet?\n"
                             << curses << " What is curses?\n"
                             << hosea << " And then\n"
                             << curses << " How do I start?\n";
  const auto run = [&](const std::string& share) {
    const testing_util::CommandResult result = testing_util::run_infinigen(
        {"run", "--prompt-file", prompt_file, "--gen-len", "6", "--temperature", "0", "--policy",
         "full", "--kv-block-tokens", "16", "--share-prefix", share, "--json"});
    EXPECT_EQ(result.exit_code, 0) << result.err;
    return nlohmann::json::parse(result.out);
  };
  const nlohmann::json shared = run("on"), unshared = run("off");
  EXPECT_EQ(shared["transfer"]["shared_prefix_groups"].get<int64_t>(), 2);
  EXPECT_EQ(shared["transfer"]["shared_prefix_sequences"].get<int64_t>(), 4);
  EXPECT_GE(shared["transfer"]["shared_prefix_tokens"].get<int64_t>(), 2 * 96);
  EXPECT_EQ(unshared["transfer"]["shared_prefix_groups"].get<int64_t>(), 0);
  EXPECT_LT(shared["transfer"]["host_kv_bytes"].get<double>(),
            unshared["transfer"]["host_kv_bytes"].get<double>());
  for (size_t b = 0; b < 4; ++b) {
    EXPECT_EQ(shared["outputs"][b]["tokens"], unshared["outputs"][b]["tokens"]);
  }
}

INSTANTIATE_TEST_SUITE_P(Families, SharedPrefix, ::testing::Values("opt-tiny", "llama-tiny"),
                         [](const auto& param) {
                           return param.param == "opt-tiny" ? "Opt" : "Llama";
                         });

}  // namespace
}  // namespace infinigen
