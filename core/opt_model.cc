// core: OPT forward pass, read top to bottom as one loop over layers.
#include "core/opt_model.h"

#include <cmath>

#include "core/interrupt.h"
#include "core/ops.h"

namespace infinigen {

namespace {

// The default source: every layer resident in OptWeights.
class ResidentLayers : public LayerWeightSource {
 public:
  explicit ResidentLayers(const std::vector<OptLayerWeights>& layers) : layers_(layers) {}
  const OptLayerWeights& layer(int64_t layer) override {
    return layers_[static_cast<size_t>(layer)];
  }

 private:
  const std::vector<OptLayerWeights>& layers_;
};

}  // namespace

OptModel::OptModel(ModelConfig config, OptWeights weights, Device device)
    : config_(std::move(config)), weights_(std::move(weights)), device_(device) {
  layers_ = std::make_unique<ResidentLayers>(weights_.layers);
}

OptModel::OptModel(ModelConfig config, OptWeights weights, Device device,
                   std::unique_ptr<LayerWeightSource> layers)
    : config_(std::move(config)),
      weights_(std::move(weights)),
      device_(device),
      layers_(std::move(layers)) {}

Tensor OptModel::prefill(const std::vector<int32_t>& tokens,
                         const std::vector<int32_t>& first_valid, KvStore& cache,
                         bool all_positions) {
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
  const Tensor hidden = forward(tokens, n, cache);  // (B*n, D)
  if (all_positions) return lm_head(hidden).reshape({B, n, config_.vocab_size});
  // Only each sequence's last row feeds the next token.
  Tensor last = Tensor::empty({B, config_.hidden_size}, DType::F32, device_);
  for (int64_t b = 0; b < B; ++b) {
    const Tensor row = hidden.slice_rows(b * n + n - 1, b * n + n);
    device_copy(last.slice_rows(b, b + 1).raw(), device_, row.raw(), device_, row.nbytes());
  }
  return lm_head(last);
}

Tensor OptModel::decode(const std::vector<int32_t>& tokens, KvStore& cache) {
  INFINIGEN_CHECK(cache.length() > 0, "decode needs a prefilled KV cache");
  INFINIGEN_CHECK(static_cast<int64_t>(tokens.size()) == cache.batch(), "decode: ", tokens.size(),
                  " tokens for a batch of ", cache.batch());
  return lm_head(forward(tokens, 1, cache));
}

Tensor OptModel::forward(const std::vector<int32_t>& tokens, int64_t n, KvStore& cache) {
  const ModelConfig& c = config_;
  const int64_t B = cache.batch(), D = c.hidden_size, rows = B * n;
  const int64_t past = cache.length();
  const std::vector<int32_t>& first_valid = cache.first_valid();
  cache.begin_pass(n);

  // Positions count real tokens only: OPT's learned table is offset by 2, padding uses row 1.
  std::vector<int32_t> positions(static_cast<size_t>(rows));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t t = past + i, start = first_valid[static_cast<size_t>(b)];
      positions[static_cast<size_t>(b * n + i)] = static_cast<int32_t>(
          t < start ? ModelConfig::kPositionOffset - 1 : t - start + ModelConfig::kPositionOffset);
    }
  }

  Tensor h = Tensor::empty({rows, D}, DType::F32, device_);  // residual stream (B*n, D)
  Tensor x = Tensor::empty({rows, D}, DType::F32, device_);  // normed input / block output
  Tensor q = Tensor::empty({rows, D}, DType::F32, device_);  // (B, n, H, d)
  Tensor k = Tensor::empty({rows, D}, DType::F32, device_);
  Tensor v = Tensor::empty({rows, D}, DType::F32, device_);
  Tensor attn = Tensor::empty({rows, D}, DType::F32, device_);
  Tensor ffn = Tensor::empty({rows, c.ffn_dim}, DType::F32, device_);
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim()));

  ops::embed(tokens, positions, weights_.embed_tokens, weights_.embed_positions, h);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    check_interrupt();
    cache.begin_layer(l);
    const OptLayerWeights& w = layers_->layer(l);
    // Self-attention block: h += out_proj(attention(LN(h))).
    ops::layer_norm(h, w.attn_norm_weight, w.attn_norm_bias, c.layer_norm_eps, x);
    ops::linear(x, w.q_weight, w.q_bias, q);
    ops::scale_inplace(q, q_scale);
    ops::linear(x, w.k_weight, w.k_bias, k);
    ops::linear(x, w.v_weight, w.v_bias, v);
    cache.observe(l, x, q, w);
    cache.append(l, k, v);
    if (past == 0) {
      ops::attention_prefill(q, k, v, attn, B, c.num_heads, first_valid);
    } else {
      const KvStore::View kv = cache.view(l);
      ops::attention_decode(q, *kv.keys, *kv.values, attn, kv.length,
                            kv.first_valid ? *kv.first_valid : first_valid);
    }
    ops::linear(attn, w.out_weight, w.out_bias, x);
    ops::add_inplace(h, x);
    // Feed-forward block: h += fc2(relu(fc1(LN(h)))).
    ops::layer_norm(h, w.ffn_norm_weight, w.ffn_norm_bias, c.layer_norm_eps, x);
    ops::linear(x, w.fc1_weight, w.fc1_bias, ffn, /*relu=*/true);
    ops::linear(ffn, w.fc2_weight, w.fc2_bias, x);
    ops::add_inplace(h, x);
  }
  cache.end_pass(n);
  return h;
}

Tensor OptModel::lm_head(const Tensor& hidden) const {
  Tensor normed = Tensor::empty(hidden.shape(), DType::F32, device_);
  ops::layer_norm(hidden, weights_.final_norm_weight, weights_.final_norm_bias,
                  config_.layer_norm_eps, normed);
  Tensor logits = Tensor::empty({hidden.dim(0), config_.vocab_size}, DType::F32, device_);
  ops::linear(normed, weights_.embed_tokens, Tensor(), logits);
  return device_ == Device::Cpu ? logits : logits.to(Device::Cpu);
}

}  // namespace infinigen
