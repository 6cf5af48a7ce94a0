// core: batched generation with FlexGen's timing definitions.
//
// prefill_seconds: the prompt pass up to and including the first generated token.
// decode_seconds: the remaining gen_len - 1 tokens.
// throughput: B * gen_len / (prefill + decode) tokens per second.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "core/model.h"
#include "core/sampler.h"
#include "core/shared_prefixes.h"

namespace infinigen {

struct GenerationRequest {
  std::vector<std::vector<int32_t>> prompts;  // token ids per sequence (BOS included)
  int64_t gen_len = 32;
  SamplingOptions sampling;
  DType kv_dtype = DType::F16;
  // Teacher forcing (perplexity): when not empty, (B, gen_len) ids emitted in place of sampled
  // ones, so step i + 1 decodes forced_tokens[b][i] whatever the model predicted.
  std::vector<std::vector<int32_t>> forced_tokens;
  // Also return, per emitted token, its log-probability under the logits it was chosen from.
  bool score_tokens = false;
  // With score_tokens: also the k most likely tokens at each step, with their log-probabilities
  // (and the emitted token's, when it is not among them); 0: none.
  int64_t top_log_probs = 0;
  // Prompt prefixes that groups of the sequences share (find_shared_prefixes), each computed and
  // kept once in a store that can share them (KvStore::share_prefixes); empty: none. Every member
  // of a group starts with its leader's prefix and has tokens of its own after it.
  SharedPrefixes shared_prefixes;
  // Tokens per sequence in each pass of the prompt (Model::prefill's chunk); 0: one pass. The
  // offloaded runtime sets it from OffloadOptions::prefill_chunk.
  int64_t prefill_chunk = 0;
  // Per-sequence settings (a batch job's requests); each empty: the request-wide ones, every
  // sequence generating exactly gen_len tokens.
  // (B) each sequence's sampler: its own temperature, top-p and seed, drawing only for its own
  // tokens (a sequence samples the same whatever its batch).
  std::vector<SamplingOptions> sequence_sampling;
  // (B) tokens each sequence generates at most, each in [1, gen_len].
  std::vector<int64_t> sequence_gen_len;
  // Called after sequence b emits a token (each one, its last included), with everything it
  // generated so far: true ends it there (a stop string, EOS). Unset: no sequence ends before
  // its length.
  std::function<bool(int64_t b, const std::vector<int32_t>& generated)> stop;
  // Whether a sequence that ended leaves the batch, where generate() can drop it (see there);
  // false keeps every row to the end, as a static batch does (to compare the two).
  bool drop_ended = true;
};

struct GenerationResult {
  // Generated ids per sequence: gen_len each, or with per-sequence lengths or a stop callback,
  // what each generated before it ended.
  std::vector<std::vector<int32_t>> tokens;
  int64_t batch = 0;
  int64_t prompt_len = 0;  // padded prompt length (the longest prompt)
  // Token positions generated: the request's gen_len, or fewer when every sequence ended before
  // it (the steps after that are not run).
  int64_t gen_len = 0;
  // Rows the steps computed, over every token position: the batch's at each step, or, where
  // the store drops sequences that ended (KvStore::drop_sequences), those still running.
  int64_t rows = 0;
  double prefill_seconds = 0.0;
  double decode_seconds = 0.0;
  // (B, V) fp32: the logits of each sequence's last step (of the last token it chose, when the
  // store dropped it once it ended).
  Tensor last_logits;
  // (B, gen_len) when the request asks for score_tokens: log p(token | everything before it).
  std::vector<std::vector<double>> token_log_probs;
  // (B, gen_len, k or k + 1) when it asks for top_log_probs: top_log_probabilities of each step.
  std::vector<std::vector<std::vector<TokenLogProb>>> top_log_probs;

  double total_seconds() const { return prefill_seconds + decode_seconds; }
  double throughput() const;         // B * gen_len / total
  double decode_throughput() const;  // B * (gen_len - 1) / decode
};

// A conversation kept across runs (offload/session.h keeps one on disk). A run that continues
// one appends each sequence's prompt (what is new in this turn) to its history instead of
// computing the history again: the history's keys and values come back from the conversation
// layer by layer while the turn's first pass runs.
class Conversation {
 public:
  virtual ~Conversation() = default;
  // Per sequence, the tokens whose keys and values the conversation holds, in order; empty for
  // a new conversation.
  virtual const std::vector<std::vector<int32_t>>& history() const = 0;
  // Leading history tokens that groups of its sequences share, kept once
  // (KvStore::share_prefixes): its turns keep sharing them. Empty: none.
  virtual const SharedPrefixes& shared_prefixes() const {
    static const SharedPrefixes none;
    return none;
  }
  // Called before the turn's first pass; a conversation may start reading ahead here.
  virtual void begin() {}
  // Writes layer `layer`'s history into `store` (KvStore::resume): history token j of sequence
  // b at row store.first_valid()[b] + j, or, after a shared prefix of P tokens, the prefix in its
  // group leader's rows [S - P, S) (S: the shared rows) and token j >= P at row
  // store.first_valid()[b] + j - P.
  virtual void restore_layer(int64_t layer, KvStore& store) = 0;
  // After the turn's first pass: sequence b's new rows are [rows_from[b], store.length()) (and,
  // in a first turn that shares prefixes, each group's in its leader's rows) and stay
  // unchanged while later passes run (they may be saved now, in the background).
  virtual void after_first_pass(const KvStore& store, const std::vector<int32_t>& rows_from) = 0;
  // After the last pass, with the store's stores finished: sequence b's rows
  // [rows_from[b], store.length()) are the decode steps', and `generated` the turn's new tokens
  // (the last of which has no keys and values yet).
  virtual void finish(const KvStore& store, const std::vector<int32_t>& rows_from,
                      const std::vector<std::vector<int32_t>>& generated) = 0;
  // The run failed or was interrupted before finish(): stop whatever reads the store, which
  // goes next. Nothing of the turn is kept.
  virtual void abandon() {}
};

// Called after each generated token position (1..gen_len).
using ProgressCallback = std::function<void(int64_t done, int64_t total)>;
// Makes the KV store of a request: (batch, capacity in tokens per sequence) -> store.
using KvStoreFactory = std::function<std::unique_ptr<KvStore>(int64_t batch, int64_t capacity)>;

// Checks the request against the model (non-empty prompts, ids in the vocabulary, prompt +
// generation within the context, forced tokens shaped (B, gen_len)) with one-line errors, then
// generates gen_len tokens per sequence (EOS does not stop a sequence, as in FlexGen's
// benchmarks), sampled or forced; with per-sequence lengths or a stop callback, a sequence ends
// at its own length or where the callback says, and the loop ends when every sequence has.
// An ended sequence leaves the batch (the store drops its rows: no later step computes or loads
// for it) where the store can drop sequences and the others' tokens do not depend on it (forced
// or greedy tokens, or each sequence with its own sampler); otherwise it keeps its row until
// the end, fed its last token again, its tokens discarded.
// KV lives in `make_store`'s store, or in a resident KvCache on the model's device when empty.
// With a `conversation`, request.prompts are each sequence's tokens after its history, and the
// context check covers history and prompt together.
GenerationResult generate(Model& model, const GenerationRequest& request,
                          const ProgressCallback& progress = {},
                          const KvStoreFactory& make_store = {},
                          Conversation* conversation = nullptr);

// Checks `request` against the model with one-line errors (prompts present and non-empty, ids
// in the vocabulary, gen_len >= 1, prompt plus generation within the context, forced tokens of
// the right shape and in the vocabulary) and returns the longest prompt's length.
// With `history` (per sequence, tokens before the prompt: a resumed conversation), a sequence's
// length is its history plus its prompt.
int64_t check_request(const ModelConfig& config, const GenerationRequest& request,
                      const std::vector<std::vector<int32_t>>* history = nullptr);
// Rows per sequence a KV store holds after the first pass of `prompts`: the longest prompt, or
// with `shared` prefixes their rows plus the longest part of a sequence after its prefix, each
// sequence's `history` (a resumed conversation's, when given) before its prompt. Shared prefixes
// found for new prompts never need more rows than the longest prompt (find_shared_prefixes); a
// conversation's later turns may.
int64_t first_pass_rows(const std::vector<std::vector<int32_t>>& prompts,
                        const std::vector<std::vector<int32_t>>* history,
                        const SharedPrefixes& shared);
// One-line Error unless a prompt of `longest` tokens plus `gen_len` generated ones fit in the
// model's context (no overflow for lengths near the int64 limit).
void check_context(const ModelConfig& config, int64_t longest, int64_t gen_len);
// One-line Error unless sequence `sequence`'s (0-based) conversation, `total` tokens with this
// turn's prompt, leaves room for `gen_len` more in the model's context.
void check_conversation_context(const ModelConfig& config, size_t sequence, int64_t total,
                                int64_t gen_len);

// `batch` prompts of `prompt_len` ids each: BOS, then ids drawn uniformly from [4, vocab_limit)
// (the special tokens excluded) by a generator seeded with `seed`; the same on every machine.
std::vector<std::vector<int32_t>> synthetic_prompts(int64_t batch, int64_t prompt_len,
                                                    int32_t bos_token_id, int32_t vocab_limit,
                                                    uint64_t seed);

// Left-pads `prompts` into (B, n) with `pad_id`; returns the padded tokens and first_valid (B).
std::vector<int32_t> left_pad(const std::vector<std::vector<int32_t>>& prompts, int32_t pad_id,
                              std::vector<int32_t>* first_valid);

}  // namespace infinigen
