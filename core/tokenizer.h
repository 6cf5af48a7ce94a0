// core: byte-level BPE tokenizer (GPT-2 / OPT) from vocab.json + merges.txt.
//
// Text is split by the GPT-2 pre-tokenisation pattern, each piece's UTF-8 bytes are mapped to
// printable code points (GPT-2's bytes_to_unicode table), and BPE merges are applied by rank.
// Special tokens such as "</s>" are never produced by `encode` from text: callers add BOS.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace infinigen {

class Tokenizer {
 public:
  // Reads <directory>/vocab.json and <directory>/merges.txt. Throws Error naming the file and
  // what is wrong (missing, malformed JSON, a merge line that is not two tokens, a merge whose
  // result is not in the vocabulary, ...).
  static Tokenizer from_directory(const std::string& directory);
  // The same from file contents; `source` names them in error messages, which read
  // "<source>/vocab.json: ..." and "<source>/merges.txt:<line>: ...".
  static Tokenizer from_strings(std::string_view vocab_json, std::string_view merges_txt,
                                const std::string& source);
  // The tokenizer bundled in configs/tokenizer (the vocabulary of the synthetic models).
  static Tokenizer bundled();

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // Token ids of `text` (valid UTF-8 or not: bytes are bytes), no special tokens added.
  std::vector<int32_t> encode(std::string_view text) const;
  // Text of `ids`; invalid UTF-8 from partial tokens becomes U+FFFD, as HF's errors="replace".
  // Ids of special tokens (<s>, </s>, <pad>, <unk>) are skipped when `skip_special`; ids
  // outside the vocabulary are rendered as "<id N>".
  std::string decode(const std::vector<int32_t>& ids, bool skip_special = true) const;

  // One more than the largest id in the vocabulary.
  int32_t vocab_size() const;
  // `token` as spelled in vocab.json, i.e. in the byte-level alphabet ("\u0120the" is " the").
  std::optional<int32_t> token_to_id(std::string_view token) const;

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace infinigen
