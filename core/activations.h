// core: every activation buffer a forward pass uses, described once (llm.c's ActivationTensors
// and fill_in_activation_sizes): the model families compute in these buffers, the memory planner
// (offload/memory_planner.h) adds up the same list, and a run allocates them once, before its
// first pass, so that a decode step allocates nothing.
//
// A pass of n new tokens for each of B sequences computes R = B * n rows per buffer of the layers
// (row-major, one row per token, the sequences one after the other) and B rows per buffer of the
// LM head (each sequence's last row; B * n when every position's logits are asked for, which
// describes itself as a pass of B * n sequences of one row).
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "core/model_config.h"
#include "core/tensor.h"

namespace infinigen {

enum class Activation {
  // The layers', (R, width): D = hidden_size, Q = H * d, KV = H_kv * d, F = ffn_dim,
  // E = the token embedding width (OPT's word_embed_proj_dim).
  Hidden,     // (R, D): the residual stream
  Normed,     // (R, D): a block's normed input, then its output before the residual add
  Query,      // (R, Q): (B, n, H, d), rotated (Llama) and scaled by 1/sqrt(d)
  Key,        // (R, KV): (B, n, H_kv, d), rotated (Llama)
  Value,      // (R, KV)
  Attention,  // (R, Q): attention's output, the input of the output projection
  Ffn,        // (R, F): relu(fc1(x)) (OPT), gate(x) then silu(gate) * up (Llama)
  FfnUp,      // (R, F): up(x); gated FFNs (Llama) only
  Embedding,  // (R, E): token embeddings before project_in; when E != D (OPT-350m) only
  // The LM head's, (B, width).
  Last,         // (B, D): each sequence's last row of the residual stream (a pass of n > 1)
  FinalNormed,  // (B, D): the final norm's output; models with a final norm only
  Projected,    // (B, E): project_out's output; when E != D (OPT-350m) only
  Logits,       // (B, V): fp32 logits on the model's device
};
inline constexpr size_t kNumActivations = static_cast<size_t>(Activation::Logits) + 1;
// "hidden", "query", "ffn_up", ...: for messages and breakdowns.
std::string_view activation_name(Activation id);

struct ActivationBuffer {
  Activation id;
  std::string_view name;  // activation_name(id)
  Shape shape;            // (rows, width)
  DType dtype = DType::F32;
  bool per_sequence = false;  // rows: one per sequence (the LM head's), else one per new token

  size_t bytes() const;
};

// Every activation buffer of `config`'s forward pass and LM head for a pass of
// `rows_per_sequence` new tokens for each of `batch` sequences, in Activation order, with the
// buffers this model does not use left out. All are fp32 on the model's device.
std::vector<ActivationBuffer> activation_buffers(const ModelConfig& config, int64_t batch,
                                                 int64_t rows_per_sequence);
// Their bytes, added up (saturating: the sizes may come from the user).
size_t activation_bytes(const ModelConfig& config, int64_t batch, int64_t rows_per_sequence);

// The buffers of activation_buffers, allocated once for the largest pass of a run and lent to
// every pass as views of their first rows.
//
// One allocation per buffer rather than one arena for all: each buffer is a Tensor::empty of its
// own, so debug poisoning (NaN on allocation), dry runs (a shape without memory) and the device
// come with it, and a buffer that must grow (the LM head's, for an all-positions pass) grows
// alone. There are a dozen, allocated once per run: an arena would save nothing a step sees.
//
// On a CUDA device the LM head's logits also have a host copy in pinned memory, into which each
// pass's logits are copied for the sampler.
class Activations {
 public:
  Activations(const ModelConfig& config, Device device);

  // Makes every buffer hold a pass of `rows_per_sequence` new tokens for each of `batch`
  // sequences, allocating the buffers that are too small (all of them the first time) and
  // keeping the rest. A run calls it before its first pass with its largest pass
  // (core/generation.cc); the forward passes call it too, so that a pass bigger than any
  // reserved grows the buffers it needs, once, instead of failing.
  void reserve(int64_t batch, int64_t rows_per_sequence);
  // Rows [0, rows) of buffer `id` (rows, width): a view, valid until the buffer grows. `rows`
  // must be reserved.
  Tensor rows(Activation id, int64_t rows) const;
  // Rows [0, rows) of the logits on the CPU: the Logits buffer itself on the CPU backend, else
  // its pinned host copy (which the caller fills).
  Tensor host_logits(int64_t rows) const;
  // Device bytes held now.
  size_t bytes() const;

 private:
  ModelConfig config_;
  Device device_;
  std::array<Tensor, kNumActivations> buffers_;  // undefined: not used by this model, or not yet
  Tensor host_logits_;                           // (rows, V) fp32 pinned; CUDA devices only
};

}  // namespace infinigen
