// core/models: the Llama family's config keys, tensor layout and forward pass, read top to bottom
// as one loop over layers.
#include "core/models/llama.h"

#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>

#include "core/config_keys.h"
#include "core/interrupt.h"
#include "core/ops.h"
#include "core/rope.h"

namespace infinigen {
namespace {

using nlohmann::json;

constexpr const char* kArchitectures[][2] = {{"llama", "LlamaForCausalLM"},
                                             {"mistral", "MistralForCausalLM"},
                                             {"qwen2", "Qwen2ForCausalLM"}};

class LlamaModel : public Model {
 public:
  LlamaModel(const ModelConfig& config, ModelWeights weights, Device device,
             std::unique_ptr<LayerWeightSource> layers);

 private:
  Tensor forward(const std::vector<int32_t>& tokens, int64_t n_new, KvStore& cache) override;
  Tensor lm_head(const Tensor& hidden) override;

  Tensor inv_freq_;  // (d / 2) fp32 on the device: the rotary frequencies (core/rope.h)
};

// rope_theta and rope_scaling (transformers 4), or rope_parameters (transformers 5).
RopeConfig rope_from_json(const json& j, const std::string& source) {
  using namespace config_keys;
  RopeConfig rope;
  const bool v5 = j.contains("rope_parameters") && j.at("rope_parameters").is_object();
  const json& scaling =
      v5 ? j.at("rope_parameters") : (j.contains("rope_scaling") ? j.at("rope_scaling") : json());
  rope.theta = positive_number_or(v5 ? scaling : j, "rope_theta", 10000.0, source);
  if (scaling.is_null()) return rope;
  INFINIGEN_CHECK(scaling.is_object(), source, ": 'rope_scaling' must be an object or null, got ",
                  scaling.dump());
  const std::string type = scaling.contains("rope_type") ? text(scaling, "rope_type", "", source)
                                                         : text(scaling, "type", "default", source);
  if (type == "default") return rope;
  if (type == "linear") {
    rope.scaling = RopeConfig::Scaling::Linear;
    rope.factor = positive_number_or(scaling, "factor", 0, source);
    INFINIGEN_CHECK(rope.factor > 0, source, ": rope_scaling of type linear needs a 'factor'");
    return rope;
  }
  if (type == "llama3") {
    rope.scaling = RopeConfig::Scaling::Llama3;
    rope.factor = positive_number_or(scaling, "factor", 0, source);
    rope.low_freq_factor = positive_number_or(scaling, "low_freq_factor", 0, source);
    rope.high_freq_factor = positive_number_or(scaling, "high_freq_factor", 0, source);
    rope.original_max_positions =
        positive_int_or(scaling, "original_max_position_embeddings", 0, source);
    INFINIGEN_CHECK(rope.factor > 0 && rope.low_freq_factor > 0 &&
                        rope.high_freq_factor > rope.low_freq_factor &&
                        rope.original_max_positions > 0,
                    source,
                    ": rope_scaling of type llama3 needs factor, low_freq_factor < "
                    "high_freq_factor and original_max_position_embeddings");
    return rope;
  }
  fail(source, ": unsupported rope_scaling type \"", type,
       "\" (default, linear and llama3 are supported)");
}

json rope_scaling_json(const RopeConfig& rope) {
  switch (rope.scaling) {
    case RopeConfig::Scaling::None:
      return nullptr;
    case RopeConfig::Scaling::Linear:
      return {{"rope_type", "linear"}, {"factor", rope.factor}};
    case RopeConfig::Scaling::Llama3:
      return {{"rope_type", "llama3"},
              {"factor", rope.factor},
              {"low_freq_factor", rope.low_freq_factor},
              {"high_freq_factor", rope.high_freq_factor},
              {"original_max_position_embeddings", rope.original_max_positions}};
  }
  return nullptr;
}

ModelConfig llama_config_from_json(const json& j, const std::string& source) {
  using namespace config_keys;
  const std::string type = text(j, "model_type", "llama", source);
  ModelConfig c;
  c.hidden_size = positive_int(j, "hidden_size", source);
  c.num_layers = positive_int(j, "num_hidden_layers", source);
  c.num_heads = positive_int(j, "num_attention_heads", source);
  c.num_kv_heads = positive_int_or(j, "num_key_value_heads", c.num_heads, source);
  INFINIGEN_CHECK(c.num_heads % c.num_kv_heads == 0, source, ": num_key_value_heads ",
                  c.num_kv_heads, " does not divide num_attention_heads ", c.num_heads);
  if (c.num_kv_heads == c.num_heads) c.num_kv_heads = 0;
  c.explicit_head_dim = positive_int_or(j, "head_dim", 0, source);
  INFINIGEN_CHECK(c.explicit_head_dim > 0 || c.hidden_size % c.num_heads == 0, source,
                  ": hidden_size ", c.hidden_size, " is not divisible by num_attention_heads ",
                  c.num_heads, " and no head_dim is given");
  INFINIGEN_CHECK(c.head_dim() % 2 == 0, source, ": head size ", c.head_dim(),
                  " is odd (rotary embeddings rotate pairs of channels)");
  c.ffn_dim = positive_int(j, "intermediate_size", source);
  c.vocab_size = positive_int(j, "vocab_size", source);
  c.max_positions = positive_int(j, "max_position_embeddings", source);
  // Within a sliding window attention is full attention, so a window bounds the context.
  const bool windowed =
      type == "qwen2" ? flag(j, "use_sliding_window", false, source) : j.contains("sliding_window");
  if (windowed && j.contains("sliding_window") && !j.at("sliding_window").is_null()) {
    c.max_positions = std::min(c.max_positions, positive_int(j, "sliding_window", source));
  }
  c.bos_token_id = token_id(j, "bos_token_id", 1, source);
  c.eos_token_id = token_id(j, "eos_token_id", 2, source);
  c.pad_token_id = token_id(j, "pad_token_id", c.eos_token_id, source);
  c.norm = NormKind::Rms;
  c.norm_eps = static_cast<float>(positive_number_or(j, "rms_norm_eps", 1e-6, source));
  require(j, "hidden_act", std::string("silu"), source, "the Llama family's FFN is SwiGLU");
  c.gated_ffn = true;
  if (type == "qwen2") {  // Q/K/V biases, none on the output projection
    c.qkv_bias = true;
    c.out_bias = false;
  } else {
    c.qkv_bias = c.out_bias = flag(j, "attention_bias", false, source);
  }
  c.ffn_bias = flag(j, "mlp_bias", false, source);
  c.tied_embeddings = flag(j, "tie_word_embeddings", false, source);
  c.rope = rope_from_json(j, source);
  return c;
}

json llama_config_to_json(const ModelConfig& c) {
  std::string architecture = "LlamaForCausalLM";
  for (const auto& [type, name] : kArchitectures) {
    if (c.model_type == type) architecture = name;
  }
  json j = {{"architectures", {architecture}},
            {"model_type", c.model_type},
            {"hidden_size", c.hidden_size},
            {"intermediate_size", c.ffn_dim},
            {"num_hidden_layers", c.num_layers},
            {"num_attention_heads", c.num_heads},
            {"num_key_value_heads", c.kv_heads()},
            {"head_dim", c.head_dim()},
            {"max_position_embeddings", c.max_positions},
            {"rms_norm_eps", c.norm_eps},
            {"hidden_act", "silu"},
            {"rope_theta", c.rope.theta},
            {"rope_scaling", rope_scaling_json(c.rope)},
            {"mlp_bias", c.ffn_bias},
            {"tie_word_embeddings", c.tied_embeddings},
            {"initializer_range", 0.02},
            {"attention_dropout", 0.0},
            {"use_cache", true}};
  if (c.model_type == "qwen2") {
    j["use_sliding_window"] = false;
  } else {
    j["attention_bias"] = c.qkv_bias;
  }
  if (c.model_type == "mistral") j["sliding_window"] = nullptr;
  return j;
}

WeightLayout llama_weight_layout(const ModelConfig& c) {
  using R = TensorRole;
  const int64_t D = c.hidden_size, F = c.ffn_dim, Q = c.q_dim(), KV = c.kv_dim();
  WeightLayout layout;
  layout.layer_prefix = "model.layers.";
  layout.num_layers = c.num_layers;
  layout.first = {{"model.embed_tokens.weight", {c.vocab_size, D}, R::TokenEmbedding}};
  const auto add = [&](const std::string& name, Shape shape, TensorRole weight, TensorRole bias,
                       bool with_bias) {
    layout.layer.push_back({name + ".weight", shape, weight});
    if (with_bias) layout.layer.push_back({name + ".bias", {shape[0]}, bias});
  };
  add("self_attn.q_proj", {Q, D}, R::QueryWeight, R::QueryBias, c.qkv_bias);
  add("self_attn.k_proj", {KV, D}, R::KeyWeight, R::KeyBias, c.qkv_bias);
  add("self_attn.v_proj", {KV, D}, R::ValueWeight, R::ValueBias, c.qkv_bias);
  add("self_attn.o_proj", {D, Q}, R::AttentionOutputWeight, R::AttentionOutputBias, c.out_bias);
  add("mlp.gate_proj", {F, D}, R::FfnInputWeight, R::FfnInputBias, c.ffn_bias);
  add("mlp.up_proj", {F, D}, R::FfnInputWeight, R::FfnInputBias, c.ffn_bias);
  add("mlp.down_proj", {D, F}, R::FfnOutputWeight, R::FfnOutputBias, c.ffn_bias);
  layout.layer.push_back({"input_layernorm.weight", {D}, R::NormWeight});
  layout.layer.push_back({"post_attention_layernorm.weight", {D}, R::NormWeight});
  layout.last = {{"model.norm.weight", {D}, R::NormWeight}};
  if (!c.tied_embeddings) layout.last.push_back({"lm_head.weight", {c.vocab_size, D}, R::LmHead});
  return layout;
}

LlamaModel::LlamaModel(const ModelConfig& config, ModelWeights weights, Device device,
                       std::unique_ptr<LayerWeightSource> layers)
    : Model(config, std::move(weights), device, std::move(layers)) {
  const std::vector<float> inv_freq = rope_inv_freq(config.rope, config.head_dim());
  inv_freq_ = Tensor::from_floats({static_cast<int64_t>(inv_freq.size())}, inv_freq).to(device);
}

Tensor LlamaModel::forward(const std::vector<int32_t>& tokens, int64_t n, KvStore& cache) {
  const ModelConfig& c = config_;
  const int64_t B = cache.pass_batch(), rows = B * n;
  // Positions count real tokens from 0; padding rows (never attended) rotate by 0.
  const std::vector<int32_t> positions = token_positions(cache, n, 0, 0);
  cache.begin_pass(n);

  // The pass's rows of the activation buffers (core/activations.h), reserved by the run; a pass
  // bigger than any before grows them here, once.
  activations_.reserve(B, n);
  const auto buffer = [&](Activation id) { return activations_.rows(id, rows); };
  Tensor h = buffer(Activation::Hidden);        // residual stream (B*n, D)
  Tensor x = buffer(Activation::Normed);        // normed input / output (B*n, D)
  Tensor q = buffer(Activation::Query);         // (B, n, H, d)
  Tensor k = buffer(Activation::Key);           // (B, n, H_kv, d)
  Tensor v = buffer(Activation::Value);         // (B, n, H_kv, d)
  Tensor attn = buffer(Activation::Attention);  // (B*n, H * d)
  Tensor gate = buffer(Activation::Ffn);        // (B*n, F)
  Tensor up = buffer(Activation::FfnUp);        // (B*n, F)
  const float q_scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim()));
  const auto bias = [](const TensorTable& w, const char* name) {
    const Tensor* b = w.find(name);
    return b != nullptr ? *b : Tensor();
  };

  ops::embed(tokens, {}, globals().get("model.embed_tokens.weight"), Tensor(), h);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const TensorTable& w = begin_layer(l, cache);
    // Self-attention block: h += o_proj(attention(rope(q), rope(k), v)) of RMSNorm(h).
    ops::rms_norm(h, w.get("input_layernorm.weight"), c.norm_eps, x);
    const Tensor& wq = w.get("self_attn.q_proj.weight");
    const Tensor bq = bias(w, "self_attn.q_proj.bias");
    ops::linear(x, wq, bq, q);
    ops::linear(x, w.get("self_attn.k_proj.weight"), bias(w, "self_attn.k_proj.bias"), k);
    ops::linear(x, w.get("self_attn.v_proj.weight"), bias(w, "self_attn.v_proj.bias"), v);
    ops::rope(q, positions, inv_freq_);
    ops::rope(k, positions, inv_freq_);
    ops::scale_inplace(q, q_scale);
    cache.observe(l, {x, q, wq, bq, inv_freq_, positions, attention_skew(l)});
    cache.append(l, k, v);
    attend(l, q, k, v, cache, attn);
    ops::linear(attn, w.get("self_attn.o_proj.weight"), bias(w, "self_attn.o_proj.bias"), x);
    ops::add_inplace(h, x);
    check_interrupt();  // also between the halves of a layer: each takes seconds in a long prefill
    // Feed-forward block: h += down(silu(gate(x)) * up(x)) of RMSNorm(h).
    ops::rms_norm(h, w.get("post_attention_layernorm.weight"), c.norm_eps, x);
    ops::linear(x, w.get("mlp.gate_proj.weight"), bias(w, "mlp.gate_proj.bias"), gate);
    ops::linear(x, w.get("mlp.up_proj.weight"), bias(w, "mlp.up_proj.bias"), up);
    ops::silu_mul(gate, up);
    ops::linear(gate, w.get("mlp.down_proj.weight"), bias(w, "mlp.down_proj.bias"), x);
    ops::add_inplace(h, x);
  }
  cache.end_pass(n);
  return h;
}

Tensor LlamaModel::lm_head(const Tensor& hidden) {
  const TensorTable& g = globals();
  const int64_t rows = hidden.dim(0);
  Tensor normed = activations_.rows(Activation::FinalNormed, rows);  // (rows, D)
  ops::rms_norm(hidden, g.get("model.norm.weight"), config_.norm_eps, normed);
  const Tensor& head =
      g.get(config_.tied_embeddings ? "model.embed_tokens.weight" : "lm_head.weight");
  Tensor logits = activations_.rows(Activation::Logits, rows);  // (rows, V)
  ops::linear(normed, head, Tensor(), logits);
  if (device_ == Device::Cpu) return logits;
  Tensor host = activations_.host_logits(rows);
  device_copy(host.raw(), Device::Cpu, logits.raw(), device_, logits.nbytes());
  return host;
}

}  // namespace

const ModelFamily& llama_family() {
  static const ModelFamily family{
      "llama",
      {"llama", "mistral", "qwen2"},
      llama_config_from_json,
      llama_config_to_json,
      llama_weight_layout,
      [](const ModelConfig& config, ModelWeights weights, Device device,
         std::unique_ptr<LayerWeightSource> layers) -> std::unique_ptr<Model> {
        return std::make_unique<LlamaModel>(config, std::move(weights), device, std::move(layers));
      }};
  return family;
}

}  // namespace infinigen
