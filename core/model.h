// core: the model interface the runtime, generation, the planner and the KV policies use. One
// file per family implements it (core/models/<family>.cc) from the shared ops; nothing outside a
// family's file and the config parsing knows which family runs.
//
// A forward pass of n new tokens per sequence calls, for each layer, KvStore::begin_layer,
// observe (the layer's attention input and queries), append (the new keys and values) and, in
// decode, view (what attention reads); see core/kv_cache.h. Every pass computes in the model's
// activation buffers (core/activations.h), allocated once: reserve_activations before the first
// pass of a run, so that no pass allocates them and a decode step allocates nothing.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/activations.h"
#include "core/kv_cache.h"
#include "core/model_config.h"
#include "core/weights.h"

namespace infinigen {

// Where the forward pass finds a layer's weights: resident in ModelWeights (the default), or
// streamed from host memory ahead of use by offload/.
class LayerWeightSource {
 public:
  virtual ~LayerWeightSource() = default;
  // Layer `layer`'s tensors on the model's device, valid until layer(layer + 2) is requested.
  // Layers are requested in order within a pass, starting from 0.
  virtual const TensorTable& layer(int64_t layer) = 0;
};

class Model {
 public:
  virtual ~Model() = default;
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelConfig& config() const { return config_; }
  Device device() const { return device_; }

  // Allocates the activation buffers for passes of up to `rows_per_sequence` new tokens for
  // each of `batch` sequences (the prefill's; a decode step has one). A later pass that is
  // bigger grows them then, once.
  void reserve_activations(int64_t batch, int64_t rows_per_sequence) {
    activations_.reserve(batch, rows_per_sequence);
  }

  // tokens (B, n) row-major, left-padded: sequence b's real tokens start at first_valid[b]
  // (positions count from there). Fills `cache`, which must be empty. Returns fp32 logits on
  // the CPU, a tensor of their own: (B, V) of each sequence's last token, or (B, n, V) for every
  // position when `all_positions`.
  // `chunk` > 0 computes the prompt in passes of at most `chunk` tokens per sequence, the first
  // a prefill and the others extensions (attention of each over everything stored before it,
  // causal within it), so that a pass's activations are bounded by the chunk, not the prompt;
  // the cache counts them as one prompt (KvStore::expect_prompt). A sequence may be all padding
  // in the first passes. 0: one pass.
  Tensor prefill(const std::vector<int32_t>& tokens, const std::vector<int32_t>& first_valid,
                 KvStore& cache, bool all_positions = false, int64_t chunk = 0);
  // Appends one token per sequence, tokens (B); returns fp32 logits (B, V) on the CPU: the
  // model's logits buffer, which the next pass overwrites (clone() keeps them), so that a decode
  // step allocates nothing.
  Tensor decode(const std::vector<int32_t>& tokens, KvStore& cache);
  // The prompt prefixes groups of sequences share (KvStore::share_prefixes), each computed once:
  // the store's first pass, a batch of the groups' leaders, `prefixes` (G, shared rows)
  // row-major, each left-padded (SharedPrefixes::leader_first_valid). The sequences' own prompt
  // tokens follow with extend().
  void prefill_shared(const std::vector<int32_t>& prefixes, KvStore& cache);
  // Appends n tokens per sequence to a cache that holds some already (a resumed conversation,
  // or the sequences' own tokens after a shared prefix),
  // tokens (B, n) row-major, padding rows where a row is before the sequence's first_valid;
  // attention is over everything stored plus the new rows, causal. Returns fp32 logits (B, V)
  // of each sequence's last token, a tensor of their own. `chunk` as prefill's.
  Tensor extend(const std::vector<int32_t>& tokens, KvStore& cache, int64_t chunk = 0);

 protected:
  // `weights` holds the globals; its layers come from `layers` (resident in `weights` when null).
  Model(ModelConfig config, ModelWeights weights, Device device,
        std::unique_ptr<LayerWeightSource> layers);

  // Runs n_new tokens per sequence through every layer in the activation buffers (reserving
  // them for the pass first); returns the hidden states (B * n, D), the Hidden buffer's rows,
  // that lm_head turns into logits.
  virtual Tensor forward(const std::vector<int32_t>& tokens, int64_t n_new, KvStore& cache) = 0;
  // (rows, D) -> fp32 logits (rows, V) on the CPU, in the LM head's activation buffers (reserved
  // for `rows` sequences by the caller): Activations::host_logits(rows).
  virtual Tensor lm_head(const Tensor& hidden) = 0;

  // The shared steps of a forward pass. Each new row's position among its sequence's real tokens
  // (pass_batch() * n_new, row-major): offset + the tokens before it (its shared prefix's, then
  // its own from first_valid[b]), `padding` for a padding row. Called before the pass's tokens
  // are stored.
  static std::vector<int32_t> token_positions(const KvStore& cache, int64_t n_new, int32_t offset,
                                              int32_t padding);
  // A layer's attention into out (B * n_new, H * d): over the new rows alone at prefill (causal,
  // left padding masked; q (B * n_new, H * d), k and v (B * n_new, H_kv * d)), else over what
  // the cache's view of the layer holds (causal among the pass's own rows).
  void attend(int64_t layer, const Tensor& q, const Tensor& k, const Tensor& v, KvStore& cache,
              Tensor& out) const;

  const TensorTable& globals() const { return weights_.globals; }
  // Layer l's InfiniGen skew kept beside the checkpoint (core/weights.h), or an undefined tensor.
  const Tensor& attention_skew(int64_t l) const;
  // Layer l's weights; ops from here on belong to layer l in a trace (core/trace.h).
  const TensorTable& layer(int64_t l);
  // The start of layer l of a pass, a safe point: a pending interrupt is honoured, the CPU
  // backend's team is resized to the cores other processes leave (core/cpu_threads.h), the cache
  // begins the layer; returns layer(l).
  const TensorTable& begin_layer(int64_t l, KvStore& cache);

  ModelConfig config_;
  Device device_;
  Activations activations_;

 private:
  // Which logits a pass returns: none (a prompt's chunk before its last), each sequence's last
  // row's, or every row's.
  enum class Logits { None, Last, All };
  // Runs a pass of the n = tokens / B new tokens per sequence and returns fp32 logits: (B, V)
  // for Logits::Last, (B, n, V) for Logits::All, in the logits buffer; undefined for None.
  Tensor run_pass(const std::vector<int32_t>& tokens, KvStore& cache, Logits logits);
  // The prompt's tokens (B, n) in passes of at most `chunk` rows (0: one pass), on a cache that
  // expects them (KvStore::expect_prompt); logits as prefill returns them.
  Tensor run_prompt(const std::vector<int32_t>& tokens, KvStore& cache, bool all_positions,
                    int64_t chunk);

  ModelWeights weights_;
  std::unique_ptr<LayerWeightSource> layers_;
};

// Rows per sequence of the largest pass of a prompt of `rows` rows computed in chunks of `chunk`
// (Model::prefill's; 0: one pass).
inline int64_t largest_prompt_pass(int64_t rows, int64_t chunk) {
  return chunk > 0 && chunk < rows ? chunk : rows;
}

// The model of `config`'s family. `weights` holds the globals and, when `layers` is null, every
// layer resident; otherwise its layers may be empty and `layers` supplies them.
std::unique_ptr<Model> make_model(const ModelConfig& config, ModelWeights weights, Device device,
                                  std::unique_ptr<LayerWeightSource> layers = nullptr);

}  // namespace infinigen
