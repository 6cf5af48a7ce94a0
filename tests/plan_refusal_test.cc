// tests: sizes a user typed are checked against the context and the memory plan before anything
// proportional to them is built, so absurd ones are refused at once and in bounded memory, and
// every suggested fix is one the planner accepts.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "core/model_loader.h"
#include "tests/test_util.h"

namespace infinigen {
namespace {

using testing_util::ChildOptions;
using testing_util::command_text;
using testing_util::MeasuredCommand;
using testing_util::run_infinigen_measured;
using testing_util::TempDir;
using testing_util::with_suggestion;

// A refusal must come this fast and stay this small (the sanitizer build's runtime included).
constexpr double kMaxSeconds = 2.0;
constexpr double kMaxPeakRssMib = 300.0;

// Runs `args`, expecting a quick refusal: non-zero exit, one line on stderr holding every
// fragment, within kMaxSeconds and kMaxPeakRssMib. Returns that line.
std::string expect_quick_refusal(const std::vector<std::string>& args,
                                 const std::vector<std::string>& fragments) {
  const MeasuredCommand r =
      testing_util::expect_one_line_failure(args, ChildOptions().timeout(30.0), fragments);
  EXPECT_LT(r.seconds, kMaxSeconds) << command_text(args);
  EXPECT_LT(r.peak_rss_mib, kMaxPeakRssMib) << command_text(args);
  return r.err;
}

// The suggestion in `refusal`, applied to `args` and planned (--dry-run): accepted.
void expect_suggestion_accepted(const std::vector<std::string>& args, const std::string& refusal) {
  std::vector<std::string> fixed = with_suggestion(args, refusal);
  fixed.push_back("--dry-run");
  const MeasuredCommand r = run_infinigen_measured(fixed, ChildOptions().timeout(30.0));
  EXPECT_EQ(r.exit_code, 0) << command_text(fixed) << "\n" << r.err;
  EXPECT_NE(r.out.find("the plan fits"), std::string::npos) << command_text(fixed) << "\n" << r.out;
}

TEST(PlanRefusal, ABillionSequencesAreRefusedAtOnceWithABatchThatFits) {
  const std::vector<std::string> args = {"run", "--batch", "1000000000", "--gen-len", "2"};
  const std::string refusal = expect_quick_refusal(args, {"plan does not fit", "; try --batch "});
  expect_suggestion_accepted(args, refusal);
}

// --dry-run of a plan that does not fit prints the plan, with the capacities and where it is
// short, then the one-line refusal with its suggestion, and fails (it printed only the refusal).
TEST(PlanRefusal, ADryRunShowsThePlanItRefuses) {
  const std::vector<std::string> args = {"run", "--batch", "1000000000", "--gen-len", "2"};
  std::vector<std::string> dry = args;
  dry.push_back("--dry-run");
  const MeasuredCommand r = testing_util::expect_one_line_failure(
      dry, ChildOptions().timeout(30.0), {"plan does not fit", "; try --batch "});
  for (const char* fragment : {"batch 1000000000", "the plan does not fit\n", "  memory plan ",
                               "  KV cache ", "  total ", "  available ", "  does not fit: the "}) {
    EXPECT_NE(r.out.find(fragment), std::string::npos) << fragment << "\n" << r.out;
  }
  EXPECT_EQ(r.out.find("the plan fits"), std::string::npos) << r.out;
  expect_suggestion_accepted(args, r.err);
}

TEST(PlanRefusal, ManySyntheticPromptsAreRefusedAtOnce) {
  const std::vector<std::string> args = {"run", "--batch",   "3000000", "--prompt-len",
                                         "64",  "--gen-len", "2"};
  const std::string refusal = expect_quick_refusal(args, {"plan does not fit", "; try "});
  expect_suggestion_accepted(args, refusal);
}

TEST(PlanRefusal, HugeBlocksAreRefusedWithTheDefaultBlock) {
  const std::vector<std::string> args = {"run", "--kv-block-tokens", "1000000000", "--gen-len",
                                         "2"};
  const std::string refusal =
      expect_quick_refusal(args, {"plan does not fit", "; try --kv-block-tokens 128"});
  expect_suggestion_accepted(args, refusal);
}

TEST(PlanRefusal, LengthsBeyondTheContextAreRefusedAtOnce) {
  expect_quick_refusal({"run", "--prompt-len", "1000000000", "--gen-len", "2"},
                       {"a prompt of 1000000000 tokens", "context of 2048 positions"});
  expect_quick_refusal({"run", "--gen-len", "1000000000"},
                       {"--gen-len 1000000000", "exceeds the model's context of 2048"});
  expect_quick_refusal(
      {"run", "--gen-len", "9223372036854775807", "--prompt-len", "9223372036854775807"},
      {"context of 2048 positions"});
}

// The CPU backend keeps device and host parts in one RAM: a model whose weights alone exceed it
// is refused in those terms, with no suggestion that would be refused in turn.
// A prompt (or shared prefix) of one 8 MB line is refused from its first tokens, not after
// tokenizing it whole (seconds and gigabytes, once).
TEST(PlanRefusal, AHugeLineIsRefusedWithoutTokenizingIt) {
  TempDir dir("huge-line");
  const std::string file = (dir.path() / "line.txt").string();
  std::ofstream(file) << std::string(8u << 20, 'x') << "\n";
  expect_quick_refusal({"run", "--prompt-file", file, "--gen-len", "2"},
                       {"--prompt-file", "prompt 1", "more than 2048 tokens"});
  expect_quick_refusal({"run", "--shared-prefix", file, "--gen-len", "2"},
                       {"--shared-prefix", "more than 2048 tokens"});
}

// A config.json whose layer count the checkpoint cannot hold is refused from the tensors' count,
// before anything per layer is built (10^6 layers took 7.7 s and 2.7 GB, once); inspect too.
TEST(PlanRefusal, AnAbsurdLayerCountIsRefusedFromTheCheckpoint) {
  TempDir dir("absurd-layers");
  const std::filesystem::path model = dir.path() / "model";
  std::filesystem::copy(INFINIGEN_FIXTURES_DIR "/opt-tiny", model);
  std::ifstream in(model / "config.json");
  nlohmann::json config = nlohmann::json::parse(in);
  config["num_hidden_layers"] = 1000000;
  std::ofstream(model / "config.json", std::ios::trunc) << config.dump();
  expect_quick_refusal({"run", "--model", model.string(), "--gen-len", "2"},
                       {"1000000 layers", "tensors", "the checkpoint holds 36"});
  expect_quick_refusal({"inspect", model.string()}, {"1000000 layers", "holds 36"});
}

TEST(PlanRefusal, AModelLargerThanTheHostIsRefusedInThoseTerms) {
  const ModelConfig config = load_preset("opt-66b");
  if (available_host_memory() > config.weight_bytes()) {
    GTEST_SKIP() << "this machine could hold opt-66b's weights";
  }
  const std::string refusal =
      expect_quick_refusal({"run", "--model", "opt-66b", "--device", "cpu", "--batch", "20",
                            "--prompt-len", "1920", "--gen-len", "128"},
                           {"the host cannot hold the weights: opt-66b's weights are "});
  EXPECT_EQ(refusal.find("try "), std::string::npos) << refusal;
}

TEST(PlanRefusal, ABenchPointOfABillionSequencesIsReportedAtOnce) {
  TempDir dir("plan-refusal-bench");
  const std::string experiment = (dir.path() / "huge.yaml").string();
  std::ofstream(experiment) << "figure: \"test\"\n"
                               "title: \"a point far beyond any machine\"\n"
                               "x: batch\n"
                               "plot: latency\n"
                               "repeats: 1\n"
                               "defaults: {model: opt-125m, prompt_len: 64, gen_len: 4}\n"
                               "policies: [infinigen]\n"
                               "points:\n"
                               "  - {batch: 1000000000}\n";
  const MeasuredCommand r = run_infinigen_measured(
      {"bench", "-e", experiment, "--out", (dir.path() / "out").string(), "--no-plot"},
      ChildOptions().timeout(30.0));
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.err.find("does not fit here: plan does not fit"), std::string::npos) << r.err;
  EXPECT_LT(r.seconds, kMaxSeconds);
  EXPECT_LT(r.peak_rss_mib, kMaxPeakRssMib);
}

// eval plans every setting of its sweep first: the one that cannot run is named before the
// others have spent minutes.
TEST(PlanRefusal, AnEvalSettingThatCannotRunIsRefusedBeforeAnyRuns) {
  TempDir dir("plan-refusal-eval");
  const MeasuredCommand r = run_infinigen_measured(
      {"eval", "--text", std::string(INFINIGEN_FIXTURES_DIR) + "/heldout/kjv_Hosea.txt", "--policy",
       "full,infinigen", "--kv-pool-limit", "0.0001", "--out", dir.str()});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("infinigen ("), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("--kv-pool-limit 0.0001 leaves"), std::string::npos) << r.err;
  EXPECT_LT(r.seconds, 20.0);  // the full setting alone takes minutes under the sanitizers
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "eval.csv"));
}

}  // namespace
}  // namespace infinigen
