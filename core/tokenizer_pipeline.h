// core: the stages of a HF tokenizers pipeline as Tokenizer runs them (internal to core).
//
// One encode is HF's TokenizerImpl::encode without special tokens: added tokens are split out of
// the text (those with normalized=false first, on the raw text), each other piece is normalized,
// then split by the added tokens with normalized=true, then pre-tokenized, then each pre-token is
// turned into ids by the BPE model. Decoding maps ids to token strings and runs the decoders.
// Both file formats build this one pipeline: vocab.json + merges.txt (tokenizer.cc) is a
// ByteLevel pre-tokenizer and decoder around BPE; tokenizer.json (tokenizer_json.cc) names its
// stages. Every stage reproduces HF's behaviour (tokenizers' Rust sources), quirks included, so
// that ids match id for id; comments mark where the input can be something HF never sees
// (invalid UTF-8: Python strings are always valid).
//
// Where things are: tokenizer_text.cc (UTF-8, messages, files, regular expressions),
// tokenizer_bpe.cc (the BPE model, the added-token matcher), tokenizer_pipeline.cc (normalizers,
// pre-tokenizers, decoders, the pipeline itself).
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <mutex>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <variant>
#include <vector>

#include "core/tokenizer.h"

namespace infinigen::tokenizer_detail {

// ---- UTF-8 ----------------------------------------------------------------------------------

constexpr std::string_view kReplacementCharacter = "\xEF\xBF\xBD";  // U+FFFD

// One step of UTF-8 decoding: the length of the valid code point at p, or of the maximal invalid
// subpart there (the unit that Python's errors="replace" and Rust's from_utf8_lossy turn into
// one U+FFFD).
struct Utf8Step {
  size_t length;
  bool valid;
};
Utf8Step utf8_step(const unsigned char* p, size_t n);
// The code point of a valid step of `length` bytes at p.
char32_t utf8_code_point(const unsigned char* p, size_t length);
void append_utf8(char32_t cp, std::string& out);
// Appends `bytes` with each maximal invalid UTF-8 subpart replaced by U+FFFD.
void append_lossy(std::string_view bytes, std::string& out);
bool is_valid_utf8(std::string_view text);

// JSON-quoted, so that odd tokens stay on one line in error messages.
std::string quoted(std::string_view token);
// A JSON value in a message: scalars as JSON (long ones cut), containers by kind. Never a whole
// nested value: dumping is recursive, and a fuzzed file nests thousands deep.
std::string brief(const nlohmann::json& value);
std::string read_file(const std::filesystem::path& path);

// ---- Regular expressions ----------------------------------------------------------------------

// A pattern of tokenizer.json (written for Oniguruma, which HF uses) compiled with PCRE2 in UTF
// and UCP mode, matched like onig's find_iter. Patterns are translated where the two engines
// differ: `\s`/`\S` become Unicode White_Space (PCRE2's `\s` also matches U+180E) and `\h`/`\H`
// hexadecimal digits (PCRE2's `\h` is horizontal space); `$` and `^` match at line ends, `.`
// stops at "\n" only, as in onig's Ruby syntax. `\p{..}` follows the Unicode version of the
// PCRE2 library, so characters assigned after it may split differently from HF.
class Regex {
 public:
  struct Match {
    size_t begin;
    size_t end;
  };
  // Throws Error "<what>: cannot compile the pattern ...".
  static Regex pattern(std::string_view pattern, const std::string& what);
  static Regex literal(std::string_view text, const std::string& what);

  // The matches in `text`, left to right and not overlapping; an empty match right after the
  // previous match is skipped, as onig's find_iter does. Invalid UTF-8 is matched as if each
  // maximal invalid subpart were U+FFFD; offsets are in `text`.
  std::vector<Match> find_all(std::string_view text) const;

 private:
  struct Compiled;
  // `source` in PCRE2 syntax; `written` is how the file spells it, for messages.
  static Regex compile(std::string_view source, std::string_view written, uint32_t options,
                       const std::string& what);
  std::shared_ptr<const Compiled> compiled_;
};

// ---- Text on its way through the pipeline -------------------------------------------------------

// A piece of the input after some stages. `origin` holds, for each byte of `text`, the offset in
// the original text of the character it came from: what is left of HF's alignments, enough for
// Metaspace's prepend_scheme "first", which asks whether a piece starts the original text.
struct Piece {
  std::string text;
  std::vector<uint32_t> origin;  // by byte of `text`
  int32_t added_id = -1;         // an added token found in the text: final, no stage touches it
};

// ---- Stages -------------------------------------------------------------------------------------

struct NfcNormalizer {};
struct PrependNormalizer {
  std::string prepend;
};
struct ReplaceNormalizer {
  Regex pattern;
  std::string content;
};
using Normalizer = std::variant<NfcNormalizer, PrependNormalizer, ReplaceNormalizer>;

enum class SplitBehavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };
enum class PrependScheme { First, Never, Always };

struct SplitPreTokenizer {
  Regex pattern;
  SplitBehavior behavior;
  bool invert;
};
struct ByteLevelPreTokenizer {
  bool add_prefix_space;
  bool use_regex;  // split by the GPT-2 pattern before mapping bytes
};
struct MetaspacePreTokenizer {
  std::string replacement;  // one character
  PrependScheme prepend_scheme;
  bool split;
};
using PreTokenizer = std::variant<SplitPreTokenizer, ByteLevelPreTokenizer, MetaspacePreTokenizer>;

struct ByteLevelDecoder {};
struct MetaspaceDecoder {
  std::string replacement;
  bool drop_in_first_token;  // prepend_scheme is not "never"
};
struct ReplaceDecoder {
  Regex pattern;
  std::string content;
};
struct ByteFallbackDecoder {};
struct FuseDecoder {};
struct StripDecoder {
  char32_t content;
  size_t start;
  size_t stop;
};
using Decoder = std::variant<ByteLevelDecoder, MetaspaceDecoder, ReplaceDecoder,
                             ByteFallbackDecoder, FuseDecoder, StripDecoder>;

struct TransparentHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using TokenMap = std::unordered_map<std::string, int32_t, TransparentHash, std::equal_to<>>;

// HF's BPE model: vocabulary, merges by rank, unknown token and byte fallback.
class BpeModel {
 public:
  // The vocabulary from a JSON object mapping tokens to ids; errors read "<where>: ...".
  void load_vocabulary(const nlohmann::json& object, const std::string& where);
  // Adds the merge of rank `rank` (later duplicates win, as in HF's HashMap); on failure returns
  // what is wrong ("token \"x\" is not in the vocabulary").
  std::optional<std::string> add_merge(std::string_view left, std::string_view right,
                                       uint32_t rank);
  // Settles the byte-fallback table; after the options are set and before the first tokenize.
  void finish();

  // Appends the ids of one pre-token (HF's BPE::tokenize).
  void tokenize(std::string_view word, std::vector<int32_t>& out) const;

  const TokenMap& vocab() const { return vocab_; }
  // By id; empty and absent for ids that name no token.
  const std::vector<std::string>& tokens() const { return tokens_; }
  bool has_id(int64_t id) const {
    return id >= 0 && id < static_cast<int64_t>(present_.size()) && present_[id];
  }

  std::optional<int32_t> unk_id;
  bool fuse_unk = false;
  bool byte_fallback = false;
  bool ignore_merges = false;

 private:
  struct MergeRule {
    uint32_t rank;
    int32_t new_id;
  };
  void merge_word(std::string_view word, std::vector<int32_t>& out) const;
  void merge_all(std::vector<int32_t>& symbols, std::vector<int32_t>& out) const;

  TokenMap vocab_;
  std::vector<std::string> tokens_;
  std::vector<bool> present_;
  std::unordered_map<uint64_t, MergeRule> merges_;
  std::array<int32_t, 256> byte_token_ids_{};  // "<0xNN>" of each byte, or -1

  // Pre-tokens seen before; like HF's, the cache simply stops growing when full.
  mutable std::mutex cache_mutex_;
  mutable std::unordered_map<std::string, std::vector<int32_t>, TransparentHash, std::equal_to<>>
      cache_;
};

// A token of tokenizer.json's added_tokens.
struct AddedToken {
  std::string content;
  std::string pattern;  // what is matched in text and decoded: content, normalized if `normalized`
  int32_t id;
  bool special = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = true;
  bool single_word = false;
};

// The strings that split added tokens out of text, matched leftmost-longest (HF's
// Aho-Corasick with MatchKind::LeftmostLongest).
class AddedTokenMatcher {
 public:
  void add(std::string_view pattern, size_t token);
  bool empty() const { return nodes_.size() <= 1; }
  // The token whose pattern is the longest one starting at text[at], and its length.
  std::optional<std::pair<size_t, size_t>> longest_at(std::string_view text, size_t at) const;

 private:
  struct Node {
    std::vector<std::pair<unsigned char, uint32_t>> next;  // sorted by byte
    int64_t token = -1;
  };
  std::vector<Node> nodes_ = std::vector<Node>(1);
};

// The whole pipeline: Tokenizer::Impl.
struct Pipeline {
  std::vector<Normalizer> normalizers;
  std::vector<PreTokenizer> pre_tokenizers;
  BpeModel model;
  std::optional<std::vector<Decoder>> decoders;  // none: tokens joined by spaces, as HF does

  std::vector<AddedToken> added;
  AddedTokenMatcher raw_matcher;         // added tokens with normalized=false
  AddedTokenMatcher normalized_matcher;  // the others, their content normalized
  TokenMap added_ids;                    // content -> id

  // By id over the whole id range: the string decode() starts from, whether decode skips it
  // when asked to skip special tokens, and whether the id names a token at all.
  std::vector<std::string> id_strings;
  std::vector<bool> id_special;
  std::vector<bool> id_present;

  std::optional<int32_t> bos;
  std::optional<int32_t> eos;

  // After the stages and added tokens (their patterns unique and not empty) are set: builds the
  // matchers and the id tables. `special_contents` are the strings whose ids decode() skips.
  void finish(const std::unordered_set<std::string>& special_contents);

  std::vector<int32_t> encode(std::string_view text) const;
  std::string decode(const std::vector<int32_t>& ids, bool skip_special) const;
  std::optional<int32_t> token_to_id(std::string_view token) const;
  void normalize(Piece& piece) const;

 private:
  void split_added(Piece piece, const AddedTokenMatcher& matcher, std::vector<Piece>& out) const;
  void decode_tokens(std::vector<std::string>& tokens, std::string& out) const;
};

}  // namespace infinigen::tokenizer_detail

namespace infinigen {

// Tokenizer's state is the pipeline; both readers (tokenizer.cc, tokenizer_json.cc) fill it.
struct Tokenizer::Impl {
  tokenizer_detail::Pipeline pipeline;
};

namespace tokenizer_detail {

// Fills `pipeline` from tokenizer.json text (tokenizer_json.cc); errors read "<file>: ...".
void load_tokenizer_json(std::string_view text, const std::string& file, Pipeline& pipeline);

// Settles bos and eos from tokenizer_config.json text over the defaults already in `pipeline`:
// "eos_token" and "bos_token" name tokens (a string, an object with "content", or null), and
// "add_bos_token" says whether the BOS is put first at all; without it, `bos_token` replaces the
// default BOS only when `bos_token_sets_bos`.
void apply_tokenizer_config(std::string_view text, const std::string& file, Pipeline& pipeline,
                            bool bos_token_sets_bos);

}  // namespace tokenizer_detail
}  // namespace infinigen
