// core: the architecture of a model, read from a preset (configs/models/*.yaml) or from a
// checkpoint's HF config.json (same keys), validated, and written back as config.json. The
// family (HF model_type) picks the forward pass and the tensor layout (core/models/).
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"

namespace infinigen {

// Rotary position embedding (Llama family): per head, channel pairs (i, i + d/2) rotated by
// position * inv_freq[i], inv_freq[i] = theta^(-2i/d), rescaled by `scaling` (HF rope_scaling).
struct RopeConfig {
  enum class Scaling { None, Linear, Llama3 };
  double theta = 0;  // 0: no rotary embedding (learned positions, OPT)
  Scaling scaling = Scaling::None;
  double factor = 1;  // Linear and Llama3: inv_freq / factor (Llama3: for long wavelengths)
  double low_freq_factor = 1, high_freq_factor = 4;  // Llama3
  int64_t original_max_positions = 8192;             // Llama3: the pre-training context

  bool enabled() const { return theta > 0; }
};

enum class NormKind { Layer, Rms };  // LayerNorm with a bias (OPT), RMSNorm (Llama family)

struct ModelConfig {
  std::string name;                // preset name or checkpoint directory, for messages
  std::string family = "opt";      // "opt" or "llama" (Llama, Mistral, Qwen2 configs)
  std::string model_type = "opt";  // HF model_type, written back to config.json
  int64_t hidden_size = 0;         // D
  int64_t num_layers = 0;          // L
  int64_t num_heads = 0;           // H
  int64_t num_kv_heads = 0;        // H_kv: heads of K and V (0: H; fewer with grouped queries)
  int64_t explicit_head_dim = 0;   // d when the config names it (0: D / H)
  int64_t ffn_dim = 0;             // F
  int64_t vocab_size = 0;          // V
  int64_t max_positions = 0;       // context length
  int64_t word_embed_dim = 0;      // E: token embedding width (0: D; OPT's word_embed_proj_dim)
  bool pre_norm = true;            // norm before each block (OPT: do_layer_norm_before)
  bool final_norm = true;          // a norm after the last layer
  NormKind norm = NormKind::Layer;
  float norm_eps = 1e-5f;       // LayerNorm's or RMSNorm's epsilon
  bool gated_ffn = false;       // down(silu(gate(x)) * up(x)) (SwiGLU); else fc2(relu(fc1(x)))
  bool qkv_bias = true;         // biases of the Q/K/V projections
  bool out_bias = true;         // bias of the attention output projection
  bool ffn_bias = true;         // biases of the FFN's linears
  bool tied_embeddings = true;  // the LM head is the token embedding
  RopeConfig rope;
  int32_t pad_token_id = 1;
  int32_t bos_token_id = 2;
  int32_t eos_token_id = 2;
  DType dtype = DType::F16;  // storage type of the weights (HF torch_dtype)

  int64_t head_dim() const {  // d
    return explicit_head_dim > 0 ? explicit_head_dim : hidden_size / num_heads;
  }
  int64_t q_dim() const { return num_heads * head_dim(); }  // width of the queries, H * d
  int64_t kv_heads() const { return num_kv_heads > 0 ? num_kv_heads : num_heads; }
  int64_t kv_dim() const { return kv_heads() * head_dim(); }  // width of K or V per token
  int64_t embed_dim() const { return word_embed_dim > 0 ? word_embed_dim : hidden_size; }
  int64_t num_parameters() const;  // every tensor of the family's layout (core/weights.h)
  size_t weight_bytes() const;     // num_parameters in `dtype` (norms and biases included)
  // K and V of one token over all layers, in `kv_dtype`: 2 * L * H_kv * d * size.
  size_t kv_bytes_per_token(DType kv_dtype) const;
};

// Parses HF config.json keys (or a preset with the same keys): the family's own keys are read by
// its file (core/models/). Architectures this engine does not run correctly are refused with an
// Error naming `source` and the key.
ModelConfig config_from_json(const nlohmann::json& json, const std::string& source);
// <directory>/config.json.
ModelConfig load_hf_config(const std::string& directory);
// A preset from configs/models/<name>.yaml (embedded at build time).
bool is_preset(const std::string& name);
ModelConfig load_preset(const std::string& name);
std::vector<std::string> preset_names();
// HF config.json of `config`, loadable by transformers (OPTForCausalLM, LlamaForCausalLM, ...).
nlohmann::json config_to_hf_json(const ModelConfig& config);

}  // namespace infinigen
