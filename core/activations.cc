// core: the activation buffers of a forward pass, described once and allocated once.
#include "core/activations.h"

#include <limits>

#include "core/error.h"
#include "core/saturating.h"
#include "core/trace.h"

namespace infinigen {
namespace {

// a * b, or the largest int64 when it does not fit (a plan's sizes come from the user).
int64_t saturating_rows(int64_t a, int64_t b) {
  int64_t rows = 0;
  return __builtin_mul_overflow(a, b, &rows) ? std::numeric_limits<int64_t>::max() : rows;
}

}  // namespace

std::string_view activation_name(Activation id) {
  static constexpr std::array<std::string_view, kNumActivations> kNames = {
      "hidden", "normed",          "query", "key",          "value",     "attention", "ffn",
      "ffn_up", "token_embedding", "last",  "final_normed", "projected", "logits"};
  return kNames[static_cast<size_t>(id)];
}

size_t ActivationBuffer::bytes() const {
  return saturating_product({shape[0], shape[1], static_cast<int64_t>(dtype_size(dtype))});
}

std::vector<ActivationBuffer> activation_buffers(const ModelConfig& c, int64_t batch,
                                                 int64_t rows_per_sequence) {
  const int64_t R = saturating_rows(batch, rows_per_sequence), B = batch;
  const int64_t D = c.hidden_size, E = c.embed_dim();
  std::vector<ActivationBuffer> buffers;
  const auto layers = [&](Activation id, int64_t width) {
    buffers.push_back({id, activation_name(id), {R, width}, DType::F32, false});
  };
  const auto head = [&](Activation id, int64_t width) {
    buffers.push_back({id, activation_name(id), {B, width}, DType::F32, true});
  };
  layers(Activation::Hidden, D);
  layers(Activation::Normed, D);
  layers(Activation::Query, c.q_dim());
  layers(Activation::Key, c.kv_dim());
  layers(Activation::Value, c.kv_dim());
  layers(Activation::Attention, c.q_dim());
  layers(Activation::Ffn, c.ffn_dim);
  if (c.gated_ffn) layers(Activation::FfnUp, c.ffn_dim);
  if (E != D) layers(Activation::Embedding, E);
  head(Activation::Last, D);
  if (c.final_norm) head(Activation::FinalNormed, D);
  if (E != D) head(Activation::Projected, E);
  head(Activation::Logits, c.vocab_size);
  return buffers;
}

size_t activation_bytes(const ModelConfig& config, int64_t batch, int64_t rows_per_sequence) {
  size_t total = 0;
  for (const ActivationBuffer& buffer : activation_buffers(config, batch, rows_per_sequence)) {
    total = saturating_sum({total, buffer.bytes()});
  }
  return total;
}

Activations::Activations(const ModelConfig& config, Device device)
    : config_(config), device_(device) {}

void Activations::reserve(int64_t batch, int64_t rows_per_sequence) {
  INFINIGEN_CHECK(batch > 0 && rows_per_sequence > 0, "activations for a pass of ", batch,
                  " sequences of ", rows_per_sequence, " rows");
  for (const ActivationBuffer& want : activation_buffers(config_, batch, rows_per_sequence)) {
    Tensor& buffer = buffers_[static_cast<size_t>(want.id)];
    if (buffer.defined() && buffer.dim(0) >= want.shape[0]) continue;
    buffer = Tensor();  // the old buffer goes first: the two need not fit together
    buffer = Tensor::empty(want.shape, want.dtype, device_);
  }
  if (device_ == Device::Cpu) return;  // the logits are on the host already
  const int64_t head_rows = buffers_[static_cast<size_t>(Activation::Logits)].dim(0);
  if (host_logits_.defined() && host_logits_.dim(0) >= head_rows) return;
  host_logits_ = Tensor();
  const Shape shape = {head_rows, config_.vocab_size};
  if (dry_run()) {  // a shape without memory, as every buffer of a dry run
    host_logits_ = Tensor::empty(shape, DType::F32, Device::Cpu);
    return;
  }
  // Pinned: the device copies the logits straight into it.
  const size_t bytes = static_cast<size_t>(shape_numel(shape)) * sizeof(float);
  void* data = pinned_alloc(bytes, "the LM head's logits");
  host_logits_ = Tensor::view(data, shape, DType::F32, Device::Cpu,
                              std::shared_ptr<void>(data, [](void* p) { pinned_free(p); }));
}

Tensor Activations::rows(Activation id, int64_t rows) const {
  const Tensor& buffer = buffers_[static_cast<size_t>(id)];
  INFINIGEN_CHECK(buffer.defined() && rows <= buffer.dim(0), "activation buffer ",
                  activation_name(id), " holds ", buffer.defined() ? buffer.dim(0) : 0,
                  " rows, a pass needs ", rows, " (reserve first)");
  return buffer.slice_rows(0, rows);
}

Tensor Activations::host_logits(int64_t rows) const {
  if (device_ == Device::Cpu) return this->rows(Activation::Logits, rows);
  INFINIGEN_CHECK(host_logits_.defined() && rows <= host_logits_.dim(0), "host logits hold ",
                  host_logits_.defined() ? host_logits_.dim(0) : 0, " rows, a pass needs ", rows);
  return host_logits_.slice_rows(0, rows);
}

size_t Activations::bytes() const {
  size_t total = 0;
  for (const Tensor& buffer : buffers_) total += buffer.defined() ? buffer.nbytes() : 0;
  return total;
}

}  // namespace infinigen
