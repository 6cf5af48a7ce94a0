// core: a model's tensors by name, for every model family alike: what the family's forward
// pass reads, what the loader checks against a checkpoint, and what offload/ places on the
// device or streams from the host.
//
// A family describes its tensors as a WeightLayout (core/models/<family>.cc); the loader, the
// synthetic-weight generator, the weight placement and the streaming all walk that layout, so
// none of them knows a family's tensor names.
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/model_config.h"
#include "core/safetensors.h"
#include "core/tensor.h"

namespace infinigen {

// What a tensor is to the model, whatever its family names it: code that treats tensors by kind
// (the synthetic-weight generator, the skew) reads the role, never the name.
enum class TensorRole {
  TokenEmbedding,       // (vocab, E) token table (OPT's is also the LM head)
  PositionEmbedding,    // learned position table
  EmbeddingProjection,  // between the embedding width and the model's (OPT's project_in/out)
  NormWeight,           // a LayerNorm's or RMSNorm's gain
  NormBias,             // a LayerNorm's bias
  QueryWeight,
  QueryBias,
  KeyWeight,
  KeyBias,
  ValueWeight,
  ValueBias,
  AttentionOutputWeight,  // the projection from the heads back to the residual stream
  AttentionOutputBias,
  FfnInputWeight,  // OPT's fc1; the Llama family's gate_proj and up_proj
  FfnInputBias,
  FfnOutputWeight,  // back to the residual stream: OPT's fc2, the Llama family's down_proj
  FfnOutputBias,
  LmHead,  // an LM head not tied to the token table
};

struct TensorSpec {
  std::string name;
  Shape shape;
  TensorRole role;
  // The layer of a tensor WeightLayout::visit gives; -1 for the globals (`first`, `last`) and in
  // WeightLayout::layer itself.
  int64_t layer = -1;
};

// Every tensor of a model, in checkpoint order: `first` (e.g. embeddings), each layer's
// `layer` tensors, then `last` (e.g. the final norm). `first` and `last` carry full checkpoint
// names; layer tensors are named within the layer ("self_attn.q_proj.weight"), layer l's full
// name being layer_prefix + l + "." + name.
struct WeightLayout {
  std::vector<TensorSpec> first, layer, last;
  std::string layer_prefix;  // e.g. "model.decoder.layers."
  int64_t num_layers = 0;

  std::string layer_tensor_name(int64_t index, const std::string& name) const;
  // Calls visitor(spec) for every tensor with its full name (and a layer tensor with its layer),
  // in checkpoint order, building none ahead (a caller that stops early by throwing has paid for
  // what it visited only).
  void visit(const std::function<void(const TensorSpec&)>& visitor) const;
  // Every tensor as visit gives it, in checkpoint order.
  std::vector<TensorSpec> all() const;
};

// The layout of `config`'s family (dispatched on config.family).
WeightLayout weight_layout(const ModelConfig& config);

// Named tensors, looked up by name: a layer's, or a model's globals. Lookups are a short linear
// scan (a table holds a few dozen tensors) and never allocate.
class TensorTable {
 public:
  void add(std::string name, Tensor tensor);        // Error on a name given twice
  const Tensor& get(std::string_view name) const;   // Error naming the tensor when absent
  const Tensor* find(std::string_view name) const;  // null when absent
  Tensor* find(std::string_view name);
  std::vector<std::pair<std::string, Tensor>>& entries() { return entries_; }
  const std::vector<std::pair<std::string, Tensor>>& entries() const { return entries_; }

 private:
  std::vector<std::pair<std::string, Tensor>> entries_;
};

// A model's tensors. Matrices keep the checkpoint's storage type (F16/BF16/F32); vectors (norm
// parameters, biases) are widened to F32 at load: they are small and feed fp32 arithmetic.
struct ModelWeights {
  TensorTable globals;              // `first` and `last` tensors, by full name
  std::vector<TensorTable> layers;  // per layer, by name within the layer
  // InfiniGen's skew of a rotary model, kept beside its checkpoint (speculate/skew.h): per layer
  // (H_kv, d, d) fp32 on the model's device; empty when there is none.
  std::vector<Tensor> attention_skew;
};

// Collects a model's tensors given by full checkpoint name (from a checkpoint or a generator),
// moving each to `device` (vectors widened to F32), and checks that the layout is complete.
class WeightsBuilder {
 public:
  WeightsBuilder(const ModelConfig& config, Device device);
  void add(const std::string& name, const Tensor& tensor);  // Error: unknown name or shape
  ModelWeights finish();                                    // Error: a tensor is missing

 private:
  WeightLayout layout_;
  Device device_;
  ModelWeights weights_;
  size_t added_ = 0;
};

// Checks, without reading tensor data, that the checkpoint holds every tensor of `config`'s
// layout with its shape and a floating dtype. Returns the stored name of each tensor of
// layout.all() (a checkpoint may store names without the leading "model.").
std::vector<std::string> check_checkpoint(const SafetensorsCheckpoint& checkpoint,
                                          const ModelConfig& config);
// Loads and checks every tensor. Throws Error naming the file and tensor for a missing tensor,
// a shape that disagrees with the config, or a non-floating dtype.
ModelWeights load_checkpoint_weights(const SafetensorsCheckpoint& checkpoint,
                                     const ModelConfig& config, Device device);

// InfiniGen's skew of a rotary model, kept beside its checkpoint (speculate/skew.h writes it):
// the file's name, and the name of layer l's tensor in it, (H_kv, d, d) fp32.
inline constexpr const char* kAttentionSkewFile = "infinigen_skew.safetensors";
std::string attention_skew_tensor_name(int64_t layer);
// Every layer's skew from `directory`/kAttentionSkewFile on `device`, or nothing when the file
// does not exist. Throws a one-line Error naming the file for a model without rotary embeddings,
// a missing layer, or a tensor of the wrong shape or dtype.
std::vector<Tensor> load_attention_skew(const std::string& directory, const ModelConfig& config,
                                        Device device);

}  // namespace infinigen
