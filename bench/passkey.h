// bench: passkey retrieval (`infinigen eval --task passkey`): a random key hidden at a chosen
// depth of filler text of a chosen length, then asked for. One token far back decides the answer,
// so a KV policy that dropped it or did not fetch it is simply wrong (the needle-in-a-haystack
// tests that InfiniGen's successors are judged on). Each prompt is generated greedily through
// run_offloaded, as in `infinigen run`, and scored by exact match of the key.
//
// A prompt, `length` tokens exactly (BOS included):
//   BOS | intro | filler[0, cut) | needle with the key | filler[cut, F) | question
// where F is what the other parts leave of `length` and cut = round(depth * F). The filler's
// tokens are the filler text's, cycled from a line start drawn per trial. Each part is tokenized
// on its own, so the lengths are exact (a SentencePiece-style tokenizer may add a space where a
// part starts).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "bench/past_context.h"
#include "offload/runtime.h"

namespace infinigen {

// The three strings around the filler; the needle holds "{key}" (each one replaced by the key).
struct PasskeyTemplate {
  std::string intro;
  std::string needle;
  std::string question;

  // The bundled template, configs/passkey/template.json: the built-in models are trained on
  // examples made from the same file (tools/passkey_examples.py).
  static const PasskeyTemplate& built_in();
  // A JSON object with any of "intro", "needle" and "question" (strings; the others keep
  // `base`'s). One-line Error naming `source` when it is not such an object, names another
  // field, or a needle lacks "{key}" (or the intro or question hold it).
  static PasskeyTemplate from_json(std::string_view text, const std::string& source,
                                   const PasskeyTemplate& base = built_in());
  std::string needle_with(const std::string& key) const;
};

enum class PasskeyKeyKind { Digits, Word };
// "digits" or "word"; one-line Error naming --key-kind otherwise.
PasskeyKeyKind parse_passkey_key_kind(std::string_view text);
const char* passkey_key_kind_name(PasskeyKeyKind kind);
// Bytes of the longest key of `kind`: with the leading space, a bound on the key's tokens.
int64_t longest_passkey_key(PasskeyKeyKind kind);

// The filler text's tokens, and the tokens where its lines start (where a trial's filler may
// begin).
struct PasskeyFiller {
  std::string name;                  // the file, or "the bundled text"
  std::vector<int32_t> ids;          // not empty
  std::vector<int64_t> line_starts;  // ascending, 0 first
};
// Tokenizes at most about `max_tokens` tokens of `text`. One-line Error naming `name` when it
// holds no token.
PasskeyFiller passkey_filler(const Tokenizer& tokenizer, std::string_view text,
                             const std::string& name, size_t max_tokens);
// The bundled filler text (configs/calibration.txt, English prose of the King James Bible and
// the Python documentation).
std::string_view bundled_passkey_filler();

// What a trial draws: its key and the line of the filler its filler starts at. A pure function of
// the seed and the cell's length, depth and trial, the same on every platform: a cell's keys do
// not change when other lengths or depths are added.
struct PasskeyDraw {
  std::string key;
  int64_t filler_start = 0;  // a token of filler.ids at a line start
};
PasskeyDraw draw_passkey(PasskeyKeyKind kind, const PasskeyFiller& filler, uint64_t seed,
                         int64_t length, double depth, int64_t trial);

struct PasskeyPrompt {
  std::vector<int32_t> ids;  // `length` tokens
  std::string key;
  int64_t needle_begin = 0;  // the needle's tokens: ids[needle_begin, needle_end)
  int64_t needle_end = 0;
  int64_t answer_tokens = 0;  // tokens of the expected completion, " " + key
};
// One-line Error naming --lengths when `length` cannot hold the parts without filler.
PasskeyPrompt passkey_prompt(const Tokenizer& tokenizer, std::optional<int32_t> bos,
                             const PasskeyTemplate& text, const PasskeyFiller& filler,
                             int64_t length, double depth, const PasskeyDraw& draw);

// Whether a generated text answers `key`: after its leading whitespace it starts with the key,
// and no letter or digit follows it there (71432 is not 714321, "cat" is not "cats").
bool passkey_answer_correct(std::string_view generated, std::string_view key);

// The Wilson score interval of `correct` successes in `trials` at ~95% (z = 1.96).
struct Interval {
  double low = 0.0;
  double high = 0.0;
};
Interval wilson_interval(int64_t correct, int64_t trials, double z = 1.959963984540054);

struct PasskeyOptions {
  std::vector<int64_t> lengths;  // context lengths in tokens (BOS included); empty: the default
  std::vector<double> depths = {0.0, 0.25, 0.5, 0.75, 1.0};  // of the filler, in [0, 1]
  int64_t trials = 20;                                       // per (length, depth) cell
  int64_t batch = 4;  // prompts of one length decoded together
  PasskeyKeyKind key_kind = PasskeyKeyKind::Digits;
  uint64_t seed = 0;
  PastContextOptions past;  // lengths past the model's context (bench/past_context.h)
  // Tokens generated after a prompt: the answer's and this many more.
  static constexpr int64_t kExtraTokens = 3;

  // Tokens a prompt leaves for generation at most: the longest key's bound plus kExtraTokens.
  int64_t generated_bound() const;
  // Tokens a prompt of `length` drops after keep_prefix to fit the context with its answer: 0
  // when it fits.
  int64_t dropped(int64_t length, int64_t max_positions) const;
  // lengths, or by default 1/8, 1/4, 1/2 and 3/4 of the context and the longest that fits.
  std::vector<int64_t> lengths_or_default(int64_t max_positions) const;
  // One-line Errors naming the flag: a depth outside [0, 1], trials or batch below 1, a length
  // below 1 or one that leaves no room for the generated tokens (past_context Refuse; else one
  // whose drop the first turn cannot hold), a length or depth listed twice.
  void validate(int64_t max_positions) const;
};

// Every prompt of a sweep, cell by cell (lengths outer, depths inner), the trials of each in
// order; drawn once and run by every setting.
struct PasskeyCell {
  int64_t length = 0;
  double depth = 0.0;
  std::vector<PasskeyPrompt> prompts;
};
std::vector<PasskeyCell> passkey_cells(const Tokenizer& tokenizer, std::optional<int32_t> bos,
                                       const PasskeyTemplate& text, const PasskeyFiller& filler,
                                       const PasskeyOptions& options, int64_t max_positions);

struct PasskeyCellScore {
  int64_t length = 0;
  double depth = 0.0;
  int64_t trials = 0;
  int64_t correct = 0;
  double score() const { return trials > 0 ? static_cast<double>(correct) / trials : 0.0; }
  Interval interval() const { return wilson_interval(correct, trials); }
};

// A wrong answer, for the report (the first few).
struct PasskeyMiss {
  int64_t length = 0;
  double depth = 0.0;
  std::string key;
  std::string answer;  // the generated text
};

struct PasskeyResult {
  std::vector<PasskeyCellScore> cells;  // in the order of passkey_cells
  std::vector<PasskeyMiss> misses;      // at most kMissesKept
  static constexpr size_t kMissesKept = 5;
  int64_t trials = 0;
  int64_t correct = 0;
  double score() const { return trials > 0 ? static_cast<double>(correct) / trials : 0.0; }
  // Share of the full KV the decode steps loaded, over all layers and over the speculated ones;
  // InfiniGen's recall (mean over layers and steps) when measured, else -1.
  double fetched = 0.0;
  double speculated_fetched = 0.0;
  double mean_recall = -1.0;
  // Per layer: the mean share, over the trials, of the needle's tokens that some KV head of the
  // layer selected at the first decode step (InfiniGen, when it checks recall:
  // OffloadStats::first_selection); -1 for a layer that loads every token. Empty when nothing
  // was recorded.
  std::vector<double> needle_fetched;
  double seconds = 0.0;
};

// Generates every cell's prompts greedily with run_offloaded (the policy and its options in
// `offload`), the prompts of one length `options.batch` at a time, and scores them.
// `progress(done, total)` counts prompts.
PasskeyResult measure_passkey(const ModelSource& model, const std::vector<PasskeyCell>& cells,
                              const PasskeyOptions& options, const OffloadOptions& offload,
                              Device device, DType kv_dtype,
                              const std::function<void(int64_t, int64_t)>& progress = {});

}  // namespace infinigen
