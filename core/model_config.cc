// core: model configuration from HF config.json or YAML presets.
#include "core/model_config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "core/config_keys.h"
#include "core/error.h"
#include "core/model_family.h"
#include "core/resources.h"
#include "core/saturating.h"
#include "core/weights.h"

namespace infinigen {
namespace {

using nlohmann::json;

// Converts a YAML node (maps, sequences, scalars) into JSON with typed scalars.
json yaml_to_json(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Map: {
      json out = json::object();
      for (const auto& item : node) out[item.first.as<std::string>()] = yaml_to_json(item.second);
      return out;
    }
    case YAML::NodeType::Sequence: {
      json out = json::array();
      for (const auto& item : node) out.push_back(yaml_to_json(item));
      return out;
    }
    case YAML::NodeType::Scalar: {
      const std::string text = node.Scalar();
      if (node.Tag() == "!") return text;  // quoted
      if (text == "true" || text == "false") return text == "true";
      if (text == "null" || text == "~") return nullptr;
      try {
        size_t used = 0;
        const long long i = std::stoll(text, &used);
        if (used == text.size()) return i;
        const double d = std::stod(text, &used);
        if (used == text.size()) return d;
      } catch (const std::exception&) {
      }
      return text;
    }
    default:
      return nullptr;
  }
}

}  // namespace

int64_t ModelConfig::num_parameters() const {
  // From the layout's one layer times the layer count (never every layer's specs: a config's
  // layer count is not trusted to be small), saturating.
  const WeightLayout layout = weight_layout(*this);
  const auto sum = [](const std::vector<TensorSpec>& specs) {
    size_t total = 0;
    for (const TensorSpec& spec : specs) {
      total = saturating_sum({total, static_cast<size_t>(shape_numel(spec.shape))});
    }
    return total;
  };
  constexpr auto kMax = static_cast<size_t>(std::numeric_limits<int64_t>::max());
  const size_t layers =
      saturating_product({num_layers, static_cast<int64_t>(std::min(sum(layout.layer), kMax))});
  return static_cast<int64_t>(
      std::min(saturating_sum({sum(layout.first), sum(layout.last), layers}), kMax));
}

size_t ModelConfig::weight_bytes() const {
  return static_cast<size_t>(num_parameters()) * dtype_size(dtype);
}

size_t ModelConfig::kv_bytes_per_token(DType kv_dtype) const {
  return 2 * static_cast<size_t>(num_layers * kv_dim()) * dtype_size(kv_dtype);
}

namespace {

// The HF model_type of a config.json: its `model_type`, or, when that is absent, the one its
// `architectures` name ("LlamaForCausalLM" -> "llama", as transformers' class names are built);
// OPT when it has neither (configs written before the key existed).
std::string model_type_of(const json& j, const std::string& source) {
  if (j.contains("model_type") || !j.contains("architectures")) {
    return config_keys::text(j, "model_type", "opt", source);
  }
  const json& names = j.at("architectures");
  INFINIGEN_CHECK(names.is_array() && !names.empty() && names.front().is_string(), source,
                  ": no model_type, and architectures is not a list of class names");
  const std::string name = names.front().get<std::string>();
  const size_t suffix = name.find("For");
  std::string type = name.substr(0, suffix);
  std::transform(type.begin(), type.end(), type.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  INFINIGEN_CHECK(
      suffix != std::string::npos && suffix > 0 && model_family_of_type(type) != nullptr, source,
      ": no model_type, and architectures names ", name, ", which is no model this engine runs");
  return type;
}

}  // namespace

ModelConfig config_from_json(const json& j, const std::string& source) {
  INFINIGEN_CHECK(j.is_object(), source, ": expected a JSON object");
  const std::string type = model_type_of(j, source);
  const ModelFamily* family = model_family_of_type(type);
  if (family == nullptr) {
    std::string known;
    for (const ModelFamily* f : model_families()) {
      for (const std::string& t : f->model_types) known += (known.empty() ? "" : ", ") + t;
    }
    fail(source, ": unsupported model_type \"", type, "\" (this engine runs ", known, ")");
  }
  json typed = j;  // the family reads the type it was chosen by
  typed["model_type"] = type;
  ModelConfig c = family->config_from_json(typed, source);
  c.family = family->name;
  c.name = source;
  c.model_type = type;
  for (int32_t id : {c.pad_token_id, c.bos_token_id, c.eos_token_id}) {
    INFINIGEN_CHECK(id < c.vocab_size, source, ": special token id ", id,
                    " is outside the vocabulary of ", c.vocab_size);
  }
  for (const char* key : {"torch_dtype", "dtype"}) {
    if (j.contains(key) && j.at(key).is_string()) {
      c.dtype = parse_float_dtype(j.at(key).get<std::string>());
    }
  }
  return c;
}

ModelConfig load_hf_config(const std::string& directory) {
  const std::string path = (std::filesystem::path(directory) / "config.json").string();
  std::ifstream in(path);
  INFINIGEN_CHECK(in.good(), path, ": no such file");
  json j;
  try {
    j = json::parse(in);
  } catch (const json::exception& e) {
    fail(path, ": not valid JSON (", e.what(), ")");
  }
  ModelConfig c = config_from_json(j, path);
  c.name = directory;
  return c;
}

bool is_preset(const std::string& name) {
  return embedded_config("models/" + name + ".yaml").has_value();
}

std::vector<std::string> preset_names() {
  std::vector<std::string> names;
  for (const std::string& path : embedded_configs_in("models")) {
    names.push_back(path.substr(7, path.size() - 7 - 5));  // strip "models/" and ".yaml"
  }
  return names;
}

ModelConfig load_preset(const std::string& name) {
  const auto text = embedded_config("models/" + name + ".yaml");
  if (!text) {
    std::string known;
    for (const std::string& preset : preset_names()) known += (known.empty() ? "" : ", ") + preset;
    fail("unknown model preset '", name, "' (presets: ", known, ")");
  }
  ModelConfig c = config_from_json(yaml_to_json(YAML::Load(std::string(*text))),
                                   "configs/models/" + name + ".yaml");
  c.name = name;
  return c;
}

json config_to_hf_json(const ModelConfig& c) {
  json j = model_family(c.family).config_to_json(c);
  j["vocab_size"] = c.vocab_size;
  j["pad_token_id"] = c.pad_token_id;
  j["bos_token_id"] = c.bos_token_id;
  j["eos_token_id"] = c.eos_token_id;
  j["torch_dtype"] = c.dtype == DType::F32    ? "float32"
                     : c.dtype == DType::BF16 ? "bfloat16"
                                              : "float16";
  return j;
}

}  // namespace infinigen
