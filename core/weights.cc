// core: named tensors, loading them from checkpoints, and the family dispatch of layouts.
#include "core/weights.h"

#include <cstring>
#include <filesystem>
#include <functional>

#include "core/interrupt.h"
#include "core/model_family.h"
#include "core/saturating.h"

namespace infinigen {

std::string WeightLayout::layer_tensor_name(int64_t index, const std::string& name) const {
  return layer_prefix + std::to_string(index) + "." + name;
}

void WeightLayout::visit(const std::function<void(const TensorSpec&)>& visitor) const {
  for (const TensorSpec& spec : first) visitor(spec);
  for (int64_t l = 0; l < num_layers; ++l) {
    for (const TensorSpec& spec : layer) {
      visitor({layer_tensor_name(l, spec.name), spec.shape, spec.role, l});
    }
  }
  for (const TensorSpec& spec : last) visitor(spec);
}

std::vector<TensorSpec> WeightLayout::all() const {
  std::vector<TensorSpec> specs;
  visit([&](const TensorSpec& spec) { specs.push_back(spec); });
  return specs;
}

WeightLayout weight_layout(const ModelConfig& config) {
  return model_family(config.family).weight_layout(config);
}

void TensorTable::add(std::string name, Tensor tensor) {
  INFINIGEN_CHECK(find(name) == nullptr, "tensor '", name, "' given twice");
  entries_.emplace_back(std::move(name), std::move(tensor));
}

const Tensor* TensorTable::find(std::string_view name) const {
  for (const auto& [key, tensor] : entries_) {
    if (key == name) return &tensor;
  }
  return nullptr;
}

Tensor* TensorTable::find(std::string_view name) {
  for (auto& [key, tensor] : entries_) {
    if (key == name) return &tensor;
  }
  return nullptr;
}

const Tensor& TensorTable::get(std::string_view name) const {
  const Tensor* tensor = find(name);
  INFINIGEN_CHECK(tensor != nullptr, "no tensor '", name, "'");
  return *tensor;
}

WeightsBuilder::WeightsBuilder(const ModelConfig& config, Device device)
    : layout_(weight_layout(config)), device_(device) {
  weights_.layers.resize(static_cast<size_t>(layout_.num_layers));
}

void WeightsBuilder::add(const std::string& name, const Tensor& tensor) {
  // Where the tensor goes, and the shape the layout expects.
  TensorTable* table = nullptr;
  std::string key = name;
  const TensorSpec* spec = nullptr;
  for (const std::vector<TensorSpec>* list : {&layout_.first, &layout_.last}) {
    for (const TensorSpec& s : *list) {
      if (s.name == name) spec = &s;
    }
  }
  if (spec != nullptr) {
    table = &weights_.globals;
  } else if (name.starts_with(layout_.layer_prefix)) {
    const size_t start = layout_.layer_prefix.size(), dot = name.find('.', start);
    int64_t layer = -1;
    if (dot != std::string::npos && dot > start && dot - start <= 9 &&
        name.find_first_not_of("0123456789", start) == dot) {
      layer = std::stoll(name.substr(start, dot - start));
    }
    if (layer >= 0 && layer < layout_.num_layers) {
      key = name.substr(dot + 1);
      for (const TensorSpec& s : layout_.layer) {
        if (s.name == key) spec = &s;
      }
      table = &weights_.layers[static_cast<size_t>(layer)];
    }
  }
  INFINIGEN_CHECK(spec != nullptr, "unexpected tensor '", name, "' for this model");
  INFINIGEN_CHECK(tensor.shape() == spec->shape, "tensor '", name, "' has shape ",
                  shape_string(tensor.shape()), ", expected ", shape_string(spec->shape));
  const Tensor host = tensor.shape().size() == 1 ? tensor.to_dtype(DType::F32) : tensor;
  table->add(key, host.device() == device_ ? host : host.to(device_));
  ++added_;
}

ModelWeights WeightsBuilder::finish() {
  const size_t expected = layout_.first.size() + layout_.last.size() +
                          layout_.layer.size() * static_cast<size_t>(layout_.num_layers);
  INFINIGEN_CHECK(added_ == expected, expected - added_, " of the model's ", expected,
                  " tensors are missing");
  return std::move(weights_);
}

std::vector<std::string> check_checkpoint(const SafetensorsCheckpoint& checkpoint,
                                          const ModelConfig& config) {
  // Visited lazily and in checkpoint order, so that a size read from config.json (an absurd layer
  // count) is refused at the first tensor the checkpoint lacks, before anything proportional to
  // it is built.
  const WeightLayout layout = weight_layout(config);
  const std::string first_name = !layout.first.empty() ? layout.first.front().name
                                 : !layout.layer.empty()
                                     ? layout.layer_tensor_name(0, layout.layer.front().name)
                                     : std::string();
  // Some checkpoints store the base model's names without the leading "model.".
  const bool short_names = first_name.starts_with("model.") && !checkpoint.contains(first_name) &&
                           checkpoint.contains(first_name.substr(6));
  // What a missing tensor's message adds when the config asks for more tensors than there are.
  const size_t held = checkpoint.names().size();
  const size_t needed =
      saturating_sum({layout.first.size() + layout.last.size(),
                      saturating_product({config.num_layers, std::ssize(layout.layer)})});
  const std::string count = needed <= held ? std::string()
                                           : cat(" (config.json's ", config.num_layers,
                                                 " layers need ", needed,
                                                 " tensors; the checkpoint holds ", held, ")");
  std::vector<std::string> stored_names;
  layout.visit([&](const TensorSpec& spec) {
    const std::string stored =
        short_names && spec.name.starts_with("model.") ? spec.name.substr(6) : spec.name;
    INFINIGEN_CHECK(checkpoint.contains(stored), checkpoint.directory(), ": missing tensor '",
                    stored, "'", count);
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
  });
  return stored_names;
}

ModelWeights load_checkpoint_weights(const SafetensorsCheckpoint& checkpoint,
                                     const ModelConfig& config, Device device) {
  const std::vector<std::string> stored = check_checkpoint(checkpoint, config);
  const std::vector<TensorSpec> specs = weight_layout(config).all();
  WeightsBuilder builder(config, device);
  for (size_t i = 0; i < specs.size(); ++i) {
    check_interrupt();
    builder.add(specs[i].name, checkpoint.load(stored[i]));
  }
  return builder.finish();
}

std::string attention_skew_tensor_name(int64_t layer) {
  return "layers." + std::to_string(layer) + ".attention_skew";
}

std::vector<Tensor> load_attention_skew(const std::string& directory, const ModelConfig& config,
                                        Device device) {
  const std::string path = (std::filesystem::path(directory) / kAttentionSkewFile).string();
  if (!std::filesystem::exists(path)) return {};
  INFINIGEN_CHECK(config.rope.enabled(), path,
                  ": a skew beside the checkpoint is for rotary models; this model's skew is "
                  "folded into its weights");
  const auto file = SafetensorsFile::open(path);
  const Shape shape = {config.kv_heads(), config.head_dim(), config.head_dim()};
  std::vector<Tensor> skew;
  for (int64_t l = 0; l < config.num_layers; ++l) {
    const std::string name = attention_skew_tensor_name(l);
    const SafetensorsEntry* entry = file->find(name);
    INFINIGEN_CHECK(entry != nullptr, path, ": missing tensor '", name, "'");
    INFINIGEN_CHECK(entry->dtype == DType::F32 && entry->shape == shape, path, ": tensor '", name,
                    "' is ", dtype_name(entry->dtype), " ", shape_string(entry->shape),
                    ", expected F32 ", shape_string(shape));
    Tensor t = Tensor::empty(shape, DType::F32);
    std::memcpy(t.raw(), file->bytes(*entry), entry->nbytes);
    skew.push_back(device == Device::Cpu ? t : t.to(device));
  }
  return skew;
}

}  // namespace infinigen
