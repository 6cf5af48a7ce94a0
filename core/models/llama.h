// core/models: the Llama family (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM): rotary
// positions, RMSNorm before each block, a SwiGLU feed-forward block, grouped-query attention
// (fewer K/V heads than query heads), biases only where the config asks (Qwen2's Q/K/V), and an
// LM head that is tied to the token embedding or not.
#pragma once

#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>

#include "core/model.h"

namespace infinigen {

// Whether `model_type` is one this family reads ("llama", "mistral", "qwen2").
bool is_llama_model_type(const std::string& model_type);
// The config.json keys of the family: num_key_value_heads, head_dim, rope_theta and
// rope_scaling (or transformers 5's rope_parameters; types default, linear and llama3),
// rms_norm_eps, hidden_act (silu only), attention_bias, mlp_bias, tie_word_embeddings, and a
// sliding window (Mistral's sliding_window, Qwen2's use_sliding_window), which bounds the
// context: within the window, attention is full attention. Anything else gets one line naming
// the key.
ModelConfig llama_config_from_json(const nlohmann::json& json, const std::string& source);
nlohmann::json llama_config_to_json(const ModelConfig& config);

// Tensor names and shapes ("model.layers.N.self_attn.q_proj.weight", "model.norm.weight",
// "lm_head.weight" when untied).
WeightLayout llama_weight_layout(const ModelConfig& config);

class LlamaModel : public Model {
 public:
  LlamaModel(const ModelConfig& config, ModelWeights weights, Device device,
             std::unique_ptr<LayerWeightSource> layers);

 private:
  Tensor forward(const std::vector<int32_t>& tokens, int64_t n_new, KvStore& cache) override;
  Tensor lm_head(const Tensor& hidden) const override;

  Tensor inv_freq_;  // (d / 2) fp32 on the device: the rotary frequencies (core/rope.h)
};

}  // namespace infinigen
