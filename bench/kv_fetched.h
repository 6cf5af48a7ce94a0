// bench: what the decode steps of evaluation runs loaded, summed over runs: the share of the full
// KV (every earlier token of every KV head) each layer and each step read, and, for InfiniGen with
// recall checks, the share of the true attention weight the loaded tokens carried. `infinigen
// eval` reports it beside every task's score (perplexity, passkey).
#pragma once

#include <cstdint>
#include <vector>

#include "offload/offload_stats.h"

namespace infinigen {

class KvFetchedTally {
 public:
  // A model of `num_layers` layers, the first `dense_layers` of them not speculated.
  KvFetchedTally(int64_t num_layers, int64_t dense_layers);

  // Adds the decode steps of a run of `batch` sequences whose prompts are `prompt_len` tokens, with
  // `kv_heads` KV heads: decode step s (1-based) attends over the prompt_len + s - 1 tokens before
  // it.
  void add(const OffloadStats& stats, int64_t batch, int64_t kv_heads, int64_t prompt_len);

  // Over all layers, and over the layers past the dense ones (all layers when every one is dense).
  double fetched() const;
  double speculated_fetched() const;
  std::vector<double> layer_fetched() const;  // per layer
  std::vector<double> step_fetched() const;   // per decode step, all layers
  // Mean recall over the measured layers and steps, and the worst layer's mean; -1 when none was
  // measured.
  double mean_recall() const;
  double min_layer_recall() const;

 private:
  int64_t dense_layers_;
  // Rows loaded, and rows of the full KV, summed per layer and per decode step.
  std::vector<double> layer_loaded_, layer_full_;
  std::vector<double> step_loaded_, step_full_;
  std::vector<double> layer_recall_, layer_recall_count_;
};

}  // namespace infinigen
