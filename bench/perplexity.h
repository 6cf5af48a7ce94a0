// bench: perplexity through the engine's own decode loop (`infinigen eval`), as the InfiniGen
// paper measures accuracy: a window of text is split into a prompt, prefilled, and the tokens
// after it, fed one decode step at a time whatever the model predicted (teacher forcing); each
// step's log-probability of the true next token gives the perplexity. The KV policy decides what
// each step's attention reads, exactly as in `infinigen run` (it is the same run_offloaded).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "bench/past_context.h"
#include "offload/runtime.h"

namespace infinigen {

// A text cut into evaluation windows: each is BOS followed by length - 1 consecutive tokens of
// the text, the windows back to back from the text's start (a window never spans two texts).
struct EvalText {
  std::string name;
  std::vector<int32_t> ids;  // the whole text's token ids, without BOS
};
std::vector<std::vector<int32_t>> eval_windows(const std::vector<EvalText>& texts, int64_t length,
                                               std::optional<int32_t> bos);

struct PerplexityOptions {
  int64_t prefill = 128;  // tokens of each window given as the prompt (BOS included)
  int64_t decode = 0;     // tokens after the prompt scored one decode step each; 0 = the rest of
                          // the model's context
  int64_t chunk = 256;    // positions per point of the chunked curve (the paper's Fig. 12)
  int64_t batch = 4;      // windows decoded together
  // A window past the model's context (prefill + decode > max_positions): refused, or its oldest
  // tokens after a kept prefix dropped (bench/past_context.h) before the tokens scored.
  PastContextOptions past;
  int64_t decode_length(int64_t max_positions) const;  // decode, or its default
  // Tokens each window drops after past.keep_prefix: 0 when prefill + decode fit the context.
  int64_t dropped(int64_t max_positions) const;
  // The prompt a run holds at most: the prefill, less what it drops.
  int64_t planned_prompt(int64_t max_positions) const;
  void validate(int64_t max_positions) const;  // one-line Error naming the flag
};

struct PerplexityResult {
  int64_t windows = 0;
  int64_t tokens = 0;  // scored tokens: windows * decode
  double nll = 0.0;    // their summed negative log-likelihood (nats)
  double perplexity() const;
  // Per chunk c of positions [c * chunk, (c + 1) * chunk) holding scored tokens: the first
  // position and the perplexity over the scored tokens there (every window's).
  std::vector<int64_t> chunk_start;
  std::vector<double> chunk_perplexity;
  // Share of the full KV (every earlier token of every head) that decode steps loaded, over all
  // layers and over the layers past the dense ones; per layer; per decode step (all layers).
  double fetched = 0.0;
  double speculated_fetched = 0.0;
  std::vector<double> layer_fetched;
  std::vector<double> step_fetched;
  double mean_recall = -1.0;       // infinigen with recall checks: over measured layers and steps
  double min_layer_recall = -1.0;  // the worst layer's mean
  double seconds = 0.0;            // wall time of the runs
};

// Scores every window with run_offloaded (the policy and its options in `offload`), `options.batch`
// windows per run. `progress(done, total)` counts decode steps over all runs.
PerplexityResult measure_perplexity(const ModelSource& model,
                                    const std::vector<std::vector<int32_t>>& windows,
                                    const PerplexityOptions& options, const OffloadOptions& offload,
                                    Device device, DType kv_dtype,
                                    const std::function<void(int64_t, int64_t)>& progress = {});

}  // namespace infinigen
