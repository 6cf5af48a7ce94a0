// tests: the synthetic weight generator: determinism, checkpoints that load back exactly, and the
// LLM-like statistics it promises (outlier channels, concentrated attention).
#include "core/synthetic_model.h"

#include <gtest/gtest.h>

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <random>

#include "core/model_loader.h"
#include "core/ops.h"
#include "tests/test_util.h"

namespace infinigen {
namespace {

using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

ModelConfig small_config() {
  ModelConfig c = load_preset("opt-tiny");
  c.hidden_size = 256;
  c.num_heads = 4;  // head_dim 64, as in every real OPT
  c.ffn_dim = 512;
  c.max_positions = 1024;
  return c;
}

Matrix to_matrix(const Tensor& t) {
  const std::vector<float> values = t.to_floats();
  return Eigen::Map<const Matrix>(values.data(), t.dim(0), t.numel() / t.dim(0));
}

TEST(SyntheticModel, SameSeedSameBytesOtherSeedOtherBytes) {
  const ModelConfig c = load_preset("opt-tiny");
  std::vector<std::vector<float>> first, second, other;
  generate_synthetic_weights(
      c, {}, [&](const std::string&, const Tensor& t) { first.push_back(t.to_floats()); });
  generate_synthetic_weights(
      c, {}, [&](const std::string&, const Tensor& t) { second.push_back(t.to_floats()); });
  SyntheticModelOptions seeded;
  seeded.seed = 1;
  generate_synthetic_weights(
      c, seeded, [&](const std::string&, const Tensor& t) { other.push_back(t.to_floats()); });
  EXPECT_EQ(first, second);
  EXPECT_NE(first, other);
  EXPECT_EQ(first.size(), weight_layout(c).all().size());
}

TEST(SyntheticModel, CheckpointLoadsBackToTheSameModel) {
  testing_util::TempDir dir("synthetic");
  const ModelConfig c = load_preset("opt-tiny");
  const std::string path = (dir.path() / "model").string();
  write_synthetic_checkpoint(c, {}, path);
  for (const char* file :
       {"config.json", "model.safetensors", "vocab.json", "merges.txt", "synthetic.json"}) {
    EXPECT_TRUE(std::filesystem::exists(dir.path() / "model" / file)) << file;
  }
  const LoadedModel loaded = load_model(path, {});
  const auto in_memory = make_model(c, synthetic_weights(c, {}, Device::Cpu), Device::Cpu);
  ASSERT_TRUE(loaded.tokenizer.has_value());
  KvCache a(c, 1, 8, DType::F32, Device::Cpu);
  KvCache b(c, 1, 8, DType::F32, Device::Cpu);
  const std::vector<int32_t> prompt = {2, 100, 200, 300};
  EXPECT_EQ(loaded.model->prefill(prompt, {0}, a).to_floats(),
            in_memory->prefill(prompt, {0}, b).to_floats());
  // Writing over a non-empty directory is refused.
  EXPECT_THROW(write_synthetic_checkpoint(c, {}, path), Error);
}

TEST(SyntheticModel, ResidualStreamHasOutlierChannels) {
  const ModelConfig c = small_config();
  const ModelWeights w = synthetic_weights(c, {}, Device::Cpu);
  const TensorTable& layer0 = w.layers[0];
  const Tensor& embed_tokens = w.globals.get("model.decoder.embed_tokens.weight");
  // LayerNorm of token embeddings: a few channels are far larger than the typical one.
  Tensor x = embed_tokens.slice_rows(4, 260).to_dtype(DType::F32);
  Tensor normed = Tensor::empty(x.shape(), DType::F32);
  ops::layer_norm(x, layer0.get("self_attn_layer_norm.weight"),
                  layer0.get("self_attn_layer_norm.bias"), 1e-5f, normed);
  const Matrix m = to_matrix(normed);
  Eigen::VectorXf channel_rms = (m.array().square().colwise().mean()).sqrt().transpose();
  std::vector<float> sorted(channel_rms.data(), channel_rms.data() + channel_rms.size());
  std::sort(sorted.begin(), sorted.end());
  const float median = sorted[sorted.size() / 2];
  const int64_t outliers =
      std::count_if(sorted.begin(), sorted.end(), [&](float v) { return v > 6.0f * median; });
  EXPECT_GE(outliers, 2);
  EXPECT_LE(outliers, 16);
}

TEST(SyntheticModel, AttentionIsConcentratedOnFewTokens) {
  const ModelConfig c = small_config();
  const ModelWeights w = synthetic_weights(c, {}, Device::Cpu);
  const TensorTable& layer0 = w.layers[0];
  const Tensor& embed_tokens = w.globals.get("model.decoder.embed_tokens.weight");
  const int64_t n = 512, d = c.head_dim();
  std::mt19937_64 rng(3);
  std::vector<int32_t> tokens(n), positions(n);
  for (int64_t i = 0; i < n; ++i) {
    tokens[i] = 4 + static_cast<int32_t>(rng() % 2000);
    positions[i] = static_cast<int32_t>(i + 2);
  }
  Tensor h = Tensor::empty({n, c.hidden_size}, DType::F32);
  ops::embed(tokens, positions, embed_tokens, w.globals.get("model.decoder.embed_positions.weight"),
             h);
  Tensor x = Tensor::empty(h.shape(), DType::F32), q = x.clone(), k = x.clone();
  ops::layer_norm(h, layer0.get("self_attn_layer_norm.weight"),
                  layer0.get("self_attn_layer_norm.bias"), 1e-5f, x);
  ops::linear(x, layer0.get("self_attn.q_proj.weight"), layer0.get("self_attn.q_proj.bias"), q);
  ops::linear(x, layer0.get("self_attn.k_proj.weight"), layer0.get("self_attn.k_proj.bias"), k);
  const Matrix Q = to_matrix(q), K = to_matrix(k);
  double within_alpha = 0, top_mass = 0;
  int64_t rows = 0;
  for (int64_t head = 0; head < c.num_heads; ++head) {
    const Matrix logits = Q.middleCols(head * d, d) * K.middleCols(head * d, d).transpose() /
                          std::sqrt(static_cast<float>(d));
    for (int64_t i = 0; i < n; ++i) {
      Eigen::VectorXf s = logits.row(i).transpose();
      const float top = s.maxCoeff();
      within_alpha += static_cast<double>((s.array() > top - 4.0f).count()) / n;
      Eigen::VectorXf p = (s.array() - top).exp();
      p /= p.sum();
      std::vector<float> sorted(p.data(), p.data() + n);
      std::sort(sorted.rbegin(), sorted.rend());
      float mass = 0;
      for (int64_t j = 0; j < n / 10; ++j) mass += sorted[j];
      top_mass += mass;
      ++rows;
    }
  }
  within_alpha /= static_cast<double>(rows);
  top_mass /= static_cast<double>(rows);
  EXPECT_LT(within_alpha, 0.2) << "tokens within alpha = 4 of the top logit";
  EXPECT_GT(top_mass, 0.6) << "attention mass of the top 10% of tokens";
}

// Each knob outside its range is one line naming the knob and the range, before anything is
// generated or written; the defaults fit every preset.
TEST(SyntheticModel, AbsurdKnobsAreRefusedWithTheirRange) {
  const ModelConfig tiny = load_preset("opt-tiny");  // D 64, head size 16, 2 layers, f16
  const auto refused = [&](const ModelConfig& config, auto set, const std::string& key,
                           const std::string& range) {
    SyntheticModelOptions o;
    set(o);
    try {
      o.validate(config);
      ADD_FAILURE() << key << " accepted";
    } catch (const Error& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find(key), std::string::npos) << message;
      EXPECT_NE(message.find(range), std::string::npos) << message;
      EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    }
  };
  refused(
      tiny, [](auto& o) { o.outlier_channels = 1000000; }, "outlier_channels", "[0, 4]");
  refused(
      tiny, [](auto& o) { o.outlier_channels = -1; }, "outlier_channels", "[0, 4]");
  refused(
      tiny, [](auto& o) { o.outlier_ratio = 1e30f; }, "outlier_ratio", "[1, 1000]");
  refused(
      tiny, [](auto& o) { o.outlier_ratio = std::nanf(""); }, "outlier_ratio", "[1, 1000]");
  refused(
      tiny, [](auto& o) { o.embed_std = 1e6f; }, "embed_std", "(0, 10]");
  refused(
      tiny, [](auto& o) { o.residual_update_ratio = 50.0f; }, "residual_update_ratio", "(0, 1]");
  refused(
      tiny, [](auto& o) { o.attention_rank = 1 << 20; }, "attention_rank", "[1, 16]");
  refused(
      tiny, [](auto& o) { o.attention_logit_std = 1e9f; }, "attention_logit_std", "(0, 100]");
  refused(
      tiny, [](auto& o) { o.attention_sink_logit = -3.0f; }, "attention_sink_logit", "[0, 100]");
  refused(
      tiny, [](auto& o) { o.weight_std = INFINITY; }, "weight_std", "(0, 1]");
  // 40 layers in f16: an update ratio of 0.95 grows the outlier channels past 65504.
  const ModelConfig opt13b = load_preset("opt-13b");
  refused(
      opt13b, [](auto& o) { o.residual_update_ratio = 0.95f; }, "residual_update_ratio",
      "(0, 0.86");
  for (const std::string& name : preset_names())
    SyntheticModelOptions{}.validate(load_preset(name));
  // Nothing generated: the sink is never called.
  SyntheticModelOptions absurd;
  absurd.outlier_ratio = 1e30f;
  int tensors = 0;
  EXPECT_THROW(generate_synthetic_weights(tiny, absurd, [&](auto&, auto&) { ++tensors; }), Error);
  EXPECT_EQ(tensors, 0);
}

TEST(SyntheticModel, MakeModelRefusesAnAbsurdKnobInOneLine) {
  testing_util::TempDir dir("synthetic-absurd");
  const std::string out = (dir.path() / "m").string();
  testing_util::expect_one_line_error(
      {"make-model", "--preset", "opt-tiny", "--out", out, "--outlier-ratio", "1e30"},
      {"--outlier-ratio", "[1, 1000]"});
  testing_util::expect_one_line_error(
      {"make-model", "--preset", "opt-tiny", "--out", out, "--attention-rank", "4096"},
      {"--attention-rank", "[1, 16]"});
  EXPECT_FALSE(std::filesystem::exists(out));
}

}  // namespace
}  // namespace infinigen
