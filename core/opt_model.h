// core: the OPT forward pass (pre-LayerNorm decoder, learned positions, ReLU FFN, tied LM head).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/kv_cache.h"
#include "core/model_config.h"
#include "core/opt_weights.h"

namespace infinigen {

class OptModel {
 public:
  // Resident weights: `weights` holds every tensor on `device`.
  OptModel(ModelConfig config, OptWeights weights, Device device);
  // Layer weights from `layers` (e.g. streamed by offload/); `weights` holds the embeddings and
  // the final LayerNorm, and its `layers` may be empty.
  OptModel(ModelConfig config, OptWeights weights, Device device,
           std::unique_ptr<LayerWeightSource> layers);

  const ModelConfig& config() const { return config_; }
  Device device() const { return device_; }

  // tokens (B, n) row-major, left-padded: sequence b's real tokens start at first_valid[b]
  // (positions count from there; padding gets OPT's padding position). Fills `cache`, which must
  // be empty. Returns fp32 logits on the CPU: (B, V) of each sequence's last token, or
  // (B, n, V) for every position when `all_positions`.
  Tensor prefill(const std::vector<int32_t>& tokens, const std::vector<int32_t>& first_valid,
                 KvStore& cache, bool all_positions = false);

  // Appends one token per sequence, tokens (B); returns fp32 logits (B, V) on the CPU.
  Tensor decode(const std::vector<int32_t>& tokens, KvStore& cache);

 private:
  // Runs n_new tokens per sequence through every layer; returns final hidden states (B*n, D).
  Tensor forward(const std::vector<int32_t>& tokens, int64_t n_new, KvStore& cache);
  Tensor lm_head(const Tensor& hidden) const;  // (rows, D) -> (rows, V), CPU

  ModelConfig config_;
  OptWeights weights_;
  Device device_;
  std::unique_ptr<LayerWeightSource> layers_;
};

}  // namespace infinigen
