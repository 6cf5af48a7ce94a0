// tests: the infinigen command line: normal runs on the tiny fixture model, and every bad input
// ending in exactly one line on stderr and a non-zero exit status.
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "core/model_loader.h"
#include "offload/kv_policy.h"
#include "offload/run_summary.h"
#include "tests/test_util.h"

namespace infinigen {
namespace {

using testing_util::CommandResult;
using testing_util::expect_one_line_error;
using testing_util::run_infinigen;
using testing_util::TempDir;

const std::string kTiny = std::string(INFINIGEN_FIXTURES_DIR) + "/opt-tiny";

TEST(Cli, RunPrintsTextAndTimings) {
  const CommandResult r = run_infinigen(
      {"run", "--model", kTiny, "--gen-len", "4", "--prompt", "Hello world", "--batch", "2"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* fragment : {"prefill latency", "decode latency", "throughput", "[2]"}) {
    EXPECT_NE(r.out.find(fragment), std::string::npos) << fragment << "\n" << r.out;
  }
  EXPECT_TRUE(r.err.empty()) << r.err;  // no progress display when stderr is not a terminal
}

// The first thing a user sees: `infinigen run` with no arguments, on the built-in model trained
// on English text, continues each default prompt with words, not one token over and over.
TEST(Cli, DefaultRunWritesWords) {
  const CommandResult r = run_infinigen({"run", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_FALSE(j["synthetic_weights"].get<bool>());
  ASSERT_GE(j["outputs"].size(), 4u);
  for (const nlohmann::json& output : j["outputs"]) {
    const std::string text = output["text"];
    std::map<std::string, int> words;
    std::string word;
    for (char c : text + " ") {
      if (std::isalpha(static_cast<unsigned char>(c))) {
        word += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
      } else if (!word.empty()) {
        ++words[word];
        word.clear();
      }
    }
    EXPECT_GE(words.size(), 5u) << text;  // distinct words
    std::map<int, int> ids;
    int most = 0;
    for (int id : output["tokens"]) most = std::max(most, ++ids[id]);
    EXPECT_LE(2 * most, static_cast<int>(output["tokens"].size())) << text;
  }
}

// A Llama-family checkpoint with its tokenizer.json: the weights of tests/fixtures/llama-tiny
// beside the Llama-3-style or the Qwen2-style fixture tokenizer. The prompt starts with the
// tokenizer's BOS (Llama 3's <|begin_of_text|>; none for Qwen2).
TEST(Cli, LlamaCheckpointsRunWithTheirTokenizerJson) {
  namespace fs = std::filesystem;
  for (const char* form : {"llama3", "qwen2"}) {
    TempDir dir(std::string("llama-") + form);
    const fs::path model = dir.path() / "model";
    fs::copy(std::string(INFINIGEN_FIXTURES_DIR) + "/llama-tiny", model);
    fs::copy(std::string(INFINIGEN_FIXTURES_DIR) + "/tokenizers/" + form, model);
    const CommandResult r =
        run_infinigen({"run", "--model", model.string(), "--prompt", "And the LORD said",
                       "--gen-len", "4", "--temperature", "0", "--json"});
    ASSERT_EQ(r.exit_code, 0) << form << ": " << r.err;
    const nlohmann::json j = nlohmann::json::parse(r.out);
    ASSERT_EQ(j["outputs"].size(), 1u);
    EXPECT_EQ(j["outputs"][0]["tokens"].size(), 4u) << form;
    EXPECT_GE(j["outputs"][0]["prompt_tokens"].get<int>(), 3) << form;
    // Llama 3's <|begin_of_text|> comes first; Qwen2's tokenizer adds no BOS, whatever the
    // config's bos_token_id says.
    const std::optional<int32_t> bos = prompt_bos(resolve_model(model.string(), {}));
    if (std::string(form) == "llama3") {
      EXPECT_EQ(bos, std::optional<int32_t>(1503));
    } else {
      EXPECT_EQ(bos, std::nullopt);
    }
  }
}

TEST(Cli, EveryPolicyRuns) {
  for (const char* policy : {"infinigen", "full", "gpu", "int4", "h2o"}) {
    const CommandResult r = run_infinigen({"run", "--model", kTiny, "--policy", policy,
                                           "--prompt-len", "20", "--gen-len", "3", "--json"});
    ASSERT_EQ(r.exit_code, 0) << policy << ": " << r.err;
    EXPECT_EQ(nlohmann::json::parse(r.out)["policy"], policy);
  }
}

TEST(Cli, JsonOutputIsMachineReadable) {
  const CommandResult r = run_infinigen(
      {"run", "--model", kTiny, "--gen-len", "3", "--prompt-len", "10", "--batch", "3", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["batch"], 3);
  EXPECT_EQ(j["prompt_len"], 10);
  EXPECT_EQ(j["outputs"].size(), 3u);
  EXPECT_EQ(j["outputs"][0]["tokens"].size(), 3u);
  EXPECT_GT(j["throughput_tok_s"].get<double>(), 0.0);
}

// --logprobs K: each output's tokens with their log-probabilities and the K most likely at each
// step, as a batch job writes them; greedy, the chosen token is the most likely. Without it, none.
TEST(Cli, LogprobsListEachTokenWithTheMostLikely) {
  const CommandResult r =
      run_infinigen({"run", "--model", kTiny, "--gen-len", "4", "--prompt-len", "10", "--batch",
                     "2", "--temperature", "0", "--json", "--logprobs", "2"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json report = nlohmann::json::parse(r.out);
  for (const auto& output : report["outputs"]) {
    const nlohmann::json& lp = output["logprobs"];
    const size_t count = output["tokens"].size();
    ASSERT_EQ(lp["tokens"].size(), count);
    ASSERT_EQ(lp["token_logprobs"].size(), count);
    ASSERT_EQ(lp["top_logprobs"].size(), count);
    std::string text;
    for (size_t t = 0; t < count; ++t) {
      EXPECT_EQ(lp["text_offset"][t], text.size());
      text += lp["tokens"][t].get<std::string>();
      const double chosen = lp["token_logprobs"][t];
      const nlohmann::json& top = lp["top_logprobs"][t];
      EXPECT_LE(chosen, 0.0);
      ASSERT_TRUE(top.contains(lp["tokens"][t])) << top;
      EXPECT_LE(top.size(), 2u) << top;
      for (const auto& [other, log_prob] : top.items()) EXPECT_LE(log_prob.get<double>(), chosen);
    }
    EXPECT_EQ(text, output["text"]);
  }
  const CommandResult plain =
      run_infinigen({"run", "--model", kTiny, "--gen-len", "2", "--prompt-len", "10", "--json"});
  ASSERT_EQ(plain.exit_code, 0) << plain.err;
  EXPECT_FALSE(nlohmann::json::parse(plain.out)["outputs"][0].contains("logprobs"));
}

TEST(Cli, ConfigFileSetsOptionsAndCommandLineWins) {
  TempDir dir("cli-config");
  const auto config = dir.path() / "run.yaml";
  std::ofstream(config) << "model: " << kTiny
                        << "\nbatch: 2\ngen-len: 2\nprompt-len: 6\njson: true\n";
  CommandResult r = run_infinigen({"run", "--config", config.string()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out)["batch"], 2);
  r = run_infinigen({"run", "--config", config.string(), "--batch", "3"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out)["batch"], 3);
}

TEST(Cli, PromptFileGivesOneSequencePerLine) {
  TempDir dir("cli-prompts");
  const auto prompts = dir.path() / "prompts.txt";
  std::ofstream(prompts) << "first prompt\nsecond one\n\nthird\n";
  const CommandResult r = run_infinigen(
      {"run", "--model", kTiny, "--prompt-file", prompts.string(), "--gen-len", "2", "--json"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out)["batch"], 3);
}

// inspect takes the built-in models' names as every command does, and says a checkpoint's family
// and its KV heads (it printed every checkpoint as "OPT" and left the KV heads out).
TEST(Cli, InspectNamesTheFamilyAndTheKvHeads) {
  CommandResult r = run_infinigen({"inspect", "builtin-llama"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("family llama:"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("4 heads of 64 (1 KV heads)"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("OPT"), std::string::npos) << r.out;
  r = run_infinigen({"inspect", "builtin"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("family opt:"), std::string::npos) << r.out;
}

TEST(Cli, InspectListsTensors) {
  const CommandResult r = run_infinigen({"inspect", kTiny});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("model.decoder.layers.1.fc2.weight"), std::string::npos);
  EXPECT_NE(r.out.find("every tensor matches the config"), std::string::npos);
}

TEST(Cli, MakeModelWritesALoadableCheckpoint) {
  TempDir dir("cli-make");
  const std::string out = (dir.path() / "m").string();
  CommandResult r =
      run_infinigen({"make-model", "--preset", "opt-tiny", "--out", out, "--seed", "3"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  r = run_infinigen({"run", "--model", out, "--gen-len", "2"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  expect_one_line_error({"make-model", "--preset", "opt-tiny", "--out", out},
                        {out, "not an empty directory"});
}

TEST(Cli, BadFlagsEndWithOneLine) {
  expect_one_line_error({"run", "--model", kTiny, "--batch", "0"}, {"--batch", "at least 1"});
  expect_one_line_error({"run", "--model", kTiny, "--gen-len", "-5"}, {"--gen-len"});
  expect_one_line_error({"run", "--model", kTiny, "--prompt-len", "0"}, {"--prompt-len"});
  expect_one_line_error({"run", "--model", kTiny, "--gen-len", "5000"},
                        {"--gen-len 5000", "context of 256 positions"});
  expect_one_line_error({"run", "--model", kTiny, "--device", "tpu"}, {"--device", "tpu"});
  expect_one_line_error({"run", "--model", kTiny, "--top-p", "1.5"}, {"--top-p"});
  expect_one_line_error({"run", "--model", kTiny, "--kv-dtype", "int3"}, {"int3"});
  expect_one_line_error({"run", "--model", kTiny, "--batch", "many"}, {"--batch"});
  expect_one_line_error({"run", "--model", kTiny, "--logprobs", "2"}, {"--logprobs", "--json"});
  expect_one_line_error({"run", "--model", kTiny, "--json", "--logprobs", "6"},
                        {"--logprobs", "0 to 5", "6"});
  expect_one_line_error({"run", "--no-such-flag"}, {"--no-such-flag"});
  expect_one_line_error({"run", "--model", kTiny, "--prompt", "a", "--prompt-len", "3"},
                        {"--prompt"});
  expect_one_line_error({"run", "--model", kTiny, "--prompt-file", "/nonexistent/prompts.txt"},
                        {"--prompt-file", "/nonexistent/prompts.txt"});
  expect_one_line_error({"run", "--config", "/nonexistent/run.yaml"}, {"/nonexistent/run.yaml"});
  TempDir dir("cli-bad-config");
  const auto config = dir.path() / "run.yaml";
  std::ofstream(config) << "prompt: [hello, {nested: map}]\n";
  expect_one_line_error({"run", "--config", config.string()},
                        {"--config", "each value of option 'prompt'", "single value"});
  std::ofstream(config, std::ios::trunc) << "[batch]: 2\n";
  expect_one_line_error({"run", "--config", config.string()}, {"--config", "plain text"});
}

// A bad command line is refused in the project's words, naming the flag: never the parsing
// library's phrasing, never a value silently wrapped or turned off.
TEST(Cli, FlagErrorsNameTheFlagInOurWords) {
  const std::vector<std::pair<std::vector<std::string>, std::vector<std::string>>> cases = {
      {{"run", "--model", kTiny, "--kv-dtype", "int3"}, {"--kv-dtype", "f16 or f32", "int3"}},
      {{"run", "--model", kTiny, "--kv-dtype", "bf16"}, {"--kv-dtype", "bf16"}},
      {{"run", "--model", kTiny, "--seed", "-1"}, {"--seed", "-1"}},
      {{"run", "--model", kTiny, "--seed", "18446744073709551616"}, {"--seed"}},
      {{"make-model", "--preset", "opt-tiny", "--out", "/tmp/x", "--seed", "-3"}, {"--seed"}},
      {{"make-model", "--preset", "opt-tiny", "--out", "/tmp/x", "--dtype", "f8"}, {"--dtype"}},
      {{"run", "--model", kTiny, "--gen-len", "3", "--gen-len", "4"}, {"--gen-len", "once"}},
      {{"run", "--model", kTiny, "--gen-len"}, {"--gen-len", "needs a value"}},
      {{"run", "--model", kTiny, "--temperature", "warm"}, {"--temperature", "warm", "FLOAT"}},
      {{"run", "--model", kTiny, "--prompt", "a", "--prompt-file", "b"},
       {"--prompt", "--prompt-file", "cannot be used together"}},
      {{"run", "--bogus"}, {"unknown option --bogus", "infinigen run --help"}},
      {{"bogus"}, {"unexpected argument bogus"}},
      // Too slow a link would overflow the emulated wait (it silently turned emulation off).
      {{"run", "--model", kTiny, "--emulate-link-gbps", "1e-30"}, {"--emulate-link-gbps"}},
      {{"run", "--model", kTiny, "--emulate-link-gbps", "1e-400"},
       {"--emulate-link-gbps", "out of range"}},
      {{"run", "--model", kTiny, "--emulate-link-latency-us", "1e12"},
       {"--emulate-link-latency-us"}},
  };
  for (const auto& [args, fragments] : cases) expect_one_line_error(args, fragments);
  TempDir dir("cli-config-key");
  const auto config = dir.path() / "run.yaml";
  std::ofstream(config) << "bogus-key: 3\n";
  expect_one_line_error({"run", "--config", config.string()},
                        {"--config", "bogus-key", "not an option of infinigen run"});
  // No library wording in any of them.
  for (const auto& [args, fragments] : cases) {
    const CommandResult r = run_infinigen(args);
    for (const char* phrase : {"At Most", "required but received", "Could not convert", "INI was",
                               "was not expected", "filesystem error"}) {
      EXPECT_EQ(r.err.find(phrase), std::string::npos) << r.err;
    }
  }
}

// Output that cannot be written (stdout on a full device) fails the command with one line, for
// every command that prints: a report, JSON, a checkpoint's tensors, a list, the help.
TEST(Cli, StdoutOnAFullDeviceIsAFailure) {
  const std::vector<std::vector<std::string>> commands = {
      {"run", "--model", kTiny, "--gen-len", "2"},
      {"run", "--model", kTiny, "--gen-len", "2", "--json"},
      {"inspect", kTiny},
      {"bench", "--list"},
      {"run", "--help"}};
  for (const std::vector<std::string>& args : commands) {
    const testing_util::MeasuredCommand r = testing_util::run_infinigen_measured(
        args, testing_util::ChildOptions{}.stdout_to("/dev/full"));
    EXPECT_EQ(r.exit_code, 1) << args.front() << " " << args[1] << ": " << r.err;
    EXPECT_NE(r.err.find("cannot write the output to stdout"), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
}

// A directory output that cannot be created (its parent is a file) is one line naming it.
TEST(Cli, AnOutputThatCannotBeCreatedIsOneLine) {
  TempDir dir("cli-out-parent");
  const auto file = dir.path() / "a-file";
  std::ofstream(file) << "x";
  const std::string out = (file / "model").string();
  expect_one_line_error({"make-model", "--preset", "opt-tiny", "--out", out},
                        {out, "cannot write"});
  const CommandResult r = run_infinigen({"make-model", "--preset", "opt-tiny", "--out", out});
  EXPECT_EQ(r.err.find("filesystem error"), std::string::npos) << r.err;
}

TEST(Cli, UnknownModelsEndWithOneLine) {
  expect_one_line_error({"run", "--model", "opt-7b"}, {"opt-7b", "opt-6.7b"});
  // 132 GB of fp16 weights: refused before anything is allocated, with the numbers.
  expect_one_line_error({"run", "--model", "opt-66b", "--device", "cpu"},
                        {"does not fit", "GiB", "weights"});
  expect_one_line_error(
      {"run", "--model", "opt-tiny", "--policy", "gpu", "--device-memory", "0.0001"},
      {"does not fit", "the device needs"});
  expect_one_line_error({"run", "--model", kTiny, "--policy", "h3o"}, {"--policy", "h3o"});
  expect_one_line_error({"run", "--model", kTiny, "--weights-gpu-percent", "120"},
                        {"--weights-gpu-percent"});
  expect_one_line_error({"run", "--model", kTiny, "--emulate-link-gbps", "-1"},
                        {"--emulate-link-gbps"});
  expect_one_line_error({"run", "--model", kTiny, "--alpha", "-1"}, {"--alpha"});
  expect_one_line_error({"run", "--model", kTiny, "--partial-ratio", "0"}, {"--partial-ratio"});
  expect_one_line_error({"run", "--model", kTiny, "--partial-ratio", "1.5"}, {"--partial-ratio"});
  expect_one_line_error({"run", "--model", kTiny, "--max-num-kv", "-1"}, {"--max-num-kv"});
  expect_one_line_error({"run", "--model", kTiny, "--partial-index-rule", "kq"},
                        {"--partial-index-rule"});
  expect_one_line_error({"run", "--model", kTiny, "--kv-pool-limit", "0.5", "--policy", "full"},
                        {"--kv-pool-limit", "infinigen"});
  expect_one_line_error({"run", "--model", kTiny, "--kv-pool-limit", "-2"}, {"--kv-pool-limit"});
  expect_one_line_error({"run", "--model", kTiny, "--eviction", "random"}, {"--eviction"});
  expect_one_line_error({"run", "--model", kTiny, "--policy", "h2o", "--h2o-budget", "0"},
                        {"--h2o-budget"});
  expect_one_line_error({"run", "--model", "/nonexistent/model"},
                        {"/nonexistent/model", "no such directory"});
  expect_one_line_error({"make-model", "--preset", "gpt-5", "--out", "/tmp/x"}, {"gpt-5"});
  expect_one_line_error({"inspect", "/nonexistent/model"}, {"/nonexistent/model"});
}

// A copy of the tiny checkpoint, damaged by `damage`, must be refused with one line naming it.
void expect_damaged_checkpoint_refused(
    const std::function<void(const std::filesystem::path&)>& damage,
    const std::vector<std::string>& fragments) {
  TempDir dir("cli-damaged");
  const auto copy = dir.path() / "model";
  std::filesystem::copy(kTiny, copy);
  damage(copy);
  expect_one_line_error({"run", "--model", copy.string(), "--gen-len", "2"}, fragments);
  expect_one_line_error({"inspect", copy.string()}, fragments);
}

TEST(Cli, DamagedCheckpointsEndWithOneLine) {
  namespace fs = std::filesystem;
  expect_damaged_checkpoint_refused(
      [](const fs::path& dir) {
        fs::resize_file(dir / "model.safetensors", fs::file_size(dir / "model.safetensors") / 2);
      },
      {"model.safetensors"});
  expect_damaged_checkpoint_refused(
      [](const fs::path& dir) { fs::remove(dir / "model.safetensors"); }, {"model.safetensors"});
  expect_damaged_checkpoint_refused([](const fs::path& dir) { fs::remove(dir / "config.json"); },
                                    {"config.json"});
  expect_damaged_checkpoint_refused(
      [](const fs::path& dir) {
        // The config now disagrees with the tensors' shapes.
        std::ifstream in(dir / "config.json");
        nlohmann::json config = nlohmann::json::parse(in);
        config["ffn_dim"] = 128;
        std::ofstream(dir / "config.json") << config.dump();
      },
      {"fc1.weight", "(256, 64)", "(128, 64)"});
  expect_damaged_checkpoint_refused(
      [](const fs::path& dir) {
        std::ifstream in(dir / "config.json");
        nlohmann::json config = nlohmann::json::parse(in);
        config["activation_function"] = "gelu";
        std::ofstream(dir / "config.json") << config.dump();
      },
      {"activation_function"});
}

// A NaN in a layer's weight: the run is refused naming the file and the tensor (it once blamed
// the forward pass for a "non-finite logit").
TEST(Cli, NonFiniteWeightsAreNamed) {
  namespace fs = std::filesystem;
  TempDir dir("cli-nan-weight");
  const fs::path copy = dir.path() / "model";
  fs::copy(kTiny, copy);
  std::fstream f(copy / "model.safetensors", std::ios::in | std::ios::out | std::ios::binary);
  uint64_t header = 0;
  f.read(reinterpret_cast<char*>(&header), sizeof header);
  std::string text(header, ' ');
  f.read(text.data(), static_cast<std::streamsize>(header));
  const nlohmann::json tensors = nlohmann::json::parse(text);
  const std::string name = "model.decoder.layers.0.fc1.weight";
  ASSERT_EQ(tensors.at(name).at("dtype"), "F16");
  const uint64_t at = tensors.at(name).at("data_offsets")[0].get<uint64_t>();
  const uint16_t nan = 0x7e00;  // fp16 quiet NaN
  f.seekp(static_cast<std::streamoff>(8 + header + at));
  f.write(reinterpret_cast<const char*>(&nan), sizeof nan);
  f.close();
  expect_one_line_error({"run", "--model", copy.string(), "--gen-len", "2"},
                        {"model.safetensors", name, "nan", "not finite"});
}

// The lines of `text` that contain `fragment`.
std::vector<std::string> lines_with(const std::string& text, const std::string& fragment) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.find(fragment) != std::string::npos) lines.push_back(line);
  }
  return lines;
}

// --check-recall where every layer is dense measures nothing: the report says so (it printed
// nothing at all).
TEST(Cli, CheckRecallSaysWhyNothingWasMeasured) {
  CommandResult r = run_infinigen({"run", "--model", kTiny, "--prompt-len", "20", "--gen-len", "3",
                                   "--check-recall", "--dense-layers", "2"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("recall           not measured: every layer is dense (--dense-layers 2, "
                       "the model has 2)"),
            std::string::npos)
      << r.out;
  // With a speculated layer, the measured recall and no such line.
  r = run_infinigen({"run", "--model", kTiny, "--prompt-len", "20", "--gen-len", "3",
                     "--check-recall", "--dense-layers", "1"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("; recall "), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("not measured"), std::string::npos) << r.out;
}

// make-model writes every preset, Llama-family ones too; its help said "OPT".
TEST(Cli, MakeModelHelpNamesEveryFamily) {
  CommandResult r = run_infinigen({"make-model", "--help"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* preset : {"opt-125m", "llama-2-7b", "llama-3.1-8b", "qwen2.5-7b"}) {
    EXPECT_NE(r.out.find(preset), std::string::npos) << preset << "\n" << r.out;
  }
  EXPECT_NE(r.out.find("OPT or Llama family"), std::string::npos) << r.out;
  r = run_infinigen({"--help"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out.find("synthetic OPT checkpoint"), std::string::npos) << r.out;
}

// Floats print as the decimal they were given (0.8, not 0.800000011920929), and what was not
// measured is null, not -1.
TEST(Cli, JsonHasShortestFloatsAndNullForMissing) {
  const CommandResult r =
      run_infinigen({"run", "--model", kTiny, "--policy", "full", "--prompt-len", "10", "--gen-len",
                     "3", "--temperature", "0.8", "--top-p", "0.9", "--json", "--stats"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_NE(r.out.find("\"temperature\": 0.8,"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("\"top_p\": 0.9\n"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find(": -1"), std::string::npos) << r.out;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["sampling"]["temperature"].get<double>(), 0.8);
  EXPECT_EQ(j["sampling"]["top_p"].get<double>(), 0.9);
  EXPECT_TRUE(j["transfer"]["mean_recall"].is_null()) << j["transfer"];
  EXPECT_TRUE(j["transfer"]["min_layer_recall"].is_null()) << j["transfer"];
  EXPECT_TRUE(j["steps"][1]["layers"][0]["recall"].is_null()) << j["steps"][1];
}

// The load lines of a run's report: the transfer time, and compute's wait split into the
// transfer it waited through (never more than the transfer) and the time before the loads
// began. It printed "loads 0.19 ms/step, 0% hidden (1.17 ms/step exposed)".
TEST(Cli, LoadReportKeepsTheExposedTimeWithinTheTransfer) {
  // Three decode steps: one whose wait is longer than its loads, one that hides most of them.
  OffloadRun run;
  TransferCounters counters;
  run.stats.begin_step(1, counters);  // the prefill
  run.stats.end_step(counters);
  const std::vector<std::pair<double, double>> busy_wait = {{0.2, 1.2}, {1.0, 0.1}, {0, 0}};
  for (const auto& [busy, wait] : busy_wait) {
    run.stats.begin_step(1, counters);
    run.stats.current().load_wait_seconds = wait;
    counters.h2d_busy_seconds += busy;
    run.stats.end_step(counters);
  }
  const TransferSummary s = summarize(run);
  EXPECT_NEAR(s.load_busy_per_step, 1.2 / 3, 1e-12);
  EXPECT_NEAR(s.load_wait_per_step, 1.3 / 3, 1e-12);
  EXPECT_NEAR(s.load_hidden_per_step, 0.9 / 3, 1e-12);  // the second step's
  EXPECT_NEAR(s.load_exposed_per_step(), 0.3 / 3, 1e-12);
  EXPECT_NEAR(s.load_wait_before_start_per_step(), 1.0 / 3, 1e-12);
  EXPECT_NEAR(s.hidden_fraction, 0.75, 1e-12);

  // And as printed by a run whose loads cross an emulated link.
  const CommandResult r =
      run_infinigen({"run", "--model", kTiny, "--policy", "full", "--prompt-len", "40", "--gen-len",
                     "4", "--weights-gpu-percent", "0", "--emulate-link-gbps", "0.5"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::smatch m;
  const std::regex loads(R"(loads +([0-9.]+) ms/step transferring, ([0-9]+)% of it under compute)");
  ASSERT_TRUE(std::regex_search(r.out, m, loads)) << r.out;
  const double transfer = std::stod(m[1]);
  EXPECT_GT(transfer, 0.0);
  const std::regex waits(
      R"(load waits +([0-9.]+) ms/step compute idle: ([0-9.]+) ms on transfers, ([0-9.]+) ms before the loads began)");
  ASSERT_TRUE(std::regex_search(r.out, m, waits)) << r.out;
  EXPECT_LE(std::stod(m[2]), transfer + 0.01) << r.out;
  EXPECT_NEAR(std::stod(m[2]) + std::stod(m[3]), std::stod(m[1]), 0.011) << r.out;
}

// --stats printed "memory plan" above the plan's table, whose header says it again.
TEST(Cli, StatsPrintTheMemoryPlanOnce) {
  const CommandResult r =
      run_infinigen({"run", "--model", kTiny, "--prompt-len", "10", "--gen-len", "3", "--stats"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(lines_with(r.out, "memory plan").size(), 1u) << r.out;
}

// The report's sizes are MiB and GiB (it printed a session's bytes in MB beside MiB), and the
// link's rate says its GB is 10^9 bytes.
TEST(Cli, TheReportUsesOneUnitConvention) {
  TempDir dir("cli-units");
  const std::string session = (dir.path() / "s").string();
  const CommandResult r = run_infinigen({"run", "--model", kTiny, "--prompt-len", "10", "--gen-len",
                                         "3", "--session", session, "--emulate-link-gbps", "8"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const std::string report = r.out.substr(r.out.find("prefill latency"));  // past the texts
  EXPECT_NE(report.find("MiB written"), std::string::npos) << report;
  EXPECT_FALSE(std::regex_search(report, std::regex(R"(\bMB\b)"))) << report;
  EXPECT_NE(r.out.find("8 GB/s (emulated; 1 GB = 10^9 bytes)"), std::string::npos) << r.out;
}

// --policy's help lists the registered policies one per line (it was one paragraph).
TEST(Cli, PolicyHelpListsOnePolicyPerLine) {
  for (const char* command : {"run", "eval"}) {
    const CommandResult r = run_infinigen({command, "--help"});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    for (const KvPolicy* policy : kv_policies()) {
      const std::vector<std::string> lines = lines_with(r.out, policy->help);
      ASSERT_EQ(lines.size(), 1u) << command << ": " << policy->name << "\n" << r.out;
      const std::regex own_line("^ +" + policy->name + " +" + policy->help.substr(0, 10));
      EXPECT_TRUE(std::regex_search(lines[0], own_line)) << command << ": " << lines[0];
    }
  }
}

// A capped pool below a block: it pinned a whole block per row whatever the cap, so a small
// --kv-pool-limit showed no effect, and nothing reported the cap or its evictions.
TEST(Cli, ASmallPoolLimitPinsOnlyItsPositionsAndIsReported) {
  // 32 positions per row, in one block of 32 without a cap.
  const std::vector<std::string> args = {"run", "--model",           kTiny, "--prompt-len",
                                         "20",  "--gen-len",         "12",  "--batch",
                                         "2",   "--kv-block-tokens", "32"};
  const auto with = [&](std::vector<std::string> more) {
    std::vector<std::string> all = args;
    all.insert(all.end(), more.begin(), more.end());
    const CommandResult r = run_infinigen(all);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return r;
  };
  const nlohmann::json whole = nlohmann::json::parse(with({"--json"}).out);
  const nlohmann::json capped =
      nlohmann::json::parse(with({"--json", "--kv-pool-limit", "0.25"}).out);
  EXPECT_TRUE(whole["kv_pool_cap"].is_null()) << whole["kv_pool_cap"];
  const nlohmann::json& cap = capped["kv_pool_cap"];
  ASSERT_TRUE(cap.is_object()) << capped;
  EXPECT_EQ(cap["positions"].get<int64_t>(), 8);  // a quarter of 32
  // The pool holds the cap's 8 positions per row, not a block of 32: a quarter of the whole
  // pool's bytes, as planned.
  const auto bytes = cap["bytes"].get<uint64_t>();
  EXPECT_EQ(bytes * 4, whole["memory_plan"]["host_kv_pool_bytes"].get<uint64_t>());
  EXPECT_EQ(capped["memory_plan"]["host_kv_pool_bytes"].get<uint64_t>(), bytes);
  EXPECT_EQ(capped["transfer"]["host_kv_bytes"].get<uint64_t>(), bytes);
  // Every row kept 8 of its 20 prompt tokens, and decode tokens evicted kept ones.
  EXPECT_GT(cap["prompt_tokens_not_kept"].get<uint64_t>(), 0u);
  EXPECT_GT(cap["evictions"].get<uint64_t>(), 0u);
  // The text report says so too.
  const CommandResult text = with({"--kv-pool-limit", "0.25"});
  EXPECT_NE(text.out.find("KV pool cap      8 positions per sequence and head"), std::string::npos)
      << text.out;
}

}  // namespace
}  // namespace infinigen
