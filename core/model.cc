// core: what every model family shares: request checks, the last position's logits, and the
// family dispatch.
#include "core/model.h"

#include <algorithm>

#include "core/model_family.h"
#include "core/ops.h"
#include "core/trace.h"

namespace infinigen {
namespace {

// The default source: every layer resident in ModelWeights.
class ResidentLayers : public LayerWeightSource {
 public:
  explicit ResidentLayers(const std::vector<TensorTable>& layers) : layers_(layers) {}
  const TensorTable& layer(int64_t layer) override { return layers_[static_cast<size_t>(layer)]; }

 private:
  const std::vector<TensorTable>& layers_;
};

}  // namespace

Model::Model(ModelConfig config, ModelWeights weights, Device device,
             std::unique_ptr<LayerWeightSource> layers)
    : config_(std::move(config)),
      device_(device),
      weights_(std::move(weights)),
      layers_(std::move(layers)) {
  if (!layers_) {
    INFINIGEN_CHECK(static_cast<int64_t>(weights_.layers.size()) == config_.num_layers,
                    config_.name, ": weights for ", weights_.layers.size(), " of ",
                    config_.num_layers, " layers");
    layers_ = std::make_unique<ResidentLayers>(weights_.layers);
  }
}

std::vector<int32_t> Model::token_positions(const KvStore& cache, int64_t n_new, int32_t offset,
                                            int32_t padding) {
  const int64_t B = cache.pass_batch(), past = cache.length(), shared = cache.shared_rows();
  std::vector<int32_t> positions(static_cast<size_t>(B * n_new));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t start = cache.sharing_pass() ? 0 : cache.first_valid()[static_cast<size_t>(b)];
    for (int64_t i = 0; i < n_new; ++i) {
      const int64_t t = past + i;
      // The shared prefix's rows, then the sequence's own after its padding.
      positions[static_cast<size_t>(b * n_new + i)] =
          t < shared  ? static_cast<int32_t>(offset + t)
          : t < start ? padding
                      : static_cast<int32_t>(offset + shared + t - start);
    }
  }
  return positions;
}

void Model::attend(int64_t layer, const Tensor& q, const Tensor& k, const Tensor& v, KvStore& cache,
                   Tensor& out) const {
  if (cache.length() == 0) {
    ops::attention_prefill(q, k, v, out, cache.pass_batch(), config_.num_heads,
                           cache.pass_first_valid());
    return;
  }
  const KvStore::View kv = cache.view(layer);
  const std::vector<int32_t>& first_valid = kv.first_valid ? *kv.first_valid : cache.first_valid();
  const int64_t n = cache.pass_tokens();
  if (n == 1) {
    ops::attention_decode(q, *kv.keys, *kv.values, out, kv.length, first_valid, kv.shared_rows);
    return;
  }
  // Extension by n rows: row i of each sequence attends to the rows before it and itself, one
  // decode-shaped attention per row (B rows of q gathered, the view's length cut at the row). A
  // padding row attends to itself alone; nothing reads its output.
  const int64_t B = cache.batch(), width = q.dim(1);
  const size_t row_bytes = static_cast<size_t>(width) * sizeof(float);
  Tensor q_row = Tensor::empty({B, width}, DType::F32, device_);
  Tensor out_row = Tensor::empty({B, width}, DType::F32, device_);
  std::vector<int32_t> row_first_valid(first_valid.size());
  for (int64_t i = 0; i < n; ++i) {
    const int64_t length = kv.length - n + i + 1;
    for (int64_t b = 0; b < B; ++b) {
      device_copy(static_cast<char*>(q_row.raw()) + b * row_bytes, device_,
                  static_cast<const char*>(q.raw()) + (b * n + i) * row_bytes, device_, row_bytes);
      row_first_valid[b] = static_cast<int32_t>(std::min<int64_t>(first_valid[b], length - 1));
    }
    ops::attention_decode(q_row, *kv.keys, *kv.values, out_row, length, row_first_valid,
                          kv.shared_rows);
    for (int64_t b = 0; b < B; ++b) {
      device_copy(static_cast<char*>(out.raw()) + (b * n + i) * row_bytes, device_,
                  static_cast<const char*>(out_row.raw()) + b * row_bytes, device_, row_bytes);
    }
  }
}

const Tensor& Model::attention_skew(int64_t l) const {
  static const Tensor none;
  return weights_.attention_skew.empty() ? none : weights_.attention_skew[static_cast<size_t>(l)];
}

const TensorTable& Model::layer(int64_t l) {
  trace_layer(l);
  return layers_->layer(l);
}

Tensor Model::prefill(const std::vector<int32_t>& tokens, const std::vector<int32_t>& first_valid,
                      KvStore& cache, bool all_positions) {
  const int64_t B = cache.batch();
  INFINIGEN_CHECK(cache.length() == 0, "prefill needs an empty KV cache");
  INFINIGEN_CHECK(B > 0 && static_cast<int64_t>(tokens.size()) % B == 0 &&
                      static_cast<int64_t>(first_valid.size()) == B,
                  "prefill: ", tokens.size(), " tokens do not form a batch of ", B);
  const int64_t n = static_cast<int64_t>(tokens.size()) / B;
  for (int32_t start : first_valid) {
    INFINIGEN_CHECK(start >= 0 && start < n, "prefill: every sequence needs at least one token");
  }
  cache.set_first_valid(first_valid);
  return run_pass(tokens, cache, all_positions);
}

void Model::prefill_shared(const std::vector<int32_t>& prefix, KvStore& cache) {
  INFINIGEN_CHECK(cache.sharing_pass() && std::ssize(prefix) == cache.shared_rows(),
                  "prefill_shared: the store does not expect a shared prefix of ", prefix.size(),
                  " tokens");
  trace_layer(-1);
  forward(prefix, std::ssize(prefix), cache);
  trace_layer(-1);
}

Tensor Model::extend(const std::vector<int32_t>& tokens, KvStore& cache) {
  const int64_t B = cache.batch();
  INFINIGEN_CHECK(cache.length() > 0, "extend needs a KV cache that holds tokens");
  INFINIGEN_CHECK(!tokens.empty() && static_cast<int64_t>(tokens.size()) % B == 0, "extend: ",
                  tokens.size(), " tokens do not form a batch of ", B);
  return run_pass(tokens, cache, false);
}

Tensor Model::run_pass(const std::vector<int32_t>& tokens, KvStore& cache, bool all_positions) {
  const int64_t B = cache.batch();
  const int64_t n = static_cast<int64_t>(tokens.size()) / B;
  trace_layer(-1);
  const Tensor hidden = forward(tokens, n, cache);  // (B*n, D)
  trace_layer(-1);
  if (all_positions) return lm_head(hidden).reshape({B, n, config_.vocab_size});
  // Only each sequence's last row feeds the next token.
  const int64_t D = hidden.dim(1);
  Tensor last = Tensor::empty({B, D}, DType::F32, device_);
  for (int64_t b = 0; b < B; ++b) {
    const Tensor row = hidden.slice_rows(b * n + n - 1, b * n + n);
    device_copy(last.slice_rows(b, b + 1).raw(), device_, row.raw(), device_, row.nbytes());
  }
  return lm_head(last);
}

Tensor Model::decode(const std::vector<int32_t>& tokens, KvStore& cache) {
  INFINIGEN_CHECK(cache.length() > 0, "decode needs a prefilled KV cache");
  INFINIGEN_CHECK(static_cast<int64_t>(tokens.size()) == cache.batch(), "decode: ", tokens.size(),
                  " tokens for a batch of ", cache.batch());
  trace_layer(-1);
  const Tensor hidden = forward(tokens, 1, cache);
  trace_layer(-1);
  return lm_head(hidden);
}

std::unique_ptr<Model> make_model(const ModelConfig& config, ModelWeights weights, Device device,
                                  std::unique_ptr<LayerWeightSource> layers) {
  return model_family(config.family).make(config, std::move(weights), device, std::move(layers));
}

}  // namespace infinigen
