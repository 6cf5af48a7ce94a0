// core: what every model family shares: request checks, the last position's logits, and the
// family dispatch.
#include "core/model.h"

#include <algorithm>
#include <cstring>

#include "core/cpu_threads.h"
#include "core/interrupt.h"
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
      activations_(config_, device_),
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
  const int64_t B = cache.pass_batch(), past = cache.length();
  const SharedPrefixes& shared = cache.shared();
  const bool after_prefixes = !cache.sharing_pass();
  std::vector<int32_t> positions(static_cast<size_t>(B * n_new));
  for (int64_t i = 0; i < B; ++i) {
    const int64_t b = cache.pass_sequence(i);
    const int64_t start = cache.pass_first_valid()[static_cast<size_t>(i)];
    const int64_t prefix = after_prefixes ? shared.prefix_length(b) : 0;
    for (int64_t j = 0; j < n_new; ++j) {
      const int64_t t = past + j;
      // The sequence's shared prefix, then its own tokens after its padding.
      positions[static_cast<size_t>(i * n_new + j)] =
          after_prefixes && shared.in_prefix(b, t)
              ? static_cast<int32_t>(offset + t - shared.begin(b))
          : t < start ? padding
                      : static_cast<int32_t>(offset + prefix + t - start);
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
  // A decode step, or an extension of the stored tokens by the pass's rows (causal).
  const KvStore::View kv = cache.view(layer);
  const std::vector<int32_t>& first_valid = kv.first_valid ? *kv.first_valid : cache.first_valid();
  ops::attention_decode(q, *kv.keys, *kv.values, out, kv.length, first_valid, kv.shared);
}

const Tensor& Model::attention_skew(int64_t l) const {
  static const Tensor none;
  return weights_.attention_skew.empty() ? none : weights_.attention_skew[static_cast<size_t>(l)];
}

const TensorTable& Model::layer(int64_t l) {
  trace_layer(l);
  return layers_->layer(l);
}

const TensorTable& Model::begin_layer(int64_t l, KvStore& cache) {
  check_interrupt();
  adapt_cpu_threads();
  cache.begin_layer(l);
  return layer(l);
}

Tensor Model::prefill(const std::vector<int32_t>& tokens, const std::vector<int32_t>& first_valid,
                      KvStore& cache, bool all_positions, int64_t chunk) {
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
  cache.expect_prompt(n);
  return run_prompt(tokens, cache, all_positions, chunk);
}

void Model::prefill_shared(const std::vector<int32_t>& prefixes, KvStore& cache) {
  const SharedPrefixes& shared = cache.shared();
  INFINIGEN_CHECK(
      cache.sharing_pass() && std::ssize(prefixes) == shared.num_groups() * shared.rows(),
      "prefill_shared: the store does not expect ", prefixes.size(), " tokens of shared prefixes");
  trace_layer(-1);
  forward(prefixes, shared.rows(), cache);
  trace_layer(-1);
}

Tensor Model::extend(const std::vector<int32_t>& tokens, KvStore& cache, int64_t chunk) {
  const int64_t B = cache.batch();
  INFINIGEN_CHECK(cache.length() > 0, "extend needs a KV cache that holds tokens");
  INFINIGEN_CHECK(!tokens.empty() && static_cast<int64_t>(tokens.size()) % B == 0,
                  "extend: ", tokens.size(), " tokens do not form a batch of ", B);
  cache.expect_prompt(cache.length() + std::ssize(tokens) / B);
  return run_prompt(tokens, cache, false, chunk);
}

Tensor Model::run_prompt(const std::vector<int32_t>& tokens, KvStore& cache, bool all_positions,
                         int64_t chunk) {
  INFINIGEN_CHECK(chunk >= 0, "a prompt's chunk of ", chunk, " tokens");
  const int64_t B = cache.batch(), n = std::ssize(tokens) / B;
  const Logits wanted = all_positions ? Logits::All : Logits::Last;
  if (largest_prompt_pass(n, chunk) == n) return run_pass(tokens, cache, wanted).clone();
  // Every row's logits are gathered chunk by chunk; only the last chunk's last rows otherwise.
  Tensor all = all_positions ? Tensor::empty({B, n, config_.vocab_size}, DType::F32) : Tensor();
  const size_t row_bytes = static_cast<size_t>(config_.vocab_size) * sizeof(float);
  std::vector<int32_t> part;
  for (int64_t t0 = 0; t0 < n; t0 += chunk) {
    const int64_t t1 = std::min(n, t0 + chunk), c = t1 - t0;
    part.resize(static_cast<size_t>(B * c));
    for (int64_t b = 0; b < B; ++b) {
      std::copy_n(tokens.begin() + b * n + t0, c, part.begin() + b * c);
    }
    const Tensor logits = run_pass(part, cache, all_positions || t1 == n ? wanted : Logits::None);
    if (t1 == n && !all_positions) return logits.clone();
    if (!all_positions) continue;
    for (int64_t b = 0; b < B; ++b) {  // (B, c, V) into rows [t0, t1) of (B, n, V)
      std::memcpy(all.data<float>() + (b * n + t0) * config_.vocab_size,
                  logits.data<float>() + b * c * config_.vocab_size,
                  static_cast<size_t>(c) * row_bytes);
    }
  }
  return all;
}

Tensor Model::run_pass(const std::vector<int32_t>& tokens, KvStore& cache, Logits logits) {
  const int64_t B = cache.batch();
  const int64_t n = static_cast<int64_t>(tokens.size()) / B;
  trace_layer(-1);
  const Tensor hidden = forward(tokens, n, cache);  // (B*n, D)
  trace_layer(-1);
  if (logits == Logits::None) return {};
  if (logits == Logits::All) {
    // Every row through the LM head: its buffers grow to B * n rows (tests and evaluation ask
    // for this; generation never does).
    activations_.reserve(B * n, 1);
    return lm_head(hidden).reshape({B, n, config_.vocab_size});
  }
  // Only each sequence's last row feeds the next token.
  Tensor last = activations_.rows(Activation::Last, B);  // (B, D)
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
