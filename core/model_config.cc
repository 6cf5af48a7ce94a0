// core: model configuration from HF config.json or YAML presets.
#include "core/model_config.h"

#include <yaml-cpp/yaml.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/resources.h"
#include "core/weights.h"

namespace infinigen {
namespace {

using nlohmann::json;

int64_t positive_int(const json& j, const char* key, const std::string& source) {
  INFINIGEN_CHECK(j.contains(key), source, ": missing '", key, "'");
  const json& v = j.at(key);
  INFINIGEN_CHECK(v.is_number_integer() && v.get<int64_t>() > 0, source, ": '", key,
                  "' must be a positive integer, got ", v.dump());
  return v.get<int64_t>();
}

int32_t token_id(const json& j, const char* key, int32_t fallback, const std::string& source) {
  if (!j.contains(key) || j.at(key).is_null()) return fallback;
  const json& v = j.at(key);
  INFINIGEN_CHECK(v.is_number_integer() && v.get<int64_t>() >= 0, source, ": '", key,
                  "' must be a non-negative integer, got ", v.dump());
  return static_cast<int32_t>(v.get<int64_t>());
}

bool flag(const json& j, const char* key, bool fallback, const std::string& source) {
  if (!j.contains(key) || j.at(key).is_null()) return fallback;
  INFINIGEN_CHECK(j.at(key).is_boolean(), source, ": '", key, "' must be true or false, got ",
                  j.at(key).dump());
  return j.at(key).get<bool>();
}

// A key that must have `expected` for this engine to compute the model correctly.
template <typename T>
void require(const json& j, const char* key, const T& expected, const std::string& source,
             const char* why) {
  if (!j.contains(key) || j.at(key).is_null()) return;
  bool matches = false;
  try {
    matches = j.at(key).get<T>() == expected;
  } catch (const json::exception&) {
  }
  INFINIGEN_CHECK(matches, source, ": unsupported ", key, " = ", j.at(key).dump(), " (", why, ")");
}

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
  int64_t total = 0;
  for (const TensorSpec& spec : weight_layout(*this).all()) total += shape_numel(spec.shape);
  return total;
}

size_t ModelConfig::weight_bytes() const {
  return static_cast<size_t>(num_parameters()) * dtype_size(dtype);
}

size_t ModelConfig::kv_bytes_per_token(DType kv_dtype) const {
  return 2 * static_cast<size_t>(num_layers * kv_dim()) * dtype_size(kv_dtype);
}

ModelConfig config_from_json(const json& j, const std::string& source) {
  INFINIGEN_CHECK(j.is_object(), source, ": expected a JSON object");
  if (j.contains("model_type")) {
    INFINIGEN_CHECK(j.at("model_type") == "opt", source, ": unsupported model_type ",
                    j.at("model_type").dump(), " (this engine runs OPT models)");
  }
  ModelConfig c;
  c.name = source;
  c.hidden_size = positive_int(j, "hidden_size", source);
  c.num_layers = positive_int(j, "num_hidden_layers", source);
  c.num_heads = positive_int(j, "num_attention_heads", source);
  c.ffn_dim = positive_int(j, "ffn_dim", source);
  c.vocab_size = positive_int(j, "vocab_size", source);
  c.max_positions = positive_int(j, "max_position_embeddings", source);
  INFINIGEN_CHECK(c.hidden_size % c.num_heads == 0, source, ": hidden_size ", c.hidden_size,
                  " is not divisible by num_attention_heads ", c.num_heads);
  c.pad_token_id = token_id(j, "pad_token_id", 1, source);
  c.bos_token_id = token_id(j, "bos_token_id", 2, source);
  c.eos_token_id = token_id(j, "eos_token_id", 2, source);
  for (int32_t id : {c.pad_token_id, c.bos_token_id, c.eos_token_id}) {
    INFINIGEN_CHECK(id < c.vocab_size, source, ": special token id ", id,
                    " is outside the vocabulary of ", c.vocab_size);
  }
  // Kept only when it differs from the width (so that code resizing a model, such as bench's
  // --scale, keeps an unprojected model unprojected).
  if (j.contains("word_embed_proj_dim") && !j.at("word_embed_proj_dim").is_null()) {
    const int64_t embed = positive_int(j, "word_embed_proj_dim", source);
    c.word_embed_dim = embed == c.hidden_size ? 0 : embed;
  }
  c.pre_norm = flag(j, "do_layer_norm_before", true, source);
  // transformers builds the final LayerNorm only for pre-LayerNorm models.
  c.final_norm = c.pre_norm && !flag(j, "_remove_final_layer_norm", false, source);
  require(j, "activation_function", std::string("relu"), source, "OPT uses ReLU");
  require(j, "enable_bias", true, source, "linear layers without bias are not supported");
  require(j, "layer_norm_elementwise_affine", true, source,
          "LayerNorm without weight and bias is not supported");
  require(j, "tie_word_embeddings", true, source, "the LM head must be tied to the embedding");
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
  std::string dtype = c.dtype == DType::F32    ? "float32"
                      : c.dtype == DType::BF16 ? "bfloat16"
                                               : "float16";
  return json{{"architectures", {"OPTForCausalLM"}},
              {"model_type", "opt"},
              {"hidden_size", c.hidden_size},
              {"num_hidden_layers", c.num_layers},
              {"num_attention_heads", c.num_heads},
              {"ffn_dim", c.ffn_dim},
              {"vocab_size", c.vocab_size},
              {"max_position_embeddings", c.max_positions},
              {"word_embed_proj_dim", c.embed_dim()},
              {"do_layer_norm_before", c.pre_norm},
              {"activation_function", "relu"},
              {"enable_bias", true},
              {"layer_norm_elementwise_affine", true},
              {"_remove_final_layer_norm", c.pre_norm && !c.final_norm},
              {"tie_word_embeddings", true},
              {"pad_token_id", c.pad_token_id},
              {"bos_token_id", c.bos_token_id},
              {"eos_token_id", c.eos_token_id},
              {"dropout", 0.0},
              {"attention_dropout", 0.0},
              {"activation_dropout", 0.0},
              {"layerdrop", 0.0},
              {"init_std", 0.02},
              {"use_cache", true},
              {"torch_dtype", dtype}};
}

}  // namespace infinigen
