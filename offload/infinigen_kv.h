// offload: the `infinigen` policy: all KV in the host pool, and for every layer past the dense
// ones only the tokens that speculation expects to matter are loaded (InfiniGen, OSDI'24).
//
// Layer l's selection is made while layer l - 1 runs (observe: its attention input is known),
// and the selected K/V rows are gathered from the pool into layer l's staging buffer while layer
// l - 1 finishes, so the load overlaps compute. Staged rows are compact: for sequence b, rows
// [n' - take[b], n') hold its selected tokens in token order and row n' the new token; attention
// reads rows [n' - take[b], n' + 1) (the view's own first_valid).
#pragma once

#include <vector>

#include "offload/offloaded_kv.h"
#include "speculate/speculation.h"

namespace infinigen {

class InfinigenKv : public OffloadedKv {
 public:
  InfinigenKv(const ModelConfig& config, int64_t batch, int64_t capacity, DType kv_dtype,
              Device device, int64_t block_tokens, TransferEngine& engine, OffloadStats& stats,
              const SpeculationOptions& options, bool check_recall);

  void begin_layer(int64_t layer) override;
  void observe(int64_t layer, const Tensor& normed, const Tensor& queries,
               const OptLayerWeights& weights) override;
  void append(int64_t layer, const Tensor& keys, const Tensor& values) override;
  View view(int64_t layer) override;

 private:
  bool dense(int64_t layer) const { return layer < options_.dense_layers; }
  void select_and_load(int64_t layer, const Tensor& normed);
  // Share of layer's full attention weight that the staged rows carry, from the real queries.
  double measure_recall(int64_t layer) const;

  SpeculationOptions options_;
  bool check_recall_;
  int64_t head_dim_;
  std::vector<PartialLayer> partial_;        // per layer (unused for dense layers)
  const Tensor* prefill_queries_ = nullptr;  // this layer's scaled queries, between observe
  const OptLayerWeights* prefill_weights_ = nullptr;  // and append at prefill
  Tensor decode_queries_;                             // (B, H * d) of the current layer, for recall
  std::vector<PartialLayer::Selection> selection_;    // per layer: this step's selection
  std::vector<int32_t> compact_first_valid_;          // (B): left padding of the staged rows
};

}  // namespace infinigen
