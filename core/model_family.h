// core: the model families, one entry each (as KV policies are, offload/kv_policy.h): which HF
// model_type values a family reads, its config.json keys both ways, its tensor layout and its
// model. The config parser, the weight layout and make_model look families up here and never
// name one.
//
// Adding a family: its file pair under core/models/ defining its entry, and one line in
// model_family.cc's registration list (docs/architecture.md).
#pragma once

#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "core/model.h"
#include "core/model_config.h"
#include "core/weights.h"

namespace infinigen {

struct ModelFamily {
  std::string name;                      // ModelConfig::family
  std::vector<std::string> model_types;  // the HF model_type values it reads
  // The family's config.json keys (model_type, the name, special tokens in the vocabulary and
  // the dtype are checked by config_from_json); one-line Errors naming the key.
  ModelConfig (*config_from_json)(const nlohmann::json& json, const std::string& source);
  // Its config.json keys (config_to_hf_json adds the common ones).
  nlohmann::json (*config_to_json)(const ModelConfig& config);
  WeightLayout (*weight_layout)(const ModelConfig& config);
  std::unique_ptr<Model> (*make)(const ModelConfig& config, ModelWeights weights, Device device,
                                 std::unique_ptr<LayerWeightSource> layers);
};

// Every registered family.
const std::vector<const ModelFamily*>& model_families();
// The family named `name` (ModelConfig::family); an Error when there is none.
const ModelFamily& model_family(const std::string& name);
// The family that reads HF model_type `model_type`, or null.
const ModelFamily* model_family_of_type(const std::string& model_type);

}  // namespace infinigen
