// core: model weights with LLM-like statistics, for running and testing without real checkpoints.
//
// Real LLMs have two properties that matter to KV offloading and that random weights lack:
//  - massive activations: a few residual-stream channels hold values far larger than the rest,
//    the same channels for every token (they survive LayerNorm as outliers);
//  - concentrated attention: each head's query/key interaction has low rank, so most of a
//    query's attention weight lands on a few tokens, and the query/key columns are skewed (a few
//    directions carry most of the energy: what InfiniGen's SVD exploits).
// The generator builds both in, with the knobs below (documented in docs/synthetic-models.md).
// Values are a pure function of (seed, tensor name, element index): the same on every machine and
// with any number of threads.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "core/model_config.h"
#include "core/weights.h"

namespace infinigen {

// The knobs, each with the range validate() allows (D: hidden size, d: head size).
struct SyntheticModelOptions {
  uint64_t seed = 0;
  int64_t outlier_channels = 4;  // residual channels with massive activations, [0, D/16]
  float outlier_ratio = 10.0f;   // outlier magnitude / typical channel's, every layer, [1, 1000]
  float embed_std = 0.1f;        // std of the other embedding entries, (0, 10]
  // Each layer's update std / the residual stream's, (0, 1], and low enough that the outlier
  // channels, which grow with the stream, stay finite in the model's dtype.
  float residual_update_ratio = 0.15f;
  int64_t attention_rank = 8;         // rank of each head's query-key interaction, [1, d]
  float attention_logit_std = 6.0f;   // target std of attention logits between unrelated tokens,
                                      // (0, 100]
  float attention_sink_logit = 0.0f;  // logit every query gives BOS (0: no sink), [0, 100]
  float weight_std = 0.02f;           // std of the remaining matrices (OPT's init_std), (0, 1]

  // Refuses a knob outside its range for `config` with one line naming the knob (by its key, which
  // the CLI spells as its flag) and the range; NaN is outside every range.
  void validate(const ModelConfig& config) const;
};

// Calls `sink(name, tensor)` for every tensor of the model's layout (weight_layout), in
// checkpoint order; each tensor is a fresh CPU tensor of config.dtype. Validates the options
// first.
void generate_synthetic_weights(const ModelConfig& config, const SyntheticModelOptions& options,
                                const std::function<void(const std::string&, const Tensor&)>& sink);

// Synthetic weights held in memory on `device` (for presets without a checkpoint).
ModelWeights synthetic_weights(const ModelConfig& config, const SyntheticModelOptions& options,
                               Device device);

// Writes a complete HF-layout checkpoint into `directory` (created; must not exist or be empty):
// config.json, model.safetensors, vocab.json and merges.txt (the bundled tokenizer), and
// synthetic.json recording the options. Written into a sibling temporary directory and renamed
// into place, so a partial checkpoint never appears. `progress(done, total)` counts tensors.
void write_synthetic_checkpoint(const ModelConfig& config, const SyntheticModelOptions& options,
                                const std::string& directory,
                                const std::function<void(int64_t, int64_t)>& progress = {});

}  // namespace infinigen
