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
};

struct GenerationResult {
  std::vector<std::vector<int32_t>> tokens;  // generated ids per sequence (gen_len each)
  int64_t batch = 0;
  int64_t prompt_len = 0;  // padded prompt length (the longest prompt)
  int64_t gen_len = 0;
  double prefill_seconds = 0.0;
  double decode_seconds = 0.0;
  Tensor last_logits;  // (B, V) fp32: the logits the last token was chosen from
  // (B, gen_len) when the request asks for score_tokens: log p(token | everything before it).
  std::vector<std::vector<double>> token_log_probs;

  double total_seconds() const { return prefill_seconds + decode_seconds; }
  double throughput() const;         // B * gen_len / total
  double decode_throughput() const;  // B * (gen_len - 1) / decode
};

// Called after each generated token position (1..gen_len).
using ProgressCallback = std::function<void(int64_t done, int64_t total)>;
// Makes the KV store of a request: (batch, capacity in tokens per sequence) -> store.
using KvStoreFactory = std::function<std::unique_ptr<KvStore>(int64_t batch, int64_t capacity)>;

// Checks the request against the model (non-empty prompts, ids in the vocabulary, prompt +
// generation within the context, forced tokens shaped (B, gen_len)) with one-line errors, then
// generates exactly gen_len tokens per sequence (EOS does not stop a sequence, as in FlexGen's
// benchmarks), sampled or forced.
// KV lives in `make_store`'s store, or in a resident KvCache on the model's device when empty.
GenerationResult generate(Model& model, const GenerationRequest& request,
                          const ProgressCallback& progress = {},
                          const KvStoreFactory& make_store = {});

// Checks `request` against the model with one-line errors (prompts present and non-empty, ids
// in the vocabulary, gen_len >= 1, prompt plus generation within the context, forced tokens of
// the right shape and in the vocabulary) and returns the longest prompt's length.
int64_t check_request(const ModelConfig& config, const GenerationRequest& request);
// One-line Error unless a prompt of `longest` tokens plus `gen_len` generated ones fit in the
// model's context (no overflow for lengths near the int64 limit).
void check_context(const ModelConfig& config, int64_t longest, int64_t gen_len);

// `batch` prompts of `prompt_len` ids each: BOS, then ids drawn uniformly from [4, vocab_limit)
// (the special tokens excluded) by a generator seeded with `seed`; the same on every machine.
std::vector<std::vector<int32_t>> synthetic_prompts(int64_t batch, int64_t prompt_len,
                                                    int32_t bos_token_id, int32_t vocab_limit,
                                                    uint64_t seed);

// Left-pads `prompts` into (B, n) with `pad_id`; returns the padded tokens and first_valid (B).
std::vector<int32_t> left_pad(const std::vector<std::vector<int32_t>>& prompts, int32_t pad_id,
                              std::vector<int32_t>* first_valid);

}  // namespace infinigen
