// core: OPT tensor names, shapes and loading.
#include "core/opt_weights.h"

#include <string_view>

#include "core/interrupt.h"

namespace infinigen {
namespace {

constexpr std::string_view kPrefix = "model.decoder.";

bool is_norm_or_bias(const std::string& name) {
  return name.ends_with(".bias") || name.find("layer_norm") != std::string::npos;
}

}  // namespace

std::vector<OptTensorSpec> opt_tensor_specs(const ModelConfig& c) {
  const int64_t D = c.hidden_size, F = c.ffn_dim;
  const std::string p(kPrefix);
  std::vector<OptTensorSpec> specs = {
      {p + "embed_tokens.weight", {c.vocab_size, D}},
      {p + "embed_positions.weight", {c.max_positions + ModelConfig::kPositionOffset, D}},
  };
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const std::string layer = p + "layers." + std::to_string(l) + ".";
    for (const char* proj : {"q_proj", "k_proj", "v_proj", "out_proj"}) {
      specs.push_back({layer + "self_attn." + proj + ".weight", {D, D}});
      specs.push_back({layer + "self_attn." + proj + ".bias", {D}});
    }
    specs.push_back({layer + "self_attn_layer_norm.weight", {D}});
    specs.push_back({layer + "self_attn_layer_norm.bias", {D}});
    specs.push_back({layer + "fc1.weight", {F, D}});
    specs.push_back({layer + "fc1.bias", {F}});
    specs.push_back({layer + "fc2.weight", {D, F}});
    specs.push_back({layer + "fc2.bias", {D}});
    specs.push_back({layer + "final_layer_norm.weight", {D}});
    specs.push_back({layer + "final_layer_norm.bias", {D}});
  }
  specs.push_back({p + "final_layer_norm.weight", {D}});
  specs.push_back({p + "final_layer_norm.bias", {D}});
  return specs;
}

OptWeightsBuilder::OptWeightsBuilder(const ModelConfig& config, Device device)
    : config_(config), device_(device) {
  weights_.layers.resize(static_cast<size_t>(config.num_layers));
}

Tensor* OptWeightsBuilder::slot(const std::string& name) {
  OptWeights& w = weights_;
  const std::string p(kPrefix);
  if (name == p + "embed_tokens.weight") return &w.embed_tokens;
  if (name == p + "embed_positions.weight") return &w.embed_positions;
  if (name == p + "final_layer_norm.weight") return &w.final_norm_weight;
  if (name == p + "final_layer_norm.bias") return &w.final_norm_bias;
  const std::string layers = p + "layers.";
  if (!name.starts_with(layers)) return nullptr;
  size_t dot = name.find('.', layers.size());
  if (dot == std::string::npos) return nullptr;
  int64_t l = -1;
  try {
    l = std::stoll(name.substr(layers.size(), dot - layers.size()));
  } catch (const std::exception&) {
    return nullptr;
  }
  if (l < 0 || l >= config_.num_layers) return nullptr;
  OptLayerWeights& L = w.layers[static_cast<size_t>(l)];
  const std::string_view rest = std::string_view(name).substr(dot + 1);
  const std::pair<std::string_view, Tensor*> table[] = {
      {"self_attn.q_proj.weight", &L.q_weight},
      {"self_attn.q_proj.bias", &L.q_bias},
      {"self_attn.k_proj.weight", &L.k_weight},
      {"self_attn.k_proj.bias", &L.k_bias},
      {"self_attn.v_proj.weight", &L.v_weight},
      {"self_attn.v_proj.bias", &L.v_bias},
      {"self_attn.out_proj.weight", &L.out_weight},
      {"self_attn.out_proj.bias", &L.out_bias},
      {"self_attn_layer_norm.weight", &L.attn_norm_weight},
      {"self_attn_layer_norm.bias", &L.attn_norm_bias},
      {"fc1.weight", &L.fc1_weight},
      {"fc1.bias", &L.fc1_bias},
      {"fc2.weight", &L.fc2_weight},
      {"fc2.bias", &L.fc2_bias},
      {"final_layer_norm.weight", &L.ffn_norm_weight},
      {"final_layer_norm.bias", &L.ffn_norm_bias},
  };
  for (const auto& [suffix, tensor] : table) {
    if (rest == suffix) return tensor;
  }
  return nullptr;
}

void OptWeightsBuilder::add(const std::string& name, const Tensor& tensor) {
  Tensor* target = slot(name);
  INFINIGEN_CHECK(target != nullptr, "unexpected OPT tensor '", name, "'");
  INFINIGEN_CHECK(!target->defined(), "tensor '", name, "' given twice");
  const bool widen = is_norm_or_bias(name);
  const Tensor host = widen ? tensor.to_dtype(DType::F32) : tensor;
  *target = host.device() == device_ ? host : host.to(device_);
  ++added_;
}

OptWeights OptWeightsBuilder::finish() {
  const size_t expected = opt_tensor_specs(config_).size();
  INFINIGEN_CHECK(added_ == expected, config_.name, ": ", expected - added_,
                  " OPT tensors are missing");
  return std::move(weights_);
}

std::vector<std::string> check_opt_checkpoint(const SafetensorsCheckpoint& checkpoint,
                                              const ModelConfig& config) {
  // Older checkpoints name tensors "decoder.*" without the "model." prefix.
  const bool short_names = !checkpoint.contains(std::string(kPrefix) + "embed_tokens.weight") &&
                           checkpoint.contains("decoder.embed_tokens.weight");
  std::vector<std::string> stored_names;
  for (const OptTensorSpec& spec : opt_tensor_specs(config)) {
    const std::string stored = short_names ? spec.name.substr(6) : spec.name;
    INFINIGEN_CHECK(checkpoint.contains(stored), checkpoint.directory(), ": missing tensor '",
                    stored, "'");
    const SafetensorsEntry& entry = checkpoint.entry(stored);
    const std::string& file = checkpoint.file_of(stored).path();
    INFINIGEN_CHECK(entry.shape == spec.shape, file, ": tensor '", stored, "' has shape ",
                    shape_string(entry.shape), ", expected ", shape_string(spec.shape),
                    " from the model config");
    INFINIGEN_CHECK(
        entry.dtype == DType::F16 || entry.dtype == DType::BF16 || entry.dtype == DType::F32, file,
        ": tensor '", stored, "' has dtype ", dtype_name(entry.dtype),
        ", expected F16, BF16 or F32");
    stored_names.push_back(stored);
  }
  return stored_names;
}

OptWeights load_opt_weights(const SafetensorsCheckpoint& checkpoint, const ModelConfig& config,
                            Device device) {
  const std::vector<std::string> stored = check_opt_checkpoint(checkpoint, config);
  const std::vector<OptTensorSpec> specs = opt_tensor_specs(config);
  OptWeightsBuilder builder(config, device);
  for (size_t i = 0; i < specs.size(); ++i) {
    check_interrupt();
    builder.add(specs[i].name, checkpoint.load(stored[i]));
  }
  return builder.finish();
}

}  // namespace infinigen
