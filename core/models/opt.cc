// core/models: the OPT forward pass, read top to bottom as one loop over layers.
#include "core/models/opt.h"

#include <cmath>
#include <nlohmann/json.hpp>

#include "core/config_keys.h"
#include "core/interrupt.h"
#include "core/ops.h"

namespace infinigen {
namespace {

constexpr const char* kPrefix = "model.decoder.";

// OPT's learned position table is offset by 2: rows 0 and 1 are never used by real tokens, and
// left padding reads row 1.
constexpr int32_t kOptPositionOffset = 2;

std::string global(const char* name) {
  return std::string(kPrefix) + name;
}

class OptModel : public Model {
 public:
  OptModel(const ModelConfig& config, ModelWeights weights, Device device,
           std::unique_ptr<LayerWeightSource> layers)
      : Model(config, std::move(weights), device, std::move(layers)) {}

 private:
  Tensor forward(const std::vector<int32_t>& tokens, int64_t n_new, KvStore& cache) override;
  Tensor lm_head(const Tensor& hidden) override;
};

ModelConfig opt_config_from_json(const nlohmann::json& j, const std::string& source) {
  using namespace config_keys;
  ModelConfig c;
  c.hidden_size = positive_int(j, "hidden_size", source);
  c.num_layers = positive_int(j, "num_hidden_layers", source);
  c.num_heads = positive_int(j, "num_attention_heads", source);
  c.ffn_dim = positive_int(j, "ffn_dim", source);
  c.vocab_size = positive_int(j, "vocab_size", source);
  c.max_positions = positive_int(j, "max_position_embeddings", source);
  INFINIGEN_CHECK(c.hidden_size % c.num_heads == 0, source, ": hidden_size ", c.hidden_size,
                  " is not divisible by num_attention_heads ", c.num_heads);
  c.pad_token_id = token_id(j, "pad_token_id", 1, source);
  c.bos_token_id = token_id(j, "bos_token_id", 2, source);
  c.eos_token_id = token_id(j, "eos_token_id", 2, source);
  // Kept only when it differs from the width (so that code resizing a model, such as bench's
  // --scale, keeps an unprojected model unprojected).
  if (j.contains("word_embed_proj_dim") && !j.at("word_embed_proj_dim").is_null()) {
    const int64_t embed = positive_int(j, "word_embed_proj_dim", source);
    c.word_embed_dim = embed == c.hidden_size ? 0 : embed;
  }
  c.pre_norm = flag(j, "do_layer_norm_before", true, source);
  // transformers builds the final LayerNorm only for pre-LayerNorm models.
  c.final_norm = c.pre_norm && !flag(j, "_remove_final_layer_norm", false, source);
  require(j, "activation_function", std::string("relu"), source, "OPT uses ReLU");
  require(j, "enable_bias", true, source, "linear layers without bias are not supported");
  require(j, "layer_norm_elementwise_affine", true, source,
          "LayerNorm without weight and bias is not supported");
  require(j, "tie_word_embeddings", true, source, "the LM head must be tied to the embedding");
  return c;
}

nlohmann::json opt_config_to_json(const ModelConfig& c) {
  return {{"architectures", {"OPTForCausalLM"}},
          {"model_type", "opt"},
          {"hidden_size", c.hidden_size},
          {"num_hidden_layers", c.num_layers},
          {"num_attention_heads", c.num_heads},
          {"ffn_dim", c.ffn_dim},
          {"max_position_embeddings", c.max_positions},
          {"word_embed_proj_dim", c.embed_dim()},
          {"do_layer_norm_before", c.pre_norm},
          {"activation_function", "relu"},
          {"enable_bias", true},
          {"layer_norm_elementwise_affine", true},
          {"_remove_final_layer_norm", c.pre_norm && !c.final_norm},
          {"tie_word_embeddings", true},
          {"dropout", 0.0},
          {"attention_dropout", 0.0},
          {"activation_dropout", 0.0},
          {"layerdrop", 0.0},
          {"init_std", 0.02},
          {"use_cache", true}};
}

WeightLayout opt_weight_layout(const ModelConfig& c) {
  using R = TensorRole;
  const int64_t D = c.hidden_size, F = c.ffn_dim, E = c.embed_dim();
  WeightLayout layout;
  layout.layer_prefix = global("layers.");
  layout.num_layers = c.num_layers;
  layout.first = {{global("embed_tokens.weight"), {c.vocab_size, E}, R::TokenEmbedding},
                  {global("embed_positions.weight"),
                   {c.max_positions + kOptPositionOffset, D},
                   R::PositionEmbedding}};
  if (E != D) layout.first.push_back({global("project_in.weight"), {D, E}, R::EmbeddingProjection});
  const struct {
    const char* name;
    TensorRole weight, bias;
  } projections[] = {{"q_proj", R::QueryWeight, R::QueryBias},
                     {"k_proj", R::KeyWeight, R::KeyBias},
                     {"v_proj", R::ValueWeight, R::ValueBias},
                     {"out_proj", R::AttentionOutputWeight, R::AttentionOutputBias}};
  for (const auto& proj : projections) {
    layout.layer.push_back(
        {std::string("self_attn.") + proj.name + ".weight", {D, D}, proj.weight});
    layout.layer.push_back({std::string("self_attn.") + proj.name + ".bias", {D}, proj.bias});
  }
  layout.layer.insert(layout.layer.end(), {{"self_attn_layer_norm.weight", {D}, R::NormWeight},
                                           {"self_attn_layer_norm.bias", {D}, R::NormBias},
                                           {"fc1.weight", {F, D}, R::FfnInputWeight},
                                           {"fc1.bias", {F}, R::FfnInputBias},
                                           {"fc2.weight", {D, F}, R::FfnOutputWeight},
                                           {"fc2.bias", {D}, R::FfnOutputBias},
                                           {"final_layer_norm.weight", {D}, R::NormWeight},
                                           {"final_layer_norm.bias", {D}, R::NormBias}});
  if (c.final_norm) {
    layout.last = {{global("final_layer_norm.weight"), {D}, R::NormWeight},
                   {global("final_layer_norm.bias"), {D}, R::NormBias}};
  }
  if (E != D) {
    layout.last.push_back({global("project_out.weight"), {E, D}, R::EmbeddingProjection});
  }
  return layout;
}

Tensor OptModel::forward(const std::vector<int32_t>& tokens, int64_t n, KvStore& cache) {
  const ModelConfig& c = config_;
  const int64_t B = cache.pass_batch(), D = c.hidden_size, rows = B * n;
  // Positions count real tokens only: the learned table is offset by 2, padding uses row 1.
  const std::vector<int32_t> positions =
      token_positions(cache, n, kOptPositionOffset, kOptPositionOffset - 1);
  cache.begin_pass(n);

  // The pass's rows of the activation buffers (core/activations.h), reserved by the run; a pass
  // bigger than any before grows them here, once.
  activations_.reserve(B, n);
  const auto buffer = [&](Activation id) { return activations_.rows(id, rows); };
  Tensor h = buffer(Activation::Hidden);        // residual stream (B*n, D)
  Tensor x = buffer(Activation::Normed);        // normed input / block output (B*n, D)
  Tensor q = buffer(Activation::Query);         // (B, n, H, d)
  Tensor k = buffer(Activation::Key);           // (B, n, H, d)
  Tensor v = buffer(Activation::Value);         // (B, n, H, d)
  Tensor attn = buffer(Activation::Attention);  // (B*n, D)
  Tensor ffn = buffer(Activation::Ffn);         // (B*n, F)
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim()));
  const Tensor none;  // OPT has no rotation, and folds InfiniGen's skew into its weights

  const TensorTable& g = globals();
  if (c.embed_dim() == D) {
    ops::embed(tokens, positions, g.get(global("embed_tokens.weight")),
               g.get(global("embed_positions.weight")), h);
  } else {
    // opt-350m: token embeddings (B*n, E) projected to the model width, then positions added.
    Tensor e = buffer(Activation::Embedding);
    ops::embed(tokens, {}, g.get(global("embed_tokens.weight")), Tensor(), e);
    ops::linear(e, g.get(global("project_in.weight")), Tensor(), h);
    ops::embed(positions, {}, g.get(global("embed_positions.weight")), Tensor(), x);
    ops::add_inplace(h, x);
  }
  // Pre-LayerNorm blocks normalise their input; post-LayerNorm ones (opt-350m) their output.
  const bool pre = c.pre_norm;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const TensorTable& w = begin_layer(l, cache);
    // Self-attention block: h += out_proj(attention(LN(h))) (pre), h = LN(h + ...) (post).
    if (pre) {
      ops::layer_norm(h, w.get("self_attn_layer_norm.weight"), w.get("self_attn_layer_norm.bias"),
                      c.norm_eps, x);
    }
    const Tensor& in = pre ? x : h;
    const Tensor& wq = w.get("self_attn.q_proj.weight");
    const Tensor& bq = w.get("self_attn.q_proj.bias");
    ops::linear(in, wq, bq, q);
    ops::scale_inplace(q, q_scale);
    ops::linear(in, w.get("self_attn.k_proj.weight"), w.get("self_attn.k_proj.bias"), k);
    ops::linear(in, w.get("self_attn.v_proj.weight"), w.get("self_attn.v_proj.bias"), v);
    cache.observe(l, {in, q, wq, bq, none, positions, none});
    cache.append(l, k, v);
    attend(l, q, k, v, cache, attn);
    ops::linear(attn, w.get("self_attn.out_proj.weight"), w.get("self_attn.out_proj.bias"), x);
    ops::add_inplace(h, x);
    if (!pre) {
      ops::layer_norm(h, w.get("self_attn_layer_norm.weight"), w.get("self_attn_layer_norm.bias"),
                      c.norm_eps, h);
    }
    check_interrupt();  // also between the halves of a layer: each takes seconds in a long prefill
    // Feed-forward block: h += fc2(relu(fc1(LN(h)))) (pre), h = LN(h + ...) (post).
    if (pre) {
      ops::layer_norm(h, w.get("final_layer_norm.weight"), w.get("final_layer_norm.bias"),
                      c.norm_eps, x);
    }
    ops::linear(pre ? x : h, w.get("fc1.weight"), w.get("fc1.bias"), ffn, /*relu=*/true);
    ops::linear(ffn, w.get("fc2.weight"), w.get("fc2.bias"), x);
    ops::add_inplace(h, x);
    if (!pre) {
      ops::layer_norm(h, w.get("final_layer_norm.weight"), w.get("final_layer_norm.bias"),
                      c.norm_eps, h);
    }
  }
  cache.end_pass(n);
  return h;
}

Tensor OptModel::lm_head(const Tensor& hidden) {
  const TensorTable& g = globals();
  const int64_t rows = hidden.dim(0);
  Tensor out = hidden;  // (rows, D), then (rows, E)
  if (config_.final_norm) {
    out = activations_.rows(Activation::FinalNormed, rows);
    ops::layer_norm(hidden, g.get(global("final_layer_norm.weight")),
                    g.get(global("final_layer_norm.bias")), config_.norm_eps, out);
  }
  if (config_.embed_dim() != config_.hidden_size) {
    Tensor projected = activations_.rows(Activation::Projected, rows);
    ops::linear(out, g.get(global("project_out.weight")), Tensor(), projected);
    out = projected;
  }
  // The LM head is tied to the token embedding.
  Tensor logits = activations_.rows(Activation::Logits, rows);  // (rows, V)
  ops::linear(out, g.get(global("embed_tokens.weight")), Tensor(), logits);
  if (device_ == Device::Cpu) return logits;
  Tensor host = activations_.host_logits(rows);
  device_copy(host.raw(), Device::Cpu, logits.raw(), device_, logits.nbytes());
  return host;
}

}  // namespace

const ModelFamily& opt_family() {
  static const ModelFamily family{
      "opt",
      {"opt"},
      opt_config_from_json,
      opt_config_to_json,
      opt_weight_layout,
      [](const ModelConfig& config, ModelWeights weights, Device device,
         std::unique_ptr<LayerWeightSource> layers) -> std::unique_ptr<Model> {
        return std::make_unique<OptModel>(config, std::move(weights), device, std::move(layers));
      }};
  return family;
}

}  // namespace infinigen
