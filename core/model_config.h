// core: the architecture of an OPT model, read from a preset (configs/models/*.yaml) or from a
// checkpoint's HF config.json (same keys), validated, and written back as config.json.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"

namespace infinigen {

struct ModelConfig {
  std::string name;           // preset name or checkpoint directory, for messages
  int64_t hidden_size = 0;    // D
  int64_t num_layers = 0;     // L
  int64_t num_heads = 0;      // H
  int64_t ffn_dim = 0;        // F
  int64_t vocab_size = 0;     // V
  int64_t max_positions = 0;  // learned positions; the table has max_positions + 2 rows
  int32_t pad_token_id = 1;
  int32_t bos_token_id = 2;
  int32_t eos_token_id = 2;
  float layer_norm_eps = 1e-5f;
  DType dtype = DType::F16;  // storage type of the weights (HF torch_dtype)

  // OPT offsets learned position ids by 2 (rows 0 and 1 of the table are never used by real
  // tokens; left padding maps to row 1).
  static constexpr int64_t kPositionOffset = 2;

  int64_t head_dim() const { return hidden_size / num_heads; }  // d
  int64_t num_parameters() const;  // with the LM head tied to the token embedding
  size_t weight_bytes() const;     // num_parameters in `dtype` (LayerNorms and biases included)
  // K and V of one token over all layers, in `kv_dtype`: 2 * L * D * size.
  size_t kv_bytes_per_token(DType kv_dtype) const;
};

// Parses HF config.json keys (or a preset with the same keys). Architectures this engine does
// not run correctly (post-LN OPT such as opt-350m, project_in/out, non-ReLU activations, no
// biases) are refused with an Error naming `source` and the key.
ModelConfig config_from_json(const nlohmann::json& json, const std::string& source);
// <directory>/config.json.
ModelConfig load_hf_config(const std::string& directory);
// A preset from configs/models/<name>.yaml (embedded at build time).
bool is_preset(const std::string& name);
ModelConfig load_preset(const std::string& name);
std::vector<std::string> preset_names();
// HF config.json of `config`, loadable by transformers' OPTForCausalLM.
nlohmann::json config_to_hf_json(const ModelConfig& config);

}  // namespace infinigen
