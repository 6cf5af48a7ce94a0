// core: the tensors of an OPT model, their HF names and shapes, and loading them from a
// checkpoint with every name, shape and dtype checked against the config.
#pragma once

#include <string>
#include <vector>

#include "core/model_config.h"
#include "core/safetensors.h"
#include "core/tensor.h"

namespace infinigen {

// Matrices keep the checkpoint's storage type (F16/BF16/F32); LayerNorm parameters and biases
// are widened to F32 at load (they are small and feed fp32 arithmetic directly).
struct OptLayerWeights {
  Tensor attn_norm_weight, attn_norm_bias;  // (D) f32: self_attn_layer_norm
  Tensor q_weight, k_weight, v_weight;      // (D, D), HF layout (out, in)
  Tensor q_bias, k_bias, v_bias;            // (D) f32
  Tensor out_weight;                        // (D, D)
  Tensor out_bias;                          // (D) f32
  Tensor ffn_norm_weight, ffn_norm_bias;    // (D) f32: final_layer_norm of the layer
  Tensor fc1_weight;                        // (F, D)
  Tensor fc1_bias;                          // (F) f32
  Tensor fc2_weight;                        // (D, F)
  Tensor fc2_bias;                          // (D) f32
};

struct OptWeights {
  Tensor embed_tokens;     // (V, D); also the LM head (tied)
  Tensor embed_positions;  // (max_positions + 2, D)
  std::vector<OptLayerWeights> layers;
  Tensor final_norm_weight, final_norm_bias;  // (D) f32
};

// Where the forward pass finds a layer's weights: resident on the device (the default), or
// streamed from host memory ahead of use by offload/.
class LayerWeightSource {
 public:
  virtual ~LayerWeightSource() = default;
  // Layer `layer`'s weights on the model's device, valid until layer(layer + 2) is requested.
  // Layers are requested in order within a pass, starting from 0.
  virtual const OptLayerWeights& layer(int64_t layer) = 0;
};

// One expected checkpoint tensor: its HF name (with the "model.decoder." prefix) and shape.
struct OptTensorSpec {
  std::string name;
  Shape shape;
};
// Every tensor of an OPT checkpoint in the order they are written (lm_head.weight is tied and
// not listed).
std::vector<OptTensorSpec> opt_tensor_specs(const ModelConfig& config);

// Checks, without reading tensor data, that the checkpoint has every tensor of `config` with the
// right shape and a floating dtype. Returns the stored name of each spec (prefix resolved).
std::vector<std::string> check_opt_checkpoint(const SafetensorsCheckpoint& checkpoint,
                                              const ModelConfig& config);

// Loads and checks all tensors. Accepts the "model.decoder." and "decoder." name prefixes and
// ignores a tied "lm_head.weight". Throws Error naming the file and tensor for a missing
// tensor, a shape that disagrees with the config, or a non-floating dtype.
OptWeights load_opt_weights(const SafetensorsCheckpoint& checkpoint, const ModelConfig& config,
                            Device device);

// Builds OptWeights from tensors given by HF name (used for synthetic weights held in memory).
// Each tensor is moved to `device`, with LayerNorms and biases widened to F32.
class OptWeightsBuilder {
 public:
  OptWeightsBuilder(const ModelConfig& config, Device device);
  void add(const std::string& name, const Tensor& tensor);
  OptWeights finish();  // throws if a tensor is missing

 private:
  Tensor* slot(const std::string& name);
  const ModelConfig& config_;
  Device device_;
  OptWeights weights_;
  size_t added_ = 0;
};

}  // namespace infinigen
