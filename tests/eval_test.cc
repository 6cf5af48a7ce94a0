// tests: `infinigen eval`: perplexity through the decode loop, its properties (every policy that
// reads all KV scores the same; InfiniGen with everything selected equals full), its files, and
// its bad inputs.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "bench/perplexity.h"
#include "core/model_loader.h"
#include "tests/test_util.h"

namespace infinigen {
namespace {

using testing_util::CommandResult;
using testing_util::expect_error;
using testing_util::expect_one_line_error;
using testing_util::run_infinigen;
using testing_util::TempDir;

const std::string kTiny = std::string(INFINIGEN_FIXTURES_DIR) + "/opt-tiny";
const std::string kText = std::string(INFINIGEN_SOURCE_DIR) + "/configs/calibration.txt";

class Perplexity : public ::testing::Test {
 protected:
  void SetUp() override {
    model_ = resolve_model("opt-tiny", {});
    model_.config.num_layers = 4;  // two dense layers and two speculated ones
    std::ifstream in(kText);
    const std::string text((std::istreambuf_iterator<char>(in)), {});
    windows_ = eval_windows({{"calibration", model_.tokenizer->encode(text)}}, 96,
                            model_.config.bos_token_id);
    windows_.resize(3);  // an odd count: the last batch is a partial one
    options_.prefill = 16;
    options_.decode = 80;
    options_.chunk = 32;
    options_.batch = 2;
  }
  PerplexityResult measure(const OffloadOptions& offload) const {
    return measure_perplexity(model_, windows_, options_, offload, Device::Cpu, DType::F16);
  }

  ModelSource model_;
  std::vector<std::vector<int32_t>> windows_;
  PerplexityOptions options_;
};

TEST_F(Perplexity, WindowsAreBosAndConsecutiveText) {
  const std::vector<std::vector<int32_t>> w = eval_windows({{"a", {5, 6, 7, 8, 9, 10, 11}}}, 3, 2);
  EXPECT_EQ(w, (std::vector<std::vector<int32_t>>{{2, 5, 6}, {2, 7, 8}, {2, 9, 10}}));
  EXPECT_TRUE(eval_windows({{"short", {5}}}, 3, 2).empty());
  // Without a BOS (Qwen2's tokenizer adds none) a window is text only.
  EXPECT_EQ(eval_windows({{"a", {5, 6, 7, 8, 9, 10, 11}}}, 3, std::nullopt),
            (std::vector<std::vector<int32_t>>{{5, 6, 7}, {8, 9, 10}}));
}

TEST_F(Perplexity, PoliciesThatReadAllKvAgreeAndInfinigenWithEverythingEqualsFull) {
  OffloadOptions full;
  full.policy = "full";
  const PerplexityResult reference = measure(full);
  EXPECT_EQ(reference.windows, 3);
  EXPECT_EQ(reference.tokens, 3 * 80);
  EXPECT_GT(reference.perplexity(), 1.0);
  EXPECT_NEAR(reference.fetched, 1.0, 1e-12);
  // Chunks of 32 positions over the scored positions 16..95: starts 0, 32, 64.
  EXPECT_EQ(reference.chunk_start, (std::vector<int64_t>{0, 32, 64}));
  EXPECT_EQ(reference.step_fetched.size(), 79u);

  OffloadOptions gpu;
  gpu.policy = "gpu";
  EXPECT_NEAR(measure(gpu).perplexity(), reference.perplexity(), 1e-6 * reference.perplexity());

  OffloadOptions everything;
  everything.policy = "infinigen";
  everything.speculation.alpha = 1e9;
  everything.speculation.max_num_kv = 1000;
  everything.check_recall = true;
  const PerplexityResult all = measure(everything);
  EXPECT_NEAR(all.perplexity(), reference.perplexity(), 1e-6 * reference.perplexity());
  EXPECT_NEAR(all.speculated_fetched, 1.0, 1e-12);
  EXPECT_NEAR(all.mean_recall, 1.0, 1e-9);

  OffloadOptions sparse = everything;
  sparse.speculation.alpha = 0.5;
  sparse.speculation.max_num_kv = 8;
  const PerplexityResult some = measure(sparse);
  EXPECT_LT(some.speculated_fetched, 0.5);
  EXPECT_GT(some.mean_recall, 0.0);
  EXPECT_LT(some.mean_recall, 1.0);
  EXPECT_NE(some.perplexity(), reference.perplexity());
}

TEST(EvalCli, WritesTableCsvJsonAndPlot) {
  TempDir dir("eval-cli");
  const CommandResult r = run_infinigen({"eval",    "--model",  kTiny,
                                         "--text",  kText,      "--prefill",
                                         "32",      "--decode", "64",
                                         "--chunk", "32",       "--max-windows",
                                         "2",       "--policy", "full,infinigen,h2o",
                                         "--alpha", "1,4",      "--h2o-budget",
                                         "0.5",     "--out",    dir.str()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* fragment : {"perplexity", "vs full", "alpha 1", "alpha 4", "budget 0.5"}) {
    EXPECT_NE(r.out.find(fragment), std::string::npos) << fragment << "\n" << r.out;
  }
  for (const char* file : {"eval.csv", "eval.json", "eval.png"}) {
    EXPECT_TRUE(std::filesystem::is_regular_file(dir.path() / file)) << file;
  }
  std::ifstream json_file(dir.path() / "eval.json");
  const nlohmann::json j = nlohmann::json::parse(json_file);
  ASSERT_EQ(j["points"].size(), 4u);  // full, infinigen x 2 alphas, h2o
  EXPECT_EQ(j["windows"], 2);
  EXPECT_EQ(j["points"][0]["policy"], "full");
  EXPECT_EQ(j["points"][0]["vs_full"], 0.0);
  EXPECT_EQ(j["points"][0]["chunk_perplexity"].size(), 2u);  // positions 32..95
}

// `--policy full` on the built-in model scores held-out text as HF transformers does
// (tests/fixtures/builtin-perplexity.json, written by tools/make_hf_perplexity.py; the engine
// keeps KV in fp16, transformers computes in fp32).
TEST(EvalCli, FullPolicyMatchesTransformersOnTheBuiltinModel) {
  std::ifstream fixture_file(std::string(INFINIGEN_FIXTURES_DIR) + "/builtin-perplexity.json");
  ASSERT_TRUE(fixture_file.good());
  const nlohmann::json fixture = nlohmann::json::parse(fixture_file);
  TempDir dir("eval-hf");
  const CommandResult r = run_infinigen(
      {"eval", "--text",
       std::string(INFINIGEN_FIXTURES_DIR) + "/heldout/" + fixture["text"].get<std::string>(),
       "--prefill", std::to_string(fixture["prefill"].get<int>()), "--decode",
       std::to_string(fixture["decode"].get<int>()), "--max-windows",
       std::to_string(fixture["windows"].get<int>()), "--policy", "full", "--json", "--no-plot",
       "--out", dir.str()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  ASSERT_EQ(j["windows"], fixture["windows"]);
  EXPECT_EQ(j["points"][0]["tokens"], fixture["tokens"]);
  const double engine = j["points"][0]["perplexity"], hf = fixture["perplexity"];
  EXPECT_LT(std::fabs(engine / hf - 1.0), 0.005) << "engine " << engine << ", transformers " << hf;
}

// The window count is printed once, in the report, in the singular for one: eval printed it on
// stderr before the run and again as "1 windows" above the table.
TEST(EvalCli, SaysItsWindowCountOnce) {
  TempDir dir("eval-count");
  const CommandResult r =
      run_infinigen({"eval", "--model", kTiny, "--text", kText, "--prefill", "32", "--decode", "32",
                     "--max-windows", "1", "--policy", "full", "--no-plot", "--out", dir.str()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("\n1 window of 64 tokens: 32 prefilled, 32 scored"), std::string::npos)
      << r.out;
  EXPECT_EQ(r.out.find("windows"), std::string::npos) << r.out;
  EXPECT_EQ(r.err.find("window"), std::string::npos) << r.err;
}

// A window past the context: refused by default; otherwise it drops what it and its scored
// tokens pass the context by after the kept prefix, and its first turn (half its prompt) must
// hold the drop.
TEST(EvalOptionsTest, WindowsPastTheContextNeedAModeAndAFirstTurnThatHoldsTheDrop) {
  PerplexityOptions options;
  options.prefill = 200;
  options.decode = 100;
  EXPECT_EQ(options.dropped(256), 44);
  EXPECT_EQ(options.planned_prompt(256), 156);
  expect_error([&] { options.validate(256); },
               {"--prefill 200 plus --decode 100 exceeds", "--past-context runs longer windows"});
  for (const PastContext mode : {PastContext::DropOldest, PastContext::Recompute}) {
    options.past.mode = mode;
    options.prefill = 200;
    options.validate(256);
    options.prefill = 304;  // 2 x (156 - 4): 148 dropped of a first turn of 152
    options.validate(256);
    options.prefill = 305;
    expect_error([&] { options.validate(256); },
                 {"--prefill 305 would drop 149 tokens after the kept 4", "at most 304"});
    options.decode = 0;
    expect_error([&] { options.validate(256); }, {"--decode must be given", "--prefill 305"});
    options.decode = 252;
    options.prefill = 100;
    expect_error([&] { options.validate(256); }, {"--decode 252", "kept prefix of 4"});
    options.decode = 100;
    options.past.keep_prefix = -1;
    expect_error([&] { options.validate(256); }, {"--keep-prefix must be at least 0"});
    options.past.keep_prefix = 4;
  }
}

// Windows past the built-in Llama's context: a conversation that drops its oldest tokens (the
// kept KV moved to new positions) scores the same tokens as a run over the kept tokens computed
// from scratch, within what the moved rows' earlier view of the dropped tokens changes (0.07%
// measured over 4 windows dropping 384 tokens). This checks the plumbing, not the move: held-out
// prose hardly depends on rows a thousand tokens back, and keys left unrotated moved it by 0.3%
// (tests/session_overflow_test.cc checks the moved rows exactly). A policy or model that cannot
// move rows refuses.
TEST(EvalCli, WindowsPastTheContextRunAsATruncatedConversationOrRecomputed) {
  std::map<std::string, double> perplexity;
  for (const std::string mode : {"drop-oldest", "recompute"}) {
    TempDir dir("eval-past");
    const CommandResult r = run_infinigen({"eval",
                                           "--model",
                                           "builtin-llama",
                                           "--text",
                                           kText,
                                           "--prefill",
                                           "2176",
                                           "--decode",
                                           "64",
                                           "--max-windows",
                                           "1",
                                           "--past-context",
                                           mode,
                                           "--keep-prefix",
                                           "8",
                                           "--policy",
                                           "full",
                                           "--json",
                                           "--no-plot",
                                           "--out",
                                           dir.str()});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const nlohmann::json j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["past_context"], mode);
    EXPECT_EQ(j["keep_prefix"], 8);
    EXPECT_EQ(j["points"][0]["tokens"], 64);
    perplexity[mode] = j["points"][0]["perplexity"];
  }
  EXPECT_LT(std::fabs(perplexity["drop-oldest"] / perplexity["recompute"] - 1.0), 0.01)
      << perplexity["drop-oldest"] << " against " << perplexity["recompute"];
  TempDir dir("eval-past");
  for (const auto& [model, policy, fragment] :
       {std::tuple{"builtin", "full", "learns its positions"},
        std::tuple{"builtin-llama", "int4", "the policy int4's saved rows cannot move"}}) {
    expect_one_line_error({"eval", "--model", model, "--text", kText, "--prefill", "2176",
                           "--decode", "64", "--max-windows", "1", "--past-context", "drop-oldest",
                           "--policy", policy, "--no-plot", "--out", dir.str()},
                          {fragment});
  }
}

TEST(EvalCli, BadInputsEndWithOneLine) {
  TempDir dir("eval-bad");
  const std::string out = dir.str();
  const std::string short_text = (dir.path() / "short.txt").string();
  std::ofstream(short_text) << "Only a few words.";
  expect_one_line_error({"eval", "--model", kTiny, "--out", out}, {"--text"});
  expect_one_line_error({"eval", "--model", kTiny, "--text", "/nonexistent/held-out.txt"},
                        {"--text", "/nonexistent/held-out.txt"});
  expect_one_line_error({"eval", "--model", kTiny, "--text", short_text, "--out", out},
                        {short_text, "shorter than one window"});
  expect_one_line_error(
      {"eval", "--model", kTiny, "--text", short_text, "--text", short_text, "--out", out},
      {"no file holds", "one window"});
  expect_one_line_error({"eval", "--model", kTiny, "--text", kText, "--policy", "h3o"},
                        {"--policy", "h3o"});
  expect_one_line_error({"eval", "--model", kTiny, "--text", kText, "--alpha", "-1"}, {"--alpha"});
  expect_one_line_error({"eval", "--model", kTiny, "--text", kText, "--prefill", "0"},
                        {"--prefill"});
  expect_one_line_error(
      {"eval", "--model", kTiny, "--text", kText, "--prefill", "200", "--decode", "100"},
      {"--decode", "context of 256"});
  expect_one_line_error(
      {"eval", "--model", kTiny, "--text", kText, "--eviction", "random", "--kv-pool-limit", "0.5"},
      {"--eviction", "random"});
}

}  // namespace
}  // namespace infinigen
