// tests: the BPE tokenizers (vocab.json + merges.txt, tokenizer.json) against HF tokenizers'
// reference encodings.
#include "core/tokenizer.h"

#include <gtest/gtest.h>

#include <algorithm>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/error.h"

namespace infinigen {
namespace {

struct Case {
  std::string text;
  std::vector<int32_t> ids;
  std::string decoded;
};

const std::vector<Case>& fixture_cases() {
  static const std::vector<Case> cases = [] {
    std::ifstream in(INFINIGEN_FIXTURES_DIR "/tokenizer_cases.json");
    EXPECT_TRUE(in.good()) << "missing fixture tokenizer_cases.json";
    std::vector<Case> out;
    if (!in.good()) return out;
    for (const auto& item : nlohmann::json::parse(in)) {
      out.push_back({item.at("text").get<std::string>(), item.at("ids").get<std::vector<int32_t>>(),
                     item.at("decoded").get<std::string>()});
    }
    return out;
  }();
  return cases;
}

std::string disk_directory() {
  return INFINIGEN_SOURCE_DIR "/configs/tokenizer";
}

// Message of the Error that `body` throws, or "" (and a test failure) if it throws none.
std::string error_of(const std::function<void()>& body) {
  try {
    body();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an infinigen::Error";
  return "";
}

// Python's bytes.decode("utf-8", errors="replace"), written from the table of well-formed byte
// sequences in the Unicode standard (Table 3-7) independently of the tokenizer's decoder.
std::string python_lossy(const std::string& bytes) {
  struct Form {
    unsigned char lead_lo, lead_hi, second_lo, second_hi;
    int length;
  };
  static constexpr Form kForms[] = {
      {0x00, 0x7F, 0, 0, 1},       {0xC2, 0xDF, 0x80, 0xBF, 2}, {0xE0, 0xE0, 0xA0, 0xBF, 3},
      {0xE1, 0xEC, 0x80, 0xBF, 3}, {0xED, 0xED, 0x80, 0x9F, 3}, {0xEE, 0xEF, 0x80, 0xBF, 3},
      {0xF0, 0xF0, 0x90, 0xBF, 4}, {0xF1, 0xF3, 0x80, 0xBF, 4}, {0xF4, 0xF4, 0x80, 0x8F, 4},
  };
  std::string out;
  size_t i = 0;
  while (i < bytes.size()) {
    const auto lead = static_cast<unsigned char>(bytes[i]);
    const Form* form = nullptr;
    for (const Form& f : kForms) {
      if (lead >= f.lead_lo && lead <= f.lead_hi) form = &f;
    }
    if (form == nullptr) {
      out += "\xEF\xBF\xBD";
      ++i;
      continue;
    }
    int good = 1;  // bytes of the sequence that are well-formed so far
    while (good < form->length && i + good < bytes.size()) {
      const auto c = static_cast<unsigned char>(bytes[i + good]);
      const bool ok =
          good == 1 ? (c >= form->second_lo && c <= form->second_hi) : (c >= 0x80 && c <= 0xBF);
      if (!ok) break;
      ++good;
    }
    if (good == form->length) {
      out += bytes.substr(i, good);
    } else {
      out += "\xEF\xBF\xBD";
    }
    i += good;
  }
  return out;
}

bool is_valid_utf8(const std::string& s) {
  return python_lossy(s) == s;
}

// The token of byte `b` alone: GPT-2's byte -> character table, as UTF-8.
std::string byte_token(unsigned char b) {
  int next = 256, cp = 0;
  for (int c = 0; c <= b; ++c) {
    const bool printable = (c >= '!' && c <= '~') || (c >= 0xA1 && c <= 0xAC) || c >= 0xAE;
    cp = printable ? c : next++;
  }
  if (cp < 0x80) return std::string(1, static_cast<char>(cp));
  return {static_cast<char>(0xC0 | (cp >> 6)), static_cast<char>(0x80 | (cp & 0x3F))};
}

TEST(Tokenizer, FixtureIsPresent) {
  EXPECT_GE(fixture_cases().size(), 60u);
}

TEST(Tokenizer, MatchesReferenceEncodings) {
  const Tokenizer tokenizer = Tokenizer::bundled();
  for (const Case& c : fixture_cases()) {
    EXPECT_EQ(tokenizer.encode(c.text), c.ids) << "text " << nlohmann::json(c.text).dump();
    EXPECT_EQ(tokenizer.decode(c.ids), c.decoded) << "text " << nlohmann::json(c.text).dump();
  }
}

TEST(Tokenizer, BundledEqualsDirectoryOnDisk) {
  const Tokenizer bundled = Tokenizer::bundled();
  const Tokenizer disk = Tokenizer::from_directory(disk_directory());
  EXPECT_EQ(bundled.vocab_size(), disk.vocab_size());
  for (const Case& c : fixture_cases()) EXPECT_EQ(bundled.encode(c.text), disk.encode(c.text));
  for (const char* token : {"<s>", "<pad>", "</s>", "<unk>", "\xC4\xA0the", "e"}) {
    EXPECT_EQ(bundled.token_to_id(token), disk.token_to_id(token)) << token;
  }
}

TEST(Tokenizer, BundledVocabularyLayout) {
  const Tokenizer tokenizer = Tokenizer::bundled();
  EXPECT_EQ(tokenizer.vocab_size(), 8192);
  EXPECT_EQ(tokenizer.token_to_id("<s>"), 0);
  EXPECT_EQ(tokenizer.token_to_id("<pad>"), 1);
  EXPECT_EQ(tokenizer.token_to_id("</s>"), 2);
  EXPECT_EQ(tokenizer.token_to_id("<unk>"), 3);
  EXPECT_EQ(tokenizer.token_to_id("not a token at all"), std::nullopt);
  // Every byte has a token of its own, so any input can be encoded.
  for (int b = 0; b < 256; ++b) {
    EXPECT_TRUE(tokenizer.token_to_id(byte_token(static_cast<unsigned char>(b)))) << b;
  }
}

// encode_bounded: a text within reach is encode()'s exactly; one far beyond `limit` stops at a
// head whose tokens pass the limit and begin as the whole text's do.
TEST(Tokenizer, EncodeBoundedStopsEarlyOnlyBeyondTheLimit) {
  const Tokenizer tokenizer = Tokenizer::bundled();
  std::ifstream corpus(INFINIGEN_SOURCE_DIR "/configs/calibration.txt", std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(corpus)), {});
  const std::vector<int32_t> whole = tokenizer.encode(text);
  EXPECT_EQ(tokenizer.encode_bounded(text, whole.size()), whole);
  EXPECT_EQ(tokenizer.encode_bounded("a short prompt", 4), tokenizer.encode("a short prompt"));
  const size_t limit = 20;
  ASSERT_GT(text.size(), (limit + 65) * Tokenizer::kBoundedBytesPerToken);
  const std::vector<int32_t> head = tokenizer.encode_bounded(text, limit);
  EXPECT_GT(head.size(), limit);
  EXPECT_LT(head.size(), whole.size());
  EXPECT_TRUE(std::equal(head.begin(), head.begin() + static_cast<std::ptrdiff_t>(limit),
                         whole.begin()));
}

TEST(Tokenizer, RoundTripsValidText) {
  const Tokenizer tokenizer = Tokenizer::bundled();
  for (const Case& c : fixture_cases()) {
    ASSERT_TRUE(is_valid_utf8(c.text));
    EXPECT_EQ(tokenizer.decode(tokenizer.encode(c.text)), c.text)
        << "text " << nlohmann::json(c.text).dump();
  }
  std::ifstream corpus(INFINIGEN_SOURCE_DIR "/configs/calibration.txt", std::ios::binary);
  const std::string text((std::istreambuf_iterator<char>(corpus)), {});
  ASSERT_GT(text.size(), 10000u);
  const std::vector<int32_t> ids = tokenizer.encode(text);
  EXPECT_EQ(tokenizer.decode(ids), text);
  // A tokenizer trained on this text compresses it well below one token per 3 bytes.
  EXPECT_LT(ids.size() * 3, text.size());
}

TEST(Tokenizer, DecodeRendersUnknownIdsAndSkipsSpecialOnes) {
  const Tokenizer tokenizer = Tokenizer::bundled();
  const std::vector<int32_t> hi = tokenizer.encode("Hi");
  const std::vector<int32_t> there = tokenizer.encode(" there");
  std::vector<int32_t> ids = {0};
  ids.insert(ids.end(), hi.begin(), hi.end());
  ids.push_back(2);
  ids.push_back(1);
  ids.insert(ids.end(), there.begin(), there.end());
  ids.push_back(3);
  EXPECT_EQ(tokenizer.decode(ids), "Hi there");
  EXPECT_EQ(tokenizer.decode(ids, /*skip_special=*/false), "<s>Hi</s><pad> there<unk>");

  const int32_t n = tokenizer.vocab_size();
  std::vector<int32_t> odd = hi;
  odd.push_back(n);
  odd.push_back(-1);
  odd.push_back(1000000);
  EXPECT_EQ(tokenizer.decode(odd), cat("Hi<id ", n, "><id -1><id 1000000>"));
  EXPECT_EQ(tokenizer.decode({}), "");
}

TEST(Tokenizer, DecodeJoinsCharactersSplitAcrossTokens) {
  const Tokenizer tokenizer = Tokenizer::bundled();
  const std::string text = "\xF0\x9F\x98\x80";  // U+1F600, four byte tokens
  const std::vector<int32_t> ids = tokenizer.encode(text);
  ASSERT_EQ(ids.size(), 4u);
  EXPECT_EQ(tokenizer.decode(ids), text);
  // Alone, a partial character is replaced like Python's errors="replace" does.
  EXPECT_EQ(tokenizer.decode({ids[0], ids[1]}), "\xEF\xBF\xBD");
  EXPECT_EQ(tokenizer.decode({ids[1]}), "\xEF\xBF\xBD");
  // An unknown id between the halves splits them.
  EXPECT_EQ(tokenizer.decode({ids[0], ids[1], -7, ids[2], ids[3]}),
            "\xEF\xBF\xBD<id -7>\xEF\xBF\xBD\xEF\xBF\xBD");
}

// Invalid UTF-8 cannot reach HF from Python (a str is always valid), so the contract is the one
// of a lossy decode: encode keeps every byte (each invalid byte becomes its byte token and the
// pattern treats it like U+FFFD), and decode replaces the invalid bytes like Python does.
TEST(Tokenizer, InvalidUtf8KeepsBytesAndDecodesLikePython) {
  const Tokenizer tokenizer = Tokenizer::bundled();
  for (int b = 0x80; b < 0x100; ++b) {
    const std::string byte(1, static_cast<char>(b));
    EXPECT_EQ(
        tokenizer.encode(byte),
        std::vector<int32_t>{*tokenizer.token_to_id(byte_token(static_cast<unsigned char>(b)))})
        << b;
  }
  // Expected strings from Python 3: bytes.decode("utf-8", errors="replace").
  const std::pair<std::string, std::string> known[] = {
      {"\xFF", "\xEF\xBF\xBD"},
      {"abc\x80"
       "def",
       "abc\xEF\xBF\xBD"
       "def"},
      {"\xE0\x80", "\xEF\xBF\xBD\xEF\xBF\xBD"},
      {"\xE2\x82", "\xEF\xBF\xBD"},
      {"\xE2\x82 x", "\xEF\xBF\xBD x"},
      {"\xC0\xAF", "\xEF\xBF\xBD\xEF\xBF\xBD"},
      {"\xED\xA0\x80", "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"},
      {"\xF4\x90\x80\x80", "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"},
      {"\xF0\x9F\x98", "\xEF\xBF\xBD"},
      {"it\xFF's", "it\xEF\xBF\xBD's"},
  };
  for (const auto& [bytes, expected] : known) {
    EXPECT_EQ(python_lossy(bytes), expected);
    EXPECT_EQ(tokenizer.decode(tokenizer.encode(bytes)), expected);
  }
  // Valid text around an invalid byte is split where HF splits text around U+FFFD.
  const std::vector<int32_t> hello = tokenizer.encode("hello");
  const std::vector<int32_t> bad = tokenizer.encode("\xFF");
  const std::vector<int32_t> world = tokenizer.encode(" world");
  std::vector<int32_t> joined = hello;
  joined.insert(joined.end(), bad.begin(), bad.end());
  joined.insert(joined.end(), world.begin(), world.end());
  EXPECT_EQ(tokenizer.encode("hello\xFF world"), joined);

  std::mt19937 rng(1234);
  std::uniform_int_distribution<int> length(0, 40);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_int_distribution<int> ascii(0x20, 0x7E);
  for (int trial = 0; trial < 2000; ++trial) {
    std::string s;
    const int n = length(rng);
    for (int i = 0; i < n; ++i) {
      s.push_back(
          static_cast<char>(trial % 2 == 0 ? byte(rng) : (i % 5 == 0 ? byte(rng) : ascii(rng))));
    }
    const std::vector<int32_t> ids = tokenizer.encode(s);
    EXPECT_EQ(tokenizer.decode(ids), python_lossy(s)) << "trial " << trial;
    // One token per byte at most: bytes are never dropped or invented.
    EXPECT_LE(ids.size(), s.size());
  }
}

TEST(Tokenizer, EncodeIsSafeFromManyThreads) {
  const Tokenizer tokenizer = Tokenizer::bundled();
  const std::vector<Case>& cases = fixture_cases();
  std::vector<std::thread> threads;
  std::vector<int> mismatches(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 5; ++round) {
        for (const Case& c : cases) {
          if (tokenizer.encode(c.text) != c.ids) ++mismatches[t];
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(mismatches, std::vector<int>(4, 0));
}

TEST(Tokenizer, TinyVocabularyAppliesMergesByRank) {
  // "a b" has the better rank, so "abc" becomes "ab" + "c" although "bc" exists too.
  const std::string vocab = R"({"a": 0, "b": 1, "c": 2, "ab": 3, "bc": 4, "abc": 5, "Ġ": 6})";
  const Tokenizer first = Tokenizer::from_strings(vocab, "#version: 0.2\na b\nb c\nab c\n", "t");
  EXPECT_EQ(first.encode("abc"), (std::vector<int32_t>{5}));
  EXPECT_EQ(first.encode("abcbc"), (std::vector<int32_t>{5, 4}));
  const Tokenizer second = Tokenizer::from_strings(vocab, "b c\r\na b\r\n\r\n", "t");
  EXPECT_EQ(second.encode("abc"), (std::vector<int32_t>{0, 4}));
  // Bytes without a token are dropped, as HF's BPE does when it has no unknown token.
  EXPECT_EQ(second.encode("a z"), (std::vector<int32_t>{0, 6}));
  EXPECT_EQ(second.vocab_size(), 7);
}

class TokenizerFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           cat("infinigen_tokenizer_test_", ::testing::UnitTest::GetInstance()->random_seed(), "_",
               ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  void write(const std::string& name, const std::string& content) {
    std::ofstream(dir_ / name, std::ios::binary) << content;
  }
  std::string dir() const { return dir_.string(); }

  std::filesystem::path dir_;
};

constexpr const char* kVocab = R"({"<s>": 0, "a": 1, "b": 2, "ab": 3})";

TEST_F(TokenizerFiles, LoadsAValidDirectory) {
  write("vocab.json", kVocab);
  write("merges.txt", "#version: 0.2\na b\n");
  const Tokenizer tokenizer = Tokenizer::from_directory(dir() + "/");
  EXPECT_EQ(tokenizer.encode("abba"), (std::vector<int32_t>{3, 2, 1}));
}

TEST_F(TokenizerFiles, MissingDirectoryOrFile) {
  const std::string missing = dir() + "/nowhere";
  std::string message = error_of([&] { Tokenizer::from_directory(missing); });
  EXPECT_NE(message.find(missing), std::string::npos) << message;
  EXPECT_NE(message.find("vocab.json"), std::string::npos) << message;
  EXPECT_NE(message.find("no such"), std::string::npos) << message;

  message = error_of([&] { Tokenizer::from_directory(dir()); });
  EXPECT_NE(message.find(dir() + "/vocab.json: no such file"), std::string::npos) << message;

  write("vocab.json", kVocab);
  message = error_of([&] { Tokenizer::from_directory(dir()); });
  EXPECT_NE(message.find(dir() + "/merges.txt: no such file"), std::string::npos) << message;
}

TEST_F(TokenizerFiles, MalformedVocabulary) {
  write("merges.txt", "");
  write("vocab.json", R"({"a": 0, "b": )");
  std::string message = error_of([&] { Tokenizer::from_directory(dir()); });
  EXPECT_NE(message.find(dir() + "/vocab.json: malformed JSON"), std::string::npos) << message;
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;

  write("vocab.json", R"(["a", "b"])");
  message = error_of([&] { Tokenizer::from_directory(dir()); });
  EXPECT_NE(message.find("vocab.json: expected a JSON object"), std::string::npos) << message;
}

TEST(TokenizerErrors, BadVocabularyIds) {
  std::string message =
      error_of([] { Tokenizer::from_strings(R"({"a": 0, "b": "1"})", "", "here"); });
  EXPECT_NE(message.find("here/vocab.json: the id of token \"b\" is not an integer"),
            std::string::npos)
      << message;
  message = error_of([] { Tokenizer::from_strings(R"({"a": 0, "b": 1.5})", "", "here"); });
  EXPECT_NE(message.find("is not an integer"), std::string::npos) << message;
  message = error_of([] { Tokenizer::from_strings(R"({"a": -1})", "", "here"); });
  EXPECT_NE(message.find("is out of range"), std::string::npos) << message;
  message = error_of([] { Tokenizer::from_strings(R"({"a": 99999999999})", "", "here"); });
  EXPECT_NE(message.find("is out of range"), std::string::npos) << message;
  message = error_of([] { Tokenizer::from_strings(R"({"a": 0, "b": 7777777})", "", "here"); });
  EXPECT_NE(message.find("here/vocab.json: ids reach 7777777 but only 2 tokens are given"),
            std::string::npos)
      << message;
  message = error_of([] { Tokenizer::from_strings(R"({"a": 0, "b": 0})", "", "here"); });
  EXPECT_NE(message.find("here/vocab.json: tokens \"a\" and \"b\" both have id 0"),
            std::string::npos)
      << message;
}

TEST(TokenizerErrors, BadMerges) {
  std::string message =
      error_of([] { Tokenizer::from_strings(kVocab, "#version: 0.2\na b\na b ab\n", "here"); });
  EXPECT_NE(message.find("here/merges.txt:3: expected two tokens"), std::string::npos) << message;
  EXPECT_NE(message.find("found 3 parts"), std::string::npos) << message;

  message = error_of([] { Tokenizer::from_strings(kVocab, "ab\n", "here"); });
  EXPECT_NE(message.find("here/merges.txt:1: expected two tokens"), std::string::npos) << message;

  message = error_of([] { Tokenizer::from_strings(kVocab, "a b\nb c\n", "here"); });
  EXPECT_NE(message.find("here/merges.txt:2: token \"c\" is not in the vocabulary"),
            std::string::npos)
      << message;

  message = error_of([] { Tokenizer::from_strings(kVocab, "b a\n", "here"); });
  EXPECT_NE(message.find("here/merges.txt:1: merged token \"ba\" is not in the vocabulary"),
            std::string::npos)
      << message;
}

// ---- tokenizer.json ----------------------------------------------------------------------------

// tests/fixtures/tokenizers: five small tokenizers in the tokenizer.json forms of Llama-3, Qwen2,
// Llama-2, Mistral and a Metaspace-only one, and what HF tokenizers makes of the stress strings
// with each (tools/make_tokenizer_json_fixtures.py).
struct JsonCase {
  std::string text;
  std::vector<int32_t> ids;
  std::string decoded;
  std::string decoded_with_special;
};
struct JsonFixture {
  std::vector<int32_t> bos_ids;  // what HF's post-processor puts around an empty text
  std::vector<JsonCase> cases;
  std::vector<JsonCase> decode_cases;  // ids no encoding gives (cut characters, random ids)
};

const std::map<std::string, JsonFixture>& json_fixtures() {
  static const std::map<std::string, JsonFixture> fixtures = [] {
    std::ifstream in(INFINIGEN_FIXTURES_DIR "/tokenizers/cases.json");
    EXPECT_TRUE(in.good()) << "missing fixture tokenizers/cases.json";
    std::map<std::string, JsonFixture> out;
    if (!in.good()) return out;
    const nlohmann::json root = nlohmann::json::parse(in);
    for (const auto& [name, entry] : root.items()) {
      JsonFixture& fixture = out[name];
      fixture.bos_ids = entry.at("bos_ids").get<std::vector<int32_t>>();
      for (const auto& item : entry.at("cases")) {
        fixture.cases.push_back({item.at("text").get<std::string>(),
                                 item.at("ids").get<std::vector<int32_t>>(),
                                 item.at("decoded").get<std::string>(),
                                 item.at("decoded_with_special").get<std::string>()});
      }
      for (const auto& item : entry.at("decode_cases")) {
        fixture.decode_cases.push_back({"", item.at("ids").get<std::vector<int32_t>>(),
                                        item.at("decoded").get<std::string>(),
                                        item.at("decoded_with_special").get<std::string>()});
      }
    }
    return out;
  }();
  return fixtures;
}

std::string json_fixture_directory(const std::string& name) {
  return INFINIGEN_FIXTURES_DIR "/tokenizers/" + name;
}

TEST(TokenizerJson, FixturesArePresent) {
  const auto& fixtures = json_fixtures();
  for (const char* name : {"llama3", "qwen2", "llama2", "mistral", "metaspace"}) {
    ASSERT_TRUE(fixtures.contains(name)) << name;
    EXPECT_GE(fixtures.at(name).cases.size(), 120u) << name;
    EXPECT_GE(fixtures.at(name).decode_cases.size(), 20u) << name;
  }
}

TEST(TokenizerJson, MatchesReferenceEncodingsAndDecodings) {
  for (const auto& [name, fixture] : json_fixtures()) {
    const Tokenizer tokenizer = Tokenizer::from_directory(json_fixture_directory(name));
    int mismatches = 0;
    for (const JsonCase& c : fixture.cases) {
      const std::string where = name + ": text " + nlohmann::json(c.text).dump();
      const std::vector<int32_t> ids = tokenizer.encode(c.text);
      EXPECT_EQ(ids, c.ids) << where;
      EXPECT_EQ(tokenizer.decode(c.ids), c.decoded) << where;
      EXPECT_EQ(tokenizer.decode(c.ids, /*skip_special=*/false), c.decoded_with_special) << where;
      mismatches += ids != c.ids;
    }
    EXPECT_EQ(mismatches, 0) << name;
    for (const JsonCase& c : fixture.decode_cases) {
      const std::string where = name + ": ids " + nlohmann::json(c.ids).dump();
      EXPECT_EQ(tokenizer.decode(c.ids), c.decoded) << where;
      EXPECT_EQ(tokenizer.decode(c.ids, /*skip_special=*/false), c.decoded_with_special) << where;
    }
  }
}

TEST(TokenizerJson, BosFollowsThePostProcessorAndTheConfig) {
  for (const auto& [name, fixture] : json_fixtures()) {
    const Tokenizer tokenizer = Tokenizer::from_directory(json_fixture_directory(name));
    // The metaspace fixture's tokenizer_config.json says add_bos_token false over its template.
    const std::optional<int32_t> expected = name == "metaspace" || fixture.bos_ids.empty()
                                                ? std::nullopt
                                                : std::optional(fixture.bos_ids.front());
    EXPECT_LE(fixture.bos_ids.size(), 1u) << name;
    EXPECT_EQ(tokenizer.bos_id(), expected) << name;
  }
  const Tokenizer llama3 = Tokenizer::from_directory(json_fixture_directory("llama3"));
  EXPECT_EQ(llama3.bos_id(), llama3.token_to_id("<|begin_of_text|>"));
  EXPECT_EQ(llama3.eos_id(), llama3.token_to_id("<|end_of_text|>"));
  EXPECT_EQ(llama3.vocab_size(), 1512);  // 1503 + 9 added tokens
  const Tokenizer qwen2 = Tokenizer::from_directory(json_fixture_directory("qwen2"));
  EXPECT_EQ(qwen2.bos_id(), std::nullopt);
  EXPECT_EQ(qwen2.eos_id(), qwen2.token_to_id("<|endoftext|>"));
  const Tokenizer llama2 = Tokenizer::from_directory(json_fixture_directory("llama2"));
  EXPECT_EQ(llama2.bos_id(), 1);
  EXPECT_EQ(llama2.eos_id(), 2);
  EXPECT_EQ(llama2.token_to_id("<0x0A>"), 13);

  // The vocab.json form answers OPT's "</s>", the id callers put first today.
  const Tokenizer bundled = Tokenizer::bundled();
  EXPECT_EQ(bundled.bos_id(), 2);
  EXPECT_EQ(bundled.eos_id(), 2);
}

TEST(TokenizerJson, EncodesAnyBytesAndDecodesThemLikePython) {
  const Tokenizer llama3 = Tokenizer::from_directory(json_fixture_directory("llama3"));
  const Tokenizer llama2 = Tokenizer::from_directory(json_fixture_directory("llama2"));
  std::mt19937 rng(99);
  std::uniform_int_distribution<int> length(0, 40);
  std::uniform_int_distribution<int> byte(0, 255);
  for (int trial = 0; trial < 1000; ++trial) {
    std::string s;
    const int n = length(rng);
    for (int i = 0; i < n; ++i) s.push_back(static_cast<char>(byte(rng)));
    // Byte-level: every byte is a token, and decoding is a lossy UTF-8 decode.
    EXPECT_EQ(llama3.decode(llama3.encode(s)), python_lossy(s)) << "trial " << trial;
    // Byte fallback keeps every byte too; its decoder turns a bad run into U+FFFD per byte.
    const std::string decoded = llama2.decode(llama2.encode(s));
    EXPECT_TRUE(is_valid_utf8(decoded)) << "trial " << trial;
    if (is_valid_utf8(s)) {
      EXPECT_EQ(decoded, s) << "trial " << trial;
    }
  }
}

TEST(TokenizerJson, EncodeIsSafeFromManyThreads) {
  const JsonFixture& fixture = json_fixtures().at("qwen2");
  const Tokenizer tokenizer = Tokenizer::from_directory(json_fixture_directory("qwen2"));
  std::vector<std::thread> threads;
  std::vector<int> mismatches(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 3; ++round) {
        for (const JsonCase& c : fixture.cases) {
          if (tokenizer.encode(c.text) != c.ids) ++mismatches[t];
        }
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(mismatches, std::vector<int>(4, 0));
}

TEST(TokenizerJson, DecodeRendersUnknownIds) {
  const Tokenizer tokenizer = Tokenizer::from_directory(json_fixture_directory("llama2"));
  const std::vector<int32_t> hi = tokenizer.encode("Hi");
  std::vector<int32_t> ids = hi;
  ids.push_back(-3);
  ids.insert(ids.end(), hi.begin(), hi.end());
  EXPECT_EQ(tokenizer.decode(ids), "Hi<id -3>Hi");
  EXPECT_EQ(tokenizer.decode({}), "");
}

// A minimal valid tokenizer.json: byte-level BPE over "a", "b", "ab" and the byte alphabet's
// space, with `patch` merged over it (a null value removes the key).
std::string tiny_json(const nlohmann::json& patch = nlohmann::json::object()) {
  nlohmann::json root = {
      {"version", "1.0"},
      {"added_tokens", {{{"id", 4}, {"content", "<s>"}, {"special", true}, {"normalized", false}}}},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}}},
      {"post_processor", nullptr},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model",
       {{"type", "BPE"},
        {"vocab", {{"a", 0}, {"b", 1}, {"ab", 2}, {"\xC4\xA0", 3}}},
        {"merges", {"a b"}}}}};
  root.merge_patch(patch);
  return root.dump();
}

// A tiny_json patch whose pre-tokenizer is a Split on the regex `pattern` with `behavior`.
nlohmann::json split_pre_tokenizer(const std::string& pattern, const std::string& behavior) {
  return {{"pre_tokenizer",
           {{"type", "Split"},
            {"pattern", {{"Regex", pattern}}},
            {"behavior", behavior},
            {"invert", false}}}};
}

TEST_F(TokenizerFiles, TokenizerJsonIsPreferredOverVocabJson) {
  write("vocab.json", kVocab);
  write("merges.txt", "a b\n");
  write("tokenizer.json", tiny_json());
  const Tokenizer tokenizer = Tokenizer::from_directory(dir());
  EXPECT_EQ(tokenizer.encode("ab <s>ba"), (std::vector<int32_t>{2, 3, 4, 1, 0}));
  EXPECT_EQ(tokenizer.vocab_size(), 5);
  EXPECT_EQ(tokenizer.bos_id(), std::nullopt);
  EXPECT_EQ(tokenizer.decode({2, 3, 4, 1}), "ab b");
  EXPECT_EQ(tokenizer.decode({2, 3, 4, 1}, /*skip_special=*/false), "ab <s>b");
}

TEST(TokenizerJson, MergesAsPairsAndAsStrings) {
  const nlohmann::json pairs = {
      {"model", {{"merges", nlohmann::json::array({nlohmann::json::array({"a", "b"})})}}}};
  const Tokenizer from_pairs = Tokenizer::from_json(tiny_json(pairs), std::nullopt, "t");
  const Tokenizer from_strings = Tokenizer::from_json(tiny_json(), std::nullopt, "t");
  EXPECT_EQ(from_pairs.encode("abab"), (std::vector<int32_t>{2, 2}));
  EXPECT_EQ(from_strings.encode("abab"), (std::vector<int32_t>{2, 2}));
}

TEST(TokenizerJson, BosAndEosFromTheConfig) {
  const nlohmann::json with_template = {
      {"post_processor",
       {{"type", "TemplateProcessing"},
        {"single",
         {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
          {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
        {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {4}}, {"tokens", {"<s>"}}}}}}}}};
  const std::string json = tiny_json(with_template);
  EXPECT_EQ(Tokenizer::from_json(json, std::nullopt, "t").bos_id(), 4);
  EXPECT_EQ(Tokenizer::from_json(json, std::nullopt, "t").eos_id(), std::nullopt);
  EXPECT_EQ(Tokenizer::from_json(json, R"({"add_bos_token": false})", "t").bos_id(), std::nullopt);
  const Tokenizer configured =
      Tokenizer::from_json(tiny_json(), R"({"add_bos_token": true, "bos_token": {"content": "ab"},
                                          "eos_token": "<s>"})",
                           "t");
  EXPECT_EQ(configured.bos_id(), 2);
  EXPECT_EQ(configured.eos_id(), 4);
  // Without add_bos_token, bos_token names the BOS but does not make the model add one.
  EXPECT_EQ(Tokenizer::from_json(tiny_json(), R"({"bos_token": "ab"})", "t").bos_id(),
            std::nullopt);
  EXPECT_EQ(Tokenizer::from_json(tiny_json(), R"({"eos_token": null})", "t").eos_id(),
            std::nullopt);
}

TEST_F(TokenizerFiles, VocabJsonFormReadsTheConfigToo) {
  write("vocab.json", R"({"<s>": 0, "a": 1, "</s>": 2})");
  write("merges.txt", "");
  EXPECT_EQ(Tokenizer::from_directory(dir()).bos_id(), 2);
  write("tokenizer_config.json", R"({"bos_token": "<s>", "eos_token": "</s>"})");
  EXPECT_EQ(Tokenizer::from_directory(dir()).bos_id(), 0);
  write("tokenizer_config.json", R"({"add_bos_token": false, "eos_token": "a"})");
  EXPECT_EQ(Tokenizer::from_directory(dir()).bos_id(), std::nullopt);
  EXPECT_EQ(Tokenizer::from_directory(dir()).eos_id(), 1);
}

// Each bad tokenizer.json ends in one Error line naming the file and the key.
TEST(TokenizerJsonErrors, EachBadInputIsOneClearLine) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {R"({"model": )", "t/tokenizer.json: malformed JSON"},
      {"[1, 2]", "t/tokenizer.json: expected a JSON object"},
      {tiny_json({{"version", "2.0"}}), "version: \"2.0\" is not supported"},
      {tiny_json({{"model", nullptr}}), "t/tokenizer.json: missing \"model\""},
      {tiny_json({{"model", {{"type", "Unigram"}}}}),
       "t/tokenizer.json: model.type: \"Unigram\" is not supported (supported: BPE)"},
      {tiny_json({{"model", {{"type", "WordPiece"}}}}), "model.type: \"WordPiece\""},
      {tiny_json({{"model", {{"dropout", 0.1}}}}), "model.dropout: BPE dropout (0.1)"},
      {tiny_json({{"model", {{"continuing_subword_prefix", "##"}}}}),
       "model.continuing_subword_prefix: \"##\" is not supported"},
      {tiny_json({{"model", {{"end_of_word_suffix", "</w>"}}}}), "model.end_of_word_suffix"},
      {tiny_json({{"model", {{"merges", {"a c"}}}}}),
       "t/tokenizer.json: model.merges[0]: token \"c\" is not in the vocabulary"},
      {tiny_json({{"model", {{"merges", {"b a"}}}}}),
       "model.merges[0]: merged token \"ba\" is not in the vocabulary"},
      {tiny_json({{"model", {{"merges", {"a b c"}}}}}), "model.merges[0]: expected two tokens"},
      {tiny_json(
           {{"model", {{"merges", nlohmann::json::array({nlohmann::json::array({"a", 1})})}}}}),
       "model.merges[0]: expected \"a b\""},
      {tiny_json({{"model", {{"vocab", {{"a", 0}, {"b", 0}}}}}}),
       "t/tokenizer.json: model.vocab: tokens \"a\" and \"b\" both have id 0"},
      {tiny_json({{"model", {{"vocab", {{"a", "x"}}}}}}),
       "model.vocab: the id of token \"a\" is not an integer"},
      {tiny_json({{"model", {{"unk_token", "<unk>"}}}}),
       "model.unk_token: \"<unk>\" is not in the vocabulary"},
      {tiny_json({{"normalizer", {{"type", "NFKC"}}}}),
       "t/tokenizer.json: normalizer.type: \"NFKC\" is not supported (supported: NFC, Prepend, "
       "Replace, Sequence)"},
      {tiny_json(
           {{"normalizer", {{"type", "Sequence"}, {"normalizers", {{{"type", "Lowercase"}}}}}}}),
       "normalizer.normalizers[0].type: \"Lowercase\" is not supported"},
      {tiny_json({{"pre_tokenizer", {{"type", "Whitespace"}}}}),
       "pre_tokenizer.type: \"Whitespace\" is not supported (supported: ByteLevel, Split, "
       "Metaspace, Sequence)"},
      {tiny_json(split_pre_tokenizer("(a", "Isolated")),
       "pre_tokenizer.pattern: cannot compile the pattern \"(a\""},
      {tiny_json(split_pre_tokenizer("a", "Sideways")),
       "pre_tokenizer.behavior: \"Sideways\" is not one of"},
      {tiny_json({{"pre_tokenizer", {{"type", "Metaspace"}, {"replacement", "__"}}}}),
       "pre_tokenizer.replacement: expected one character, found \"__\""},
      {tiny_json({{"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", nullptr}}}}),
       "pre_tokenizer: missing \"add_prefix_space\""},
      {tiny_json({{"decoder", {{"type", "WordPiece"}}}}), "decoder.type: \"WordPiece\""},
      {tiny_json({{"decoder", {{"type", "Strip"}, {"content", " "}, {"start", -1}, {"stop", 0}}}}),
       "decoder.start: expected a non-negative integer"},
      {tiny_json({{"post_processor", {{"type", "BertProcessing"}}}}),
       "post_processor.type: \"BertProcessing\" is not supported"},
      {tiny_json({{"added_tokens", {{{"id", 9}, {"content", "<s>"}, {"special", true}}}}}),
       "t/tokenizer.json: added_tokens[0]: token \"<s>\" has id 9, but a token outside the "
       "vocabulary gets the next free id, 4"},
      {tiny_json({{"added_tokens", {{{"id", 3}, {"content", "ab"}}}}}),
       "added_tokens[0]: token \"ab\" has id 3, but the same token has id 2"},
      {tiny_json({{"added_tokens", {{{"content", "x"}}}}}), "added_tokens[0]: missing \"id\""},
      {tiny_json({{"added_tokens", "none"}}), "added_tokens: expected an array"},
  };
  for (const auto& [json_text, expected] : bad) {
    const std::string& json = json_text;  // a structured binding cannot be captured by clang 14
    const std::string message = error_of([&] { Tokenizer::from_json(json, std::nullopt, "t"); });
    EXPECT_NE(message.find(expected), std::string::npos) << message << "\nexpected: " << expected;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
}

TEST(TokenizerJsonErrors, DuplicateIdsAndHolesInTheIdRange) {
  // Ids 0..3 with a hole at 1: the added token gets id 3 (the vocabulary's size), which "c" has.
  const nlohmann::json holes = {
      {"model",
       {{"vocab", {{"a", 0}, {"b", nullptr}, {"ab", 2}, {"\xC4\xA0", nullptr}, {"c", 3}}},
        {"merges", nlohmann::json::array()}}},
      {"added_tokens", {{{"id", 3}, {"content", "<s>"}, {"special", true}}}}};
  std::string message =
      error_of([&] { Tokenizer::from_json(tiny_json(holes), std::nullopt, "t"); });
  EXPECT_NE(message.find("gets id 3, which already names vocabulary token \"c\""),
            std::string::npos)
      << message;
  // Two normalized tokens that NFC makes one string.
  const nlohmann::json twins = {{"normalizer", {{"type", "NFC"}}},
                                {"added_tokens",
                                 {{{"id", 4}, {"content", "\xC3\xA9"}, {"normalized", true}},
                                  {{"id", 5}, {"content", "e\xCC\x81"}, {"normalized", true}}}}};
  message = error_of([&] { Tokenizer::from_json(tiny_json(twins), std::nullopt, "t"); });
  EXPECT_NE(message.find("are both matched by"), std::string::npos) << message;
}

TEST(TokenizerJsonErrors, BadConfig) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"{", "t/tokenizer_config.json: malformed JSON"},
      {R"({"bos_token": "<nope>", "add_bos_token": true})",
       "t/tokenizer_config.json: bos_token \"<nope>\" is not a token of the tokenizer"},
      {R"({"eos_token": 7})", "t/tokenizer_config.json: eos_token: expected a string"},
      {R"({"add_bos_token": "yes"})", "add_bos_token: expected true or false"},
      {R"({"add_bos_token": true})", "add_bos_token is true but no bos_token names a token"},
  };
  for (const auto& [config_text, expected] : bad) {
    const std::string& config = config_text;  // a structured binding cannot be captured by clang 14
    const std::string message = error_of([&] { Tokenizer::from_json(tiny_json(), config, "t"); });
    EXPECT_NE(message.find(expected), std::string::npos) << message << "\nexpected: " << expected;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  }
}

TEST_F(TokenizerFiles, MissingTokenizerJsonFilesNameThemselves) {
  write("tokenizer.json", R"({"model": {"type": "BPE", "vocab": {}, "merges": []}})");
  write("tokenizer_config.json", "[");
  const std::string message = error_of([&] { Tokenizer::from_directory(dir()); });
  EXPECT_NE(message.find(dir() + "/tokenizer_config.json: malformed JSON"), std::string::npos)
      << message;
}

}  // namespace
}  // namespace infinigen
