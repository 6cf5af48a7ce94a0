// core/models: the OPT family (OPTForCausalLM): learned positions offset by 2, LayerNorm before
// (opt-125m, opt-1.3b and up) or after (opt-350m) each block, ReLU FFN, biases everywhere, the LM
// head tied to the token embedding, and for opt-350m an embedding narrower than the model
// (project_in / project_out).
#pragma once

#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>

#include "core/model.h"

namespace infinigen {

// OPT's learned position table is offset by 2: rows 0 and 1 are never used by real tokens, and
// left padding reads row 1.
inline constexpr int64_t kOptPositionOffset = 2;

// OPT's config.json keys (model_type "opt"): variants this engine would compute wrong
// (activations other than ReLU, no biases, LayerNorm without parameters, an untied LM head) are
// refused naming the key.
ModelConfig opt_config_from_json(const nlohmann::json& json, const std::string& source);
// The keys of an OPTForCausalLM config.json (the common ones are added by config_to_hf_json).
nlohmann::json opt_config_to_json(const ModelConfig& config);

// Tensor names and shapes of an OPT checkpoint ("model.decoder." names; lm_head is tied).
WeightLayout opt_weight_layout(const ModelConfig& config);

class OptModel : public Model {
 public:
  OptModel(const ModelConfig& config, ModelWeights weights, Device device,
           std::unique_ptr<LayerWeightSource> layers);

 private:
  Tensor forward(const std::vector<int32_t>& tokens, int64_t n_new, KvStore& cache) override;
  Tensor lm_head(const Tensor& hidden) const override;
};

}  // namespace infinigen
