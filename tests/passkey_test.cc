// tests: `infinigen eval --task passkey`: the prompts (exact length, the needle at its depth, the
// key recoverable, keys drawn per trial and reproducible), the exact-match rule, the Wilson
// interval, the template and options refused with one line, and the task through the CLI.
#include "bench/passkey.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

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

// The built-in model's vocab.json + merges.txt, and two tokenizer.json forms: byte-level
// (Llama-3) and SentencePiece-style (Llama-2), in tests/fixtures/tokenizers.
struct TokenizerCase {
  const char* name;
  Tokenizer load() const {
    if (std::string_view(name) == "builtin") return *resolve_model("builtin", {}).tokenizer;
    return Tokenizer::from_directory(
        (std::filesystem::path(INFINIGEN_FIXTURES_DIR) / "tokenizers" / name).string());
  }
};
const TokenizerCase kTokenizers[] = {{"builtin"}, {"llama3"}, {"llama2"}};
void PrintTo(const TokenizerCase& tokenizer, std::ostream* out) {
  *out << tokenizer.name;
}

class PasskeyPromptTest : public ::testing::TestWithParam<TokenizerCase> {
 protected:
  void SetUp() override {
    tokenizer_.emplace(GetParam().load());
    filler_ = passkey_filler(*tokenizer_, bundled_passkey_filler(), "bundled", 1 << 16);
  }
  std::optional<Tokenizer> tokenizer_;
  PasskeyFiller filler_;
  PasskeyTemplate text_ = PasskeyTemplate::built_in();
  const int32_t bos_ = 2;
};

TEST_P(PasskeyPromptTest, IsExactlyItsLengthWithTheNeedleAtItsDepth) {
  const Tokenizer& tok = *tokenizer_;
  const int64_t fixed = 1 + std::ssize(tok.encode(text_.intro)) +
                        std::ssize(tok.encode(text_.needle_with("71432"))) +
                        std::ssize(tok.encode(text_.question));
  for (const int64_t length : {fixed, fixed + 1, int64_t{200}, int64_t{1000}, int64_t{5000}}) {
    for (const double depth : {0.0, 0.25, 0.5, 0.9, 1.0}) {
      const PasskeyDraw draw{"71432", filler_.line_starts[1]};
      const PasskeyPrompt p = passkey_prompt(tok, bos_, text_, filler_, length, depth, draw);
      SCOPED_TRACE(testing::Message() << "length " << length << ", depth " << depth);
      ASSERT_EQ(std::ssize(p.ids), length);
      EXPECT_EQ(p.ids.front(), bos_);
      // The needle's tokens, after the intro and round(depth * F) filler tokens.
      const std::vector<int32_t> needle = tok.encode(text_.needle_with("71432"));
      const int64_t filler = length - fixed;
      const int64_t intro = std::ssize(tok.encode(text_.intro));
      EXPECT_EQ(p.needle_begin, 1 + intro + std::llround(depth * static_cast<double>(filler)));
      ASSERT_EQ(p.needle_end - p.needle_begin, std::ssize(needle));
      EXPECT_TRUE(std::equal(needle.begin(), needle.end(), p.ids.begin() + p.needle_begin));
      // The key reads back from the prompt's text, between the intro and the question.
      const std::string decoded = tok.decode(p.ids);
      const size_t key_at =
          decoded.find("The secret key is 71432. Remember the secret key: 71432.");
      ASSERT_NE(key_at, std::string::npos) << decoded;
      EXPECT_NE(decoded.find("A secret key is hidden somewhere in the text below."),
                std::string::npos);
      EXPECT_TRUE(decoded.ends_with("What is the secret key? The secret key is")) << decoded;
      const std::vector<int32_t> question = tok.encode(text_.question);
      EXPECT_TRUE(std::equal(question.rbegin(), question.rend(), p.ids.rbegin()));
      EXPECT_EQ(p.answer_tokens, std::ssize(tok.encode(" 71432")));
    }
  }
}

TEST_P(PasskeyPromptTest, AtDepthZeroTheNeedleFollowsTheIntroAndAtOneItPrecedesTheQuestion) {
  const Tokenizer& tok = *tokenizer_;
  const PasskeyDraw draw{"apple", 0};
  const int64_t intro = std::ssize(tok.encode(text_.intro));
  const int64_t question = std::ssize(tok.encode(text_.question));
  const PasskeyPrompt at_start = passkey_prompt(tok, bos_, text_, filler_, 300, 0.0, draw);
  EXPECT_EQ(at_start.needle_begin, 1 + intro);
  const PasskeyPrompt at_end = passkey_prompt(tok, bos_, text_, filler_, 300, 1.0, draw);
  EXPECT_EQ(at_end.needle_end, 300 - question);
  if (std::string_view(GetParam().name) != "llama2") {
    // A byte-level tokenizer's parts decode to the template's text exactly (a SentencePiece-style
    // one adds a space where each part starts).
    EXPECT_NE(tok.decode(at_start.ids).find("Remember it.\n\n\nThe secret key is apple."),
              std::string::npos);
    EXPECT_TRUE(
        tok.decode(at_end.ids)
            .ends_with(
                "Remember the secret key: apple.\n\n\nWhat is the secret key? The secret key is"));
  }
}

INSTANTIATE_TEST_SUITE_P(Tokenizers, PasskeyPromptTest, testing::ValuesIn(kTokenizers),
                         [](const testing::TestParamInfo<TokenizerCase>& test) {
                           return std::string(test.param.name);
                         });

TEST(PasskeyPrompt, FillerIsCycledFromTheTrialsLineAndWithoutBosNoneIsAdded) {
  const Tokenizer tok = *resolve_model("builtin", {}).tokenizer;
  const PasskeyFiller filler =
      passkey_filler(tok, "First line of the filler.\nSecond line.\n", "short", 1000);
  ASSERT_EQ(filler.line_starts.size(), 2u);
  EXPECT_EQ(filler.line_starts[0], 0);
  EXPECT_EQ(tok.decode({filler.ids.begin() + filler.line_starts[1], filler.ids.end()}),
            "Second line.\n");
  const PasskeyPrompt p = passkey_prompt(tok, std::nullopt, PasskeyTemplate::built_in(), filler,
                                         200, 0.5, {"12345", filler.line_starts[1]});
  ASSERT_EQ(p.ids.size(), 200u);
  EXPECT_NE(p.ids.front(), 2);
  const std::string text = tok.decode(p.ids);
  EXPECT_TRUE(
      text.starts_with("A secret key is hidden somewhere in the text below. Remember "
                       "it.\n\nSecond line.\nFirst line of the filler.\nSecond line.\n"))
      << text;
  size_t repeats = 0;
  for (size_t at = text.find("First line"); at != std::string::npos;
       at = text.find("First line", at + 1)) {
    ++repeats;
  }
  EXPECT_GT(repeats, 5u);
  expect_error([&] { passkey_filler(tok, "", "empty.txt", 1000); },
               {"--filler", "empty.txt", "no text"});
}

TEST(PasskeyPrompt, TooShortALengthIsRefused) {
  const Tokenizer tok = *resolve_model("builtin", {}).tokenizer;
  const PasskeyFiller filler = passkey_filler(tok, bundled_passkey_filler(), "bundled", 4096);
  expect_error(
      [&] {
        passkey_prompt(tok, 2, PasskeyTemplate::built_in(), filler, 20, 0.5, {"12345", 0});
      },
      {"--lengths 20", "cannot hold the prompt without filler"});
}

TEST(PasskeyDraws, KeysDifferPerTrialAndRepeatWithTheSeed) {
  const Tokenizer tok = *resolve_model("builtin", {}).tokenizer;
  const PasskeyFiller filler = passkey_filler(tok, bundled_passkey_filler(), "bundled", 4096);
  PasskeyOptions options;
  options.lengths = {128, 256};
  options.depths = {0.0, 0.5};
  options.trials = 20;
  const std::vector<PasskeyCell> cells =
      passkey_cells(tok, 2, PasskeyTemplate::built_in(), filler, options, 2048);
  ASSERT_EQ(cells.size(), 4u);
  std::set<std::string> keys;
  std::set<int32_t> first_filler_tokens;
  for (const PasskeyCell& cell : cells) {
    ASSERT_EQ(cell.prompts.size(), 20u);
    for (const PasskeyPrompt& p : cell.prompts) {
      ASSERT_EQ(std::ssize(p.ids), cell.length);
      ASSERT_EQ(p.key.size(), 5u) << p.key;
      EXPECT_NE(p.key[0], '0');
      EXPECT_EQ(p.key.find_first_not_of("0123456789"), std::string::npos) << p.key;
      keys.insert(p.key);
      first_filler_tokens.insert(p.ids[p.needle_end]);
    }
  }
  EXPECT_EQ(keys.size(), 80u);                 // a key per trial
  EXPECT_GT(first_filler_tokens.size(), 10u);  // the filler starts at different lines

  // The same seed draws the same prompts; another seed others. A cell's keys do not depend on
  // the other cells.
  const std::vector<PasskeyCell> again =
      passkey_cells(tok, 2, PasskeyTemplate::built_in(), filler, options, 2048);
  for (size_t c = 0; c < cells.size(); ++c) {
    for (size_t t = 0; t < cells[c].prompts.size(); ++t) {
      EXPECT_EQ(again[c].prompts[t].ids, cells[c].prompts[t].ids);
    }
  }
  PasskeyOptions one_cell = options;
  one_cell.lengths = {256};
  one_cell.depths = {0.5};
  EXPECT_EQ(
      passkey_cells(tok, 2, PasskeyTemplate::built_in(), filler, one_cell, 2048)[0].prompts[7].key,
      cells[3].prompts[7].key);
  PasskeyOptions reseeded = options;
  reseeded.seed = 1;
  EXPECT_NE(
      passkey_cells(tok, 2, PasskeyTemplate::built_in(), filler, reseeded, 2048)[0].prompts[0].key,
      cells[0].prompts[0].key);

  options.key_kind = PasskeyKeyKind::Word;
  std::set<std::string> words;
  for (const PasskeyCell& cell :
       passkey_cells(tok, 2, PasskeyTemplate::built_in(), filler, options, 2048)) {
    for (const PasskeyPrompt& p : cell.prompts) {
      EXPECT_EQ(p.key.find_first_not_of("abcdefghijklmnopqrstuvwxyz"), std::string::npos);
      words.insert(p.key);
    }
  }
  EXPECT_GT(words.size(), 40u);  // 80 draws from a list of 100 words
}

TEST(PasskeyScore, ExactMatchOfTheKeyAfterLeadingWhitespace) {
  EXPECT_TRUE(passkey_answer_correct(" 71432", "71432"));
  EXPECT_TRUE(passkey_answer_correct(" 71432.", "71432"));
  EXPECT_TRUE(passkey_answer_correct("\n 71432. Remember", "71432"));
  EXPECT_TRUE(passkey_answer_correct("71432", "71432"));
  EXPECT_TRUE(passkey_answer_correct(" apple, and", "apple"));
  EXPECT_FALSE(passkey_answer_correct(" 714321", "71432"));
  EXPECT_FALSE(passkey_answer_correct(" 7143", "71432"));
  EXPECT_FALSE(passkey_answer_correct(" 71433", "71432"));
  EXPECT_FALSE(passkey_answer_correct(" the 71432", "71432"));
  EXPECT_FALSE(passkey_answer_correct(" apples", "apple"));
  EXPECT_FALSE(passkey_answer_correct(" Apple", "apple"));
  EXPECT_FALSE(passkey_answer_correct("", "71432"));
  EXPECT_FALSE(passkey_answer_correct("   ", "71432"));
}

TEST(PasskeyScore, WilsonInterval) {
  const Interval at_90 = wilson_interval(18, 20);
  EXPECT_NEAR(at_90.low, 0.69897, 1e-5);
  EXPECT_NEAR(at_90.high, 0.97213, 1e-5);
  const Interval all = wilson_interval(20, 20);
  EXPECT_NEAR(all.low, 0.83887, 1e-5);
  EXPECT_EQ(all.high, 1.0);
  const Interval none = wilson_interval(0, 20);
  EXPECT_EQ(none.low, 0.0);
  EXPECT_NEAR(none.high, 0.16113, 1e-5);
  const Interval seven = wilson_interval(7, 10);
  EXPECT_NEAR(seven.low, 0.39678, 1e-5);
  EXPECT_NEAR(seven.high, 0.89221, 1e-5);
}

TEST(PasskeyTemplateFile, ReplacesTheStringsItGivesAndIsChecked) {
  const PasskeyTemplate t = PasskeyTemplate::from_json(
      R"({"needle": "\nThe code is {key}.\n", "question": "\nThe code is"})", "t.json");
  EXPECT_EQ(t.intro, PasskeyTemplate::built_in().intro);
  EXPECT_EQ(t.needle_with("123"), "\nThe code is 123.\n");
  EXPECT_EQ(t.question, "\nThe code is");
  expect_error([] { PasskeyTemplate::from_json(R"({"needle": "no key here"})", "t.json"); },
               {"t.json", "needle", "{key}"});
  expect_error(
      [] { PasskeyTemplate::from_json(R"({"needle": "{key}", "answer": "x"})", "t.json"); },
      {"t.json", "unknown field", "answer"});
  expect_error(
      [] { PasskeyTemplate::from_json(R"({"needle": "{key}", "question": "{key}?"})", "t.json"); },
      {"t.json", "only \"needle\""});
  expect_error([] { PasskeyTemplate::from_json(R"({"needle": 5})", "t.json"); },
               {"t.json", "must be a string"});
  expect_error([] { PasskeyTemplate::from_json("[1, 2", "t.json"); }, {"t.json", "JSON object"});
}

// The built-in strings are the file the built-in models' retrieval training reads
// (configs/passkey/template.json, tools/passkey_examples.py), embedded: the eval asks what they
// learned.
TEST(PasskeyTemplateFile, BuiltInStringsAreTheTrainingTemplates) {
  const std::filesystem::path file =
      std::filesystem::path(INFINIGEN_SOURCE_DIR) / "configs/passkey/template.json";
  std::ifstream in(file);
  ASSERT_TRUE(in.good()) << file;
  const std::string json((std::istreambuf_iterator<char>(in)), {});
  const PasskeyTemplate trained = PasskeyTemplate::from_json(json, file.string(), {});
  const PasskeyTemplate& built_in = PasskeyTemplate::built_in();
  EXPECT_EQ(trained.intro, built_in.intro);
  EXPECT_EQ(trained.needle, built_in.needle);
  EXPECT_EQ(trained.question, built_in.question);
  EXPECT_EQ(built_in.needle_with("71432"),
            "\nThe secret key is 71432. Remember the secret key: 71432.\n");
}

TEST(PasskeyOptionsTest, DefaultLengthsSpreadOverTheContextAndBadOnesAreRefused) {
  PasskeyOptions options;
  EXPECT_EQ(options.generated_bound(), 5 + 2 + PasskeyOptions::kExtraTokens);
  EXPECT_EQ(options.lengths_or_default(2048), (std::vector<int64_t>{256, 512, 1024, 1536, 2032}));
  EXPECT_EQ(options.lengths_or_default(256), (std::vector<int64_t>{32, 64, 128, 192, 240}));
  options.validate(2048);
  options.lengths = {2038};
  options.validate(2048);
  options.lengths = {2039};
  expect_error([&] { options.validate(2048); },
               {"--lengths 2039", "context of 2048", "at most 2038"});
  options.lengths = {};
  options.depths = {0.5, 1.5};
  expect_error([&] { options.validate(2048); }, {"--depths", "[0, 1]", "1.5"});
  options.depths = {-0.1};
  expect_error([&] { options.validate(2048); }, {"--depths", "-0.1"});
  options.depths = {0.5, 0.25, 0.5};
  expect_error([&] { options.validate(2048); }, {"--depths", "0.5 twice"});
  options.depths = {0.5};
  options.lengths = {512, 256, 512};
  expect_error([&] { options.validate(2048); }, {"--lengths", "512 twice"});
  options.lengths = {};
  options.trials = 0;
  expect_error([&] { options.validate(2048); }, {"--trials", "at least 1"});
}

// Past the context: a length drops what it and its answer pass the context by, after the kept
// prefix, and its first turn (half of it) must hold that.
TEST(PasskeyOptionsTest, LengthsPastTheContextNeedAModeAndAFirstTurnThatHoldsTheDrop) {
  PasskeyOptions options;
  EXPECT_EQ(options.dropped(2038, 2048), 0);
  EXPECT_EQ(options.dropped(2100, 2048), 62);
  options.lengths = {2100};
  expect_error([&] { options.validate(2048); },
               {"--lengths 2100", "at most 2038", "--past-context runs longer ones"});
  for (const PastContext mode : {PastContext::DropOldest, PastContext::Recompute}) {
    options.past.mode = mode;
    options.past.keep_prefix = 4;
    options.lengths = {2100, 4068};  // 2 x (2038 - 4): 2030 dropped of a first turn of 2034
    options.validate(2048);
    options.lengths = {4069};
    expect_error([&] { options.validate(2048); },
                 {"--lengths 4069 would drop 2031 tokens after the kept 4", "at most 4068"});
    options.past.keep_prefix = -1;
    options.lengths = {};
    expect_error([&] { options.validate(2048); }, {"--keep-prefix must be at least 0"});
  }
  EXPECT_EQ(parse_past_context("drop-oldest"), PastContext::DropOldest);
  expect_error([] { parse_past_context("truncate"); },
               {"--past-context is refuse, drop-oldest or recompute, got 'truncate'"});
}

// Prompts past the built-in Llama's context of 2048 run as two turns whose second drops the oldest
// history (the session's files removed after), or once over the kept tokens; a policy that
// attends to every kept row answers as `full` does; what cannot drop refuses with one line.
TEST(PasskeyCli, LengthsPastTheContextRunAsATruncatedConversationOrRecomputed) {
  for (const std::string mode : {"drop-oldest", "recompute"}) {
    TempDir dir("passkey-past");
    const CommandResult r =
        run_infinigen({"eval",      "--task",         "passkey",   "--model",       "builtin-llama",
                       "--lengths", "1024,2100",      "--depths",  "0.5,1",         "--trials",
                       "2",         "--past-context", mode,        "--keep-prefix", "8",
                       "--policy",  "full,infinigen", "--alpha",   "1e9",           "--max-num-kv",
                       "1000",      "--json",         "--no-plot", "--out",         dir.str()});
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const nlohmann::json j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["past_context"], mode);
    EXPECT_EQ(j["keep_prefix"], 8);
    ASSERT_EQ(j["points"].size(), 2u);
    for (const nlohmann::json& point : j["points"]) {
      EXPECT_EQ(point["trials"], 8) << mode;
      EXPECT_EQ(point["cells"], j["points"][0]["cells"]) << mode;
    }
  }
  TempDir dir("passkey-past");
  for (const auto& [model, policy, fragment] :
       {std::tuple{"builtin", "full", "learns its positions"},
        std::tuple{"builtin-llama", "int4", "the policy int4's saved rows cannot move"},
        std::tuple{"builtin-llama", "h2o", "the policy h2o's saved rows cannot move"}}) {
    const CommandResult r =
        run_infinigen({"eval", "--task", "passkey", "--model", model, "--lengths", "2100",
                       "--depths", "1", "--trials", "1", "--past-context", "drop-oldest",
                       "--policy", policy, "--no-plot", "--out", dir.str()});
    EXPECT_NE(r.exit_code, 0) << policy;
    EXPECT_NE(r.err.find(fragment), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
}

TEST(PasskeyCli, WritesTablesCsvJsonAndHeatMaps) {
  TempDir dir("passkey-cli");
  const std::vector<std::string> task = {"eval", "--task",    "passkey", "--model",
                                         kTiny,  "--lengths", "64,96",   "--depths",
                                         "0,1",  "--trials",  "3"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = task;
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  };
  // InfiniGen selects every token of its one speculated layer (opt-tiny has two layers).
  const CommandResult r =
      run_infinigen(with({"--policy", "full,gpu,infinigen", "--alpha", "1e9", "--max-num-kv",
                          "1000", "--dense-layers", "1", "--out", dir.str()}));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* fragment :
       {"passkey retrieval: 2 lengths x 2 depths, 3 trials per cell", "95% Wilson interval",
        "\nfull\n", "\ngpu\n", "infinigen (alpha", "      64 ", "      96 ", "score "}) {
    EXPECT_NE(r.out.find(fragment), std::string::npos) << fragment << "\n" << r.out;
  }
  for (const char* file : {"eval.csv", "eval.json", "eval.png"}) {
    EXPECT_TRUE(std::filesystem::is_regular_file(dir.path() / file)) << file;
  }
  std::ifstream json_file(dir.path() / "eval.json");
  const nlohmann::json j = nlohmann::json::parse(json_file);
  EXPECT_EQ(j["task"], "passkey");
  EXPECT_EQ(j["lengths"], nlohmann::json({64, 96}));
  EXPECT_EQ(j["interval"]["at_100"]["correct"], 3);
  ASSERT_EQ(j["points"].size(), 3u);
  for (const nlohmann::json& point : j["points"]) {
    ASSERT_EQ(point["cells"].size(), 4u);
    EXPECT_EQ(point["trials"], 12);
    int64_t correct = 0;
    for (const nlohmann::json& cell : point["cells"]) {
      EXPECT_EQ(cell["trials"], 3);
      correct += cell["correct"].get<int64_t>();
      EXPECT_LE(cell["wilson_low"].get<double>(), cell["score"].get<double>());
      EXPECT_GE(cell["wilson_high"].get<double>(), cell["score"].get<double>());
    }
    EXPECT_EQ(point["correct"], correct);
    // Every policy that attends to all of the KV generates the same answers.
    EXPECT_EQ(point["cells"], j["points"][0]["cells"]);
    EXPECT_EQ(point["misses"], j["points"][0]["misses"]);
    // InfiniGen's first decode step fetched the whole needle at its speculated layer.
    if (point["policy"] == "infinigen") {
      EXPECT_EQ(point["layer_needle_fetched"], nlohmann::json({nullptr, 1.0}));
    } else {
      EXPECT_FALSE(point.contains("layer_needle_fetched"));
    }
  }
  EXPECT_NE(r.out.find("needle fetched at the first step, by layer: 1 100"), std::string::npos)
      << r.out;
  std::ifstream csv_file(dir.path() / "eval.csv");
  std::string line;
  int rows = 0;
  while (std::getline(csv_file, line)) ++rows;
  EXPECT_EQ(rows, 1 + 3 * 4);

  // Trials decoded one at a time generate what they do in batches.
  TempDir alone("passkey-batch");
  const CommandResult one = run_infinigen(
      with({"--policy", "full", "--batch", "1", "--json", "--no-plot", "--out", alone.str()}));
  ASSERT_EQ(one.exit_code, 0) << one.err;
  const nlohmann::json k = nlohmann::json::parse(one.out);
  EXPECT_EQ(k["points"][0]["cells"], j["points"][0]["cells"]);
  EXPECT_EQ(k["points"][0]["misses"], j["points"][0]["misses"]);
}

TEST(PasskeyCli, BadInputsEndWithOneLine) {
  TempDir dir("passkey-bad");
  const std::string out = dir.str();
  const std::string empty = (dir.path() / "empty.txt").string();
  std::ofstream(empty) << "";
  const std::string keyless = (dir.path() / "keyless.json").string();
  std::ofstream(keyless) << R"({"needle": "The secret is here."})";
  const std::vector<std::string> task = {"eval",  "--task", "passkey",   "--model",  kTiny,
                                         "--out", out,      "--no-plot", "--trials", "1"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> args = task;
    args.insert(args.end(), extra.begin(), extra.end());
    return args;
  };
  expect_one_line_error(
      {"eval", "--task", "passkey", "--model", std::string(INFINIGEN_FIXTURES_DIR) + "/llama-tiny"},
      {"no tokenizer"});
  expect_one_line_error(with({"--lengths", "300"}), {"--lengths 300", "context of 256"});
  expect_one_line_error(with({"--lengths", "10"}), {"--lengths 10", "without filler"});
  expect_one_line_error(with({"--depths", "0,1.5"}), {"--depths", "1.5"});
  expect_one_line_error(with({"--trials", "0"}), {"--trials"});
  expect_one_line_error(with({"--filler", "/nonexistent/filler.txt"}),
                        {"--filler", "/nonexistent/filler.txt"});
  expect_one_line_error(with({"--filler", empty}), {"--filler", empty, "no text"});
  expect_one_line_error(with({"--passkey-template", keyless}),
                        {"--passkey-template", keyless, "{key}"});
  expect_one_line_error(with({"--passkey-template", "/nonexistent/t.json"}),
                        {"--passkey-template", "/nonexistent/t.json"});
  expect_one_line_error(with({"--key-kind", "emoji"}), {"--key-kind", "emoji"});
  expect_one_line_error(with({"--text", kTiny + "/vocab.json"}), {"--text", "--task perplexity"});
  expect_one_line_error({"eval", "--model", kTiny, "--lengths", "64"},
                        {"--lengths", "--task passkey"});
  expect_one_line_error({"eval", "--task", "haystack"}, {"--task", "haystack"});
}

}  // namespace
}  // namespace infinigen
