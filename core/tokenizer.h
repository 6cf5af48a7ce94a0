// core: BPE tokenizers, id-for-id compatible with HF tokenizers, from either file format:
//
// - vocab.json + merges.txt: GPT-2 / OPT byte-level BPE (text split by the GPT-2 pattern, each
//   piece's UTF-8 bytes mapped to printable code points, merges applied by rank);
// - tokenizer.json: a BPE model with the normalizers, pre-tokenizers, decoders and added tokens of
//   the Llama-2/3, Mistral and Qwen2 families (core/tokenizer_json.cc lists what is read), with
//   tokenizer_config.json beside it for BOS and EOS.
//
// `encode` never adds special tokens (the engine puts bos_id() first itself). In tokenizer.json,
// added tokens written in the text ("<|eot_id|>") are encoded as their ids, as HF does; in the
// vocab.json form "</s>" in text is plain text.
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
  // Reads <directory>/tokenizer.json when it exists, else <directory>/vocab.json and
  // <directory>/merges.txt; <directory>/tokenizer_config.json too when it exists. Throws Error
  // naming the file and what is wrong (missing, malformed JSON, a merge that is not two tokens,
  // a merge whose result is not in the vocabulary, a stage this engine does not implement, ...).
  static Tokenizer from_directory(const std::string& directory);
  // The vocab.json + merges.txt form from file contents; `source` names them in error messages,
  // which read "<source>/vocab.json: ..." and "<source>/merges.txt:<line>: ...".
  static Tokenizer from_strings(std::string_view vocab_json, std::string_view merges_txt,
                                const std::string& source);
  // The tokenizer.json form from file contents, with tokenizer_config.json's when there is one;
  // messages read "<source>/tokenizer.json: ..." and "<source>/tokenizer_config.json: ...".
  static Tokenizer from_json(std::string_view tokenizer_json,
                             std::optional<std::string_view> tokenizer_config_json,
                             const std::string& source);
  // The tokenizer bundled in configs/tokenizer (the vocabulary of the synthetic models).
  static Tokenizer bundled();

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // Token ids of `text` (valid UTF-8 or not: bytes are bytes), no special tokens added.
  std::vector<int32_t> encode(std::string_view text) const;
  // encode(), for a caller that can use at most `limit` tokens: a text far longer than that
  // (over kBoundedBytesPerToken bytes per usable token) is tokenized only as far as its first
  // such bytes, whose tokens, when they are more than `limit` by a margin for the word the cut
  // splits, are returned (more than `limit`: the caller refuses or truncates) without reading the
  // rest. Else the whole text's ids. A 50 MB line costs a fraction of a second, not seconds and
  // gigabytes.
  std::vector<int32_t> encode_bounded(std::string_view text, size_t limit) const;
  static constexpr size_t kBoundedBytesPerToken = 64;
  // Text of `ids`; invalid UTF-8 from partial tokens becomes U+FFFD, as HF's decoders make it.
  // Special tokens are skipped when `skip_special` (tokenizer.json: the added tokens marked
  // special; vocab.json: <s>, </s>, <pad>, <unk>). Ids outside the vocabulary are rendered as
  // "<id N>", and the ids between two of them are decoded on their own.
  std::string decode(const std::vector<int32_t>& ids, bool skip_special = true) const;

  // One more than the largest id, added tokens included.
  int32_t vocab_size() const;
  // `token` as spelled in the vocabulary ("\u0120the" is " the" in a byte-level one) or an added
  // token's content.
  std::optional<int32_t> token_to_id(std::string_view token) const;

  // The token to put first in a sequence, or none when the model is given none (Qwen2). From
  // tokenizer_config.json's add_bos_token and bos_token when present, else tokenizer.json's
  // post-processor template ("<s> $A"), else, in the vocab.json form, "</s>" (OPT's BOS).
  std::optional<int32_t> bos_id() const;
  // tokenizer_config.json's eos_token; without it, "</s>" in the vocab.json form, else none.
  std::optional<int32_t> eos_id() const;

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace infinigen
