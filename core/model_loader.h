// core: turning a --model argument into a runnable model: a checkpoint directory, a built-in
// model (small models trained on English text, shipped in models/: "builtin", an OPT, the
// default; "builtin-llama", a Llama with grouped-query attention), or a preset on seeded synthetic
// weights.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "core/model.h"
#include "core/sampler.h"
#include "core/tokenizer.h"

namespace infinigen {

inline constexpr const char* kBuiltinModel = "builtin";
inline constexpr const char* kBuiltinLlamaModel = "builtin-llama";
// Whether `spec` names a built-in model.
bool is_builtin_model(const std::string& spec);

// A resolved --model: its architecture and tokenizer, and where its weights come from.
struct ModelSource {
  ModelConfig config;
  std::string directory;  // checkpoint directory; empty for a preset on synthetic weights
  std::optional<Tokenizer> tokenizer;       // absent when a checkpoint ships none
  std::optional<SamplingOptions> sampling;  // its generation_config.json, when it ships one
  std::string description;
  bool synthetic = false;
  uint64_t seed = 0;  // of synthetic weights
};

// The token every prompt starts with: the checkpoint tokenizer's BOS when the checkpoint ships a
// tokenizer (none for one that adds none, as Qwen2's), else the config's bos_token_id (presets on
// synthetic weights, checkpoints without a tokenizer).
std::optional<int32_t> prompt_bos(const ModelSource& source);

// The text of token ids: the tokenizer's decoding, or the ids separated by spaces when the model
// ships no tokenizer (presets on synthetic weights).
std::string token_text(const ModelSource& source, const std::vector<int32_t>& ids);

struct LoadedModel {
  std::unique_ptr<Model> model;
  std::optional<Tokenizer> tokenizer;  // absent when a checkpoint ships none
  std::string description;             // e.g. "opt-13b preset on synthetic weights (seed 0)"
  bool synthetic = false;
};

struct ModelLoadOptions {
  Device device = Device::Cpu;
  uint64_t seed = 0;  // synthetic weights of presets
};

// A built-in model's checkpoint directory: for the default one $INFINIGEN_BUILTIN_MODEL when set,
// else share/infinigen/models/NAME next to an installed binary, else models/NAME in the source
// tree the binary was built from. A one-line Error when none holds a config.json.
std::string builtin_model_directory(const std::string& name = kBuiltinModel);

// Resolves `spec` without reading weights: an existing directory is a checkpoint; "builtin" is
// the built-in model; a preset name runs on synthetic weights. Throws a one-line Error for
// anything else.
ModelSource resolve_model(const std::string& spec, const ModelLoadOptions& options);
// The weights of `source` on `device`, every tensor checked against the config (in a dry run,
// core/trace.h, tensors of the right shapes and types with no memory).
ModelWeights load_weights(const ModelSource& source, Device device);

// The first floating-point tensor of the checkpoint in `directory` that holds a NaN or an
// infinity, as "<file>: tensor <name> holds <value> at element <i>"; empty when there is none.
// Reads every tensor: for explaining a failure (a non-finite logit), not for every load.
std::string find_non_finite_tensor(const std::string& directory);
// resolve_model + load_weights into a model with resident weights, after checking that they fit
// in available memory.
LoadedModel load_model(const std::string& spec, const ModelLoadOptions& options);

// Memory the host can give us now (MemAvailable), in bytes; 0 if unknown.
size_t available_host_memory();

}  // namespace infinigen
