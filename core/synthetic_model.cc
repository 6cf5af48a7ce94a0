// core: the synthetic weight generator (every family: it draws each tensor by its role).
#include "core/synthetic_model.h"

#include <Eigen/Dense>
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <numbers>

#include "core/interrupt.h"
#include "core/output_directory.h"
#include "core/resources.h"
#include "core/safetensors.h"
#include "core/tokenizer.h"

namespace infinigen {
namespace {

using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t fnv1a(const std::string& text) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char ch : text) h = (h ^ ch) * 0x100000001b3ull;
  return h;
}

// A stream of standard normals indexed by position: normal(i) depends on (key, i) only.
class NormalStream {
 public:
  NormalStream(uint64_t seed, const std::string& name) : key_(splitmix64(seed ^ fnv1a(name))) {}
  float operator()(uint64_t i) const {
    // Box-Muller on two 53-bit uniforms; element i uses the cosine or sine of pair i / 2.
    const uint64_t pair = i >> 1;
    const double u1 = (static_cast<double>(splitmix64(key_ + 2 * pair) >> 11) + 1.0) * 0x1p-53;
    const double u2 = static_cast<double>(splitmix64(key_ + 2 * pair + 1) >> 11) * 0x1p-53;
    const double radius = std::sqrt(-2.0 * std::log(u1));
    const double angle = 2.0 * std::numbers::pi * u2;
    return static_cast<float>((i & 1) ? radius * std::sin(angle) : radius * std::cos(angle));
  }

 private:
  uint64_t key_;
};

Matrix gaussian(const NormalStream& normal, int64_t rows, int64_t cols, float std) {
  Matrix m(rows, cols);
  float* data = m.data();
  // In chunks, so that an interrupt is noticed within a chunk even in a large embedding table.
  constexpr int64_t kChunk = int64_t{1} << 22;
  for (int64_t start = 0; start < rows * cols; start += kChunk) {
    check_interrupt();
    const int64_t end = std::min(rows * cols, start + kChunk);
#pragma omp parallel for schedule(static)
    for (int64_t i = start; i < end; ++i) data[i] = std * normal(static_cast<uint64_t>(i));
  }
  return m;
}

// A (rows x cols) matrix with orthonormal columns, spanning random directions.
Matrix orthonormal_columns(const Matrix& random) {
  Eigen::HouseholderQR<Matrix> qr(random);
  return qr.householderQ() * Matrix::Identity(random.rows(), random.cols());
}

class Generator {
 public:
  Generator(const ModelConfig& config, const SyntheticModelOptions& options,
            const WeightLayout& layout)
      : c_(config), o_(options), layout_(layout) {
    const int64_t D = c_.hidden_size;
    const int64_t n_outliers = std::clamp<int64_t>(o_.outlier_channels, 0, D / 16);
    // Outlier channels and their signs: a fixed draw, the same for every layer.
    const NormalStream pick(o_.seed, "outlier_channels");
    std::vector<std::pair<float, int64_t>> keyed;
    for (int64_t ch = 0; ch < D; ++ch) keyed.push_back({pick(static_cast<uint64_t>(ch)), ch});
    std::partial_sort(keyed.begin(), keyed.begin() + n_outliers, keyed.end());
    for (int64_t i = 0; i < n_outliers; ++i) {
      outliers_.push_back(keyed[i].second);
      outlier_signs_.push_back(pick(static_cast<uint64_t>(D + i)) >= 0 ? 1.0f : -1.0f);
    }
    // Typical channel std of the residual stream entering each layer. Each layer adds an update
    // of std residual_update_ratio times the stream's (so consecutive layers see similar inputs,
    // as in trained models: what lets layer l - 1 speculate layer l's attention). With x of unit
    // mean square, the FFN's fc2(relu(fc1(x))) has variance s^2 w^2 F (w^2 D / 2) and attention's
    // out_proj(average of v) about s^2 w^2 D (w^2 D / 2), s scaling fc2 and out_proj.
    const double w2 = static_cast<double>(o_.weight_std) * o_.weight_std;
    const double base = w2 * c_.ffn_dim * (w2 * D / 2) + w2 * D * (w2 * D / 2);
    const double rho2 = static_cast<double>(o_.residual_update_ratio) * o_.residual_update_ratio;
    double var = static_cast<double>(o_.embed_std) * o_.embed_std;
    for (int64_t l = 0; l <= c_.num_layers; ++l) {
      stream_std_.push_back(static_cast<float>(std::sqrt(var)));
      output_scale_.push_back(static_cast<float>(std::sqrt(rho2 * var / base)));
      var *= 1.0 + rho2;
    }
    // Outlier channels hold outlier_ratio times the typical magnitude at every depth, so after
    // LayerNorm a typical channel has variance D / (D - n + n * ratio^2): that, not 1, is what
    // the query/key maps see.
    const double ratio2 = static_cast<double>(o_.outlier_ratio) * o_.outlier_ratio;
    normed_var_ = static_cast<float>(D / (D - n_outliers + n_outliers * ratio2));
    // The attention sink: one more channel, non-zero only in the BOS embedding (as large as an
    // outlier there), that keys map onto a per-head sink direction which every query holds
    // through its outlier channels.
    if (n_outliers > 0 && o_.attention_sink_logit > 0 && n_outliers < D) {
      sink_channel_ = keyed[static_cast<size_t>(n_outliers)].second;
      const double typical = 1.0 / std::sqrt((n_outliers * ratio2 + (D - n_outliers)) / D);
      outlier_normed_ = static_cast<float>(o_.outlier_ratio * typical);
      const double bos_row = ((n_outliers + 1) * ratio2 + (D - n_outliers - 1)) / D;
      sink_normed_ = static_cast<float>(o_.outlier_ratio / std::sqrt(bos_row));
    }
  }

  Tensor make(const TensorSpec& spec) const {
    const NormalStream normal(o_.seed, spec.name);
    const int64_t rows = spec.shape[0], cols = spec.shape.size() > 1 ? spec.shape[1] : 1;
    const size_t l = static_cast<size_t>(spec.layer);  // of a layer tensor
    Matrix m;
    switch (spec.role) {
      case TensorRole::TokenEmbedding: {
        m = gaussian(normal, rows, cols, o_.embed_std);
        // The outlier and sink channels are the residual stream's (D wide). A projected
        // embedding (E != D columns, OPT-350m) is not in the stream's channels: its stream gets
        // its outliers from the layers' FFN output biases only.
        const bool in_stream = cols == c_.hidden_size;
        for (size_t i = 0; in_stream && i < outliers_.size(); ++i) {
          m.col(outliers_[i]).array() += o_.outlier_ratio * stream_std_[0] * outlier_signs_[i];
        }
        if (in_stream && sink_channel_ >= 0) {
          m.col(sink_channel_).setZero();
          m(c_.bos_token_id, sink_channel_) = o_.outlier_ratio * stream_std_[0];
        }
        break;
      }
      case TensorRole::FfnOutputBias:
        // Grows the outlier channels with the stream, keeping them outlier_ratio times larger.
        m = gaussian(normal, rows, 1, 0.5f * o_.weight_std);
        for (size_t i = 0; i < outliers_.size(); ++i) {
          m(outliers_[i], 0) +=
              o_.outlier_ratio * (stream_std_[l + 1] - stream_std_[l]) * outlier_signs_[i];
        }
        break;
      case TensorRole::PositionEmbedding:
        m = gaussian(normal, rows, cols, 0.1f * o_.embed_std);
        break;
      case TensorRole::NormWeight:  // LayerNorm's and RMSNorm's gains
        m = Matrix::Ones(rows, 1) + gaussian(normal, rows, 1, 0.02f);
        break;
      case TensorRole::NormBias:
      case TensorRole::QueryBias:
      case TensorRole::KeyBias:
      case TensorRole::ValueBias:
      case TensorRole::AttentionOutputBias:
      case TensorRole::FfnInputBias:
        m = gaussian(normal, rows, 1, 0.5f * o_.weight_std);
        break;
      case TensorRole::AttentionOutputWeight:
      case TensorRole::FfnOutputWeight:
        m = gaussian(normal, rows, cols, output_scale_[l] * o_.weight_std);
        break;
      case TensorRole::QueryWeight:
      case TensorRole::KeyWeight:
        m = query_key(spec, normal, rows, cols);
        break;
      case TensorRole::EmbeddingProjection:
      case TensorRole::ValueWeight:
      case TensorRole::FfnInputWeight:
      case TensorRole::LmHead:
        m = gaussian(normal, rows, cols, o_.weight_std);
        break;
    }
    Tensor out = Tensor::empty(spec.shape, c_.dtype);
    convert_from_f32(m.data(), out.raw(), c_.dtype, static_cast<size_t>(m.size()));
    return out;
  }

 private:
  // Head h of W_q is s * U_h V_h^T and of W_k is s * U_h R_h V_h^T (plus small noise), with V_h
  // (D x r) orthonormal and away from the outlier channels, U_h (d x r) orthonormal and R_h an
  // r x r rotation. Then q.k / sqrt(d) = s^2 (V^T x_q)^T R (V^T x_k) / sqrt(d), whose std between
  // unrelated tokens is s^2 * sqrt(r) * var(x) / sqrt(d): s is chosen to hit the target std.
  // Query and key share the layer's seed so they are built from the same U_h, V_h. With grouped
  // queries, the query heads of a KV head's group share its U, V and sink direction (they differ
  // by their noise). A rotary model rotates q and k by their positions after this, which blurs
  // the structure with distance; the statistics are for timing, not for accuracy.
  Matrix query_key(const TensorSpec& spec, const NormalStream& noise, int64_t D_out,
                   int64_t D_in) const {
    const bool is_key = spec.role == TensorRole::KeyWeight;
    const std::string layer = layout_.layer_tensor_name(spec.layer, "");  // the heads' seeds
    const int64_t d = c_.head_dim(), H = D_out / d,
                  group = is_key ? 1 : c_.num_heads / c_.kv_heads();
    const int64_t r = std::clamp<int64_t>(o_.attention_rank, 1, d);
    const float s = std::sqrt(o_.attention_logit_std * std::sqrt(static_cast<float>(d)) /
                              (std::sqrt(static_cast<float>(r)) * normed_var_));
    Matrix w = gaussian(noise, D_out, D_in, 0.25f * o_.weight_std);
    for (int64_t h = 0; h < H; ++h) {
      const std::string head = layer + "head" + std::to_string(h / group);
      Matrix v_random = gaussian(NormalStream(o_.seed, head + ".V"), D_in, r, 1.0f);
      for (int64_t ch : outliers_) v_random.row(ch).setZero();
      if (sink_channel_ >= 0) v_random.row(sink_channel_).setZero();
      const Matrix V = orthonormal_columns(v_random);
      const Matrix U =
          orthonormal_columns(gaussian(NormalStream(o_.seed, head + ".U"), d, r, 1.0f));
      Matrix core = s * Matrix::Identity(r, r);
      if (is_key)
        core = s * orthonormal_columns(gaussian(NormalStream(o_.seed, head + ".R"), r, r, 1.0f));
      w.middleRows(h * d, d) += U * core * V.transpose();
      if (sink_channel_ >= 0) {
        // Sink direction: unit, orthogonal to the head's attention subspace U. Queries get
        // q.u = Q0 from the outlier channels, BOS's key gets k.u = K0 from the sink channel, so
        // every query gives BOS the logit Q0 K0 / sqrt(d) = attention_sink_logit.
        Eigen::VectorXf u = gaussian(NormalStream(o_.seed, head + ".S"), d, 1, 1.0f).col(0);
        u -= U * (U.transpose() * u);
        u.normalize();
        const float q0 = std::sqrt(o_.attention_sink_logit * std::sqrt(static_cast<float>(d)));
        if (is_key) {
          w.block(h * d, sink_channel_, d, 1) += (q0 / sink_normed_) * u;
        } else {
          const float gain = q0 / (static_cast<float>(outliers_.size()) * outlier_normed_);
          for (size_t i = 0; i < outliers_.size(); ++i) {
            w.block(h * d, outliers_[i], d, 1) += gain * outlier_signs_[i] * u;
          }
        }
      }
    }
    return w;
  }

  const ModelConfig& c_;
  const SyntheticModelOptions& o_;
  const WeightLayout& layout_;
  std::vector<int64_t> outliers_;
  std::vector<float> outlier_signs_;
  std::vector<float> stream_std_;    // (L + 1): typical residual channel std before each layer
  std::vector<float> output_scale_;  // (L + 1): scale of fc2 / out_proj std in each layer
  int64_t sink_channel_ = -1;        // residual channel carrying BOS's sink feature, or -1
  float outlier_normed_ = 0.0f;      // |outlier channel| after LayerNorm, ordinary token
  float sink_normed_ = 0.0f;         // sink channel after LayerNorm, BOS
  float normed_var_ = 1.0f;
};

// The largest finite value of a float storage type.
double largest_finite(DType dtype) {
  return dtype == DType::F16 ? 65504.0 : static_cast<double>(std::numeric_limits<float>::max());
}

// A knob in [low, high] (or (low, high] when !low_included); NaN is in no range.
void check_range(std::string_view key, double value, double low, double high, bool low_included,
                 const std::string& why = "") {
  const bool above_low = low_included ? value >= low : value > low;
  INFINIGEN_CHECK(above_low && value <= high, option(key), " must be in ", low_included ? "[" : "(",
                  low, ", ", high, "]", why, ", got ", value);
}

}  // namespace

void SyntheticModelOptions::validate(const ModelConfig& config) const {
  check_range("outlier_channels", static_cast<double>(outlier_channels), 0,
              static_cast<double>(config.hidden_size / 16), true,
              cat(" (D/16 of ", config.name, "'s ", config.hidden_size, " channels)"));
  check_range("outlier_ratio", outlier_ratio, 1, 1000, true);
  check_range("embed_std", embed_std, 0, 10, false);
  check_range("attention_rank", static_cast<double>(attention_rank), 1,
              static_cast<double>(config.head_dim()), true,
              cat(" (", config.name, "'s head size)"));
  check_range("attention_logit_std", attention_logit_std, 0, 100, false);
  check_range("attention_sink_logit", attention_sink_logit, 0, 100, true);
  check_range("weight_std", weight_std, 0, 1, false);
  check_range("residual_update_ratio", residual_update_ratio, 0, 1, false);
  // The outlier channels are outlier_ratio * embed_std * (1 + ratio^2)^(L/2) after the last of L
  // layers, and the weights that grow them as large: they must stay finite in the model's dtype.
  const double headroom =
      largest_finite(config.dtype) / (static_cast<double>(outlier_ratio) * embed_std);
  const double layers = static_cast<double>(std::max<int64_t>(config.num_layers, 1));
  const double highest = std::min(1.0, std::sqrt(std::pow(headroom, 2.0 / layers) - 1.0));
  check_range(
      "residual_update_ratio", residual_update_ratio, 0, highest, false,
      cat(" for ", config.name, "'s ", config.num_layers, " layers in ", dtype_name(config.dtype),
          " with ", option("outlier_ratio"), " ", outlier_ratio, " and ", option("embed_std"), " ",
          embed_std, ", or the outlier channels pass the dtype's largest value"));
}

void generate_synthetic_weights(
    const ModelConfig& config, const SyntheticModelOptions& options,
    const std::function<void(const std::string&, const Tensor&)>& sink) {
  options.validate(config);
  const WeightLayout layout = weight_layout(config);
  const Generator generator(config, options, layout);
  layout.visit([&](const TensorSpec& spec) {
    check_interrupt();
    sink(spec.name, generator.make(spec));
  });
}

ModelWeights synthetic_weights(const ModelConfig& config, const SyntheticModelOptions& options,
                               Device device) {
  WeightsBuilder builder(config, device);
  generate_synthetic_weights(
      config, options, [&](const std::string& name, const Tensor& t) { builder.add(name, t); });
  return builder.finish();
}

void write_synthetic_checkpoint(const ModelConfig& config, const SyntheticModelOptions& options,
                                const std::string& directory,
                                const std::function<void(int64_t, int64_t)>& progress) {
  options.validate(config);  // before anything is written
  const std::filesystem::path target = checked_output_directory(directory);
  const Tokenizer tokenizer = Tokenizer::bundled();
  INFINIGEN_CHECK(config.vocab_size >= tokenizer.vocab_size(), config.name, ": vocab_size ",
                  config.vocab_size, " is smaller than the bundled tokenizer's ",
                  tokenizer.vocab_size(), " tokens");
  write_directory_atomically(target, [&](const std::filesystem::path& staging) {
    std::vector<TensorRecord> records;
    for (const TensorSpec& spec : weight_layout(config).all()) {
      records.push_back({spec.name, config.dtype, spec.shape});
    }
    const int64_t total = static_cast<int64_t>(records.size());
    SafetensorsWriter writer((staging / "model.safetensors").string(), records, {{"format", "pt"}});
    int64_t done = 0;
    generate_synthetic_weights(config, options, [&](const std::string& name, const Tensor& t) {
      writer.write(name, t.raw(), t.nbytes());
      if (progress) progress(++done, total);
    });
    writer.finish();
    write_text_file(staging / "config.json", config_to_hf_json(config).dump(2) + "\n");
    write_text_file(staging / "vocab.json", *embedded_config("tokenizer/vocab.json"));
    write_text_file(staging / "merges.txt", *embedded_config("tokenizer/merges.txt"));
    // Floats as the decimal the user typed (0.1, not 0.10000000149).
    const auto decimal = [](float v) { return std::stod(std::to_string(v)); };
    const nlohmann::json record = {
        {"generator", "infinigen make-model"},
        {"seed", options.seed},
        {"outlier_channels", options.outlier_channels},
        {"outlier_ratio", decimal(options.outlier_ratio)},
        {"residual_update_ratio", decimal(options.residual_update_ratio)},
        {"attention_sink_logit", decimal(options.attention_sink_logit)},
        {"embed_std", decimal(options.embed_std)},
        {"attention_rank", options.attention_rank},
        {"attention_logit_std", decimal(options.attention_logit_std)},
        {"weight_std", decimal(options.weight_std)}};
    write_text_file(staging / "synthetic.json", record.dump(2) + "\n");
  });
}

}  // namespace infinigen
