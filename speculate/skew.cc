// speculate: computing the skewing matrices from calibration queries and writing a skewed
// checkpoint.
#include "speculate/skew.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>
#include <set>
#include <string_view>

#include "core/interrupt.h"
#include "core/kv_cache.h"
#include "core/model.h"
#include "core/model_config.h"
#include "core/output_directory.h"
#include "core/resources.h"
#include "core/safetensors.h"
#include "core/tokenizer.h"
#include "core/weights.h"

namespace infinigen {
namespace {

namespace fs = std::filesystem;

using RowMatrixXf = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

// Files of a checkpoint directory, besides the weights, that a skewed copy keeps as they are.
constexpr const char* kCopiedFiles[] = {
    "config.json",           "generation_config.json", "vocab.json", "merges.txt", "tokenizer.json",
    "tokenizer_config.json", "special_tokens_map.json"};

// Longest calibration text read, in bytes per calibration token: no token is this long, so a
// prefix of the file gives as many tokens as the whole of it would.
constexpr size_t kCalibrationBytesPerToken = 64;

Tensor on_host(const Tensor& t) {
  return t.device() == Device::Cpu ? t : t.to(Device::Cpu);
}

// Whether a skew folded into the weights rotates a tensor of this role: the query and key
// projections, weights and biases.
bool folded_skew(TensorRole role) {
  return role == TensorRole::QueryWeight || role == TensorRole::QueryBias ||
         role == TensorRole::KeyWeight || role == TensorRole::KeyBias;
}

// Rows [begin, begin + count) of a CPU tensor (rows, cols) of any floating dtype, as fp64
// (count, cols). A rank-1 tensor is one column.
Eigen::MatrixXd rows_f64(const Tensor& t, int64_t begin, int64_t count) {
  const int64_t cols = t.rank() == 1 ? 1 : t.dim(1);
  std::vector<float> values(static_cast<size_t>(count * cols));
  convert_to_f32(static_cast<const char*>(t.raw()) + begin * cols * dtype_size(t.dtype()),
                 t.dtype(), values.data(), values.size());
  return Eigen::Map<const RowMatrixXf>(values.data(), count, cols).cast<double>();
}

// Flips columns so that each one's largest-magnitude entry is positive: singular vectors are
// defined up to sign, and a canonical choice makes the rotation independent of how the SVD
// happened to converge. Negation is exact, so orthogonality is untouched.
void canonicalise_signs(Eigen::MatrixXd& a) {
  for (Eigen::Index j = 0; j < a.cols(); ++j) {
    Eigen::Index top = 0;
    a.col(j).cwiseAbs().maxCoeff(&top);
    if (a(top, j) < 0) a.col(j) = -a.col(j);
  }
}

// A resident fp32 KV cache that, as each layer's attention input goes by, computes that layer's
// rotations (heads in parallel) and keeps only them.
class CalibrationCache final : public KvCache {
 public:
  CalibrationCache(const ModelConfig& config, int64_t tokens, Device device, SkewMatrices* out,
                   const SkewProgress& progress)
      : KvCache(config, 1, tokens, DType::F32, device),
        config_(config),
        out_(out),
        progress_(progress) {}

  int64_t layers_seen() const { return layers_seen_; }

  void observe(int64_t layer, const AttentionInput& input) override {
    const bool rotary = input.rope_inv_freq.defined();
    // Groups that share one rotation: each head (OPT: folded into its own projections), or each
    // KV head with its query heads (rotary: applied after the rotation, to the queries of the
    // group and to the one key head they share).
    const int64_t groups = rotary ? config_.kv_heads() : config_.num_heads;
    const int64_t per_group = config_.num_heads / groups;
    const int64_t d = config_.head_dim(), D = config_.hidden_size, Q = config_.q_dim();
    const Tensor x_host = on_host(input.x);
    const int64_t n = x_host.dim(0);
    // Rotary: the queries as attention uses them (rotated, scaled; the uniform scale does not
    // change the singular vectors). Otherwise recomputed in fp64 from the attention input (n, D),
    // exactly the values the model projects, before the scaling.
    const Tensor queries_host = rotary ? on_host(input.queries) : Tensor();
    const Eigen::MatrixXd x =
        rotary ? Eigen::MatrixXd()
               : Eigen::Map<const RowMatrixXf>(x_host.data<float>(), n, D).cast<double>();
    const Tensor wq = rotary ? Tensor() : on_host(input.q_weight);  // (H * d, D), HF layout
    const Tensor bq = rotary ? Tensor() : on_host(input.q_bias);    // (H * d)
    std::vector<Eigen::MatrixXd>& rotations = out_->rotations[static_cast<size_t>(layer)];
    std::vector<Eigen::VectorXd>& singular = out_->singular_values[static_cast<size_t>(layer)];
    std::vector<double> top_before(static_cast<size_t>(groups)),
        top_after(static_cast<size_t>(groups)), total(static_cast<size_t>(groups));
    std::exception_ptr failure;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t g = 0; g < groups; ++g) {
      try {
        check_interrupt();  // a head's SVD is the longest step between layers
        const size_t gs = static_cast<size_t>(g);
        Eigen::MatrixXd q(n * per_group, d);  // the group's queries, one head after another
        if (rotary) {
          for (int64_t j = 0; j < per_group; ++j) {
            const int64_t head = g * per_group + j;
            q.middleRows(j * n, n) =
                Eigen::Map<const RowMatrixXf, 0, Eigen::OuterStride<>>(
                    queries_host.data<float>() + head * d, n, d, Eigen::OuterStride<>(Q))
                    .cast<double>();
          }
        } else {
          const Eigen::MatrixXd w = rows_f64(wq, g * d, d);  // (d, D)
          const Eigen::VectorXd b = rows_f64(bq, g * d, d);  // (d)
          q = x * w.transpose();                             // (n, d)
          q.rowwise() += b.transpose();
        }
        // Full V: with fewer calibration rows than d, the trailing columns complete the basis.
        Eigen::BDCSVD<Eigen::MatrixXd> svd(q, Eigen::ComputeFullV);
        Eigen::MatrixXd a = svd.matrixV();  // (d, d)
        canonicalise_signs(a);
        Eigen::VectorXd sv = Eigen::VectorXd::Zero(d);
        sv.head(svd.singularValues().size()) = svd.singularValues();
        top_before[gs] = top_column_energy(q, kSkewEnergyColumnRatio, &total[gs]);
        double unused = 0.0;
        top_after[gs] = top_column_energy(q * a, kSkewEnergyColumnRatio, &unused);
        rotations[gs] = std::move(a);
        singular[gs] = std::move(sv);
      } catch (...) {
#pragma omp critical(infinigen_skew_failure)
        failure = std::current_exception();
      }
    }
    if (failure) std::rethrow_exception(failure);
    const double sum = std::accumulate(total.begin(), total.end(), 0.0);
    const auto fraction = [&](const std::vector<double>& top) {
      return sum > 0 ? std::accumulate(top.begin(), top.end(), 0.0) / sum : 0.0;
    };
    out_->energy_before[static_cast<size_t>(layer)] = fraction(top_before);
    out_->energy_after[static_cast<size_t>(layer)] = fraction(top_after);
    ++layers_seen_;
    if (progress_) progress_("calibrating", layers_seen_, config_.num_layers);
  }

 private:
  const ModelConfig& config_;
  SkewMatrices* out_;
  const SkewProgress& progress_;
  int64_t layers_seen_ = 0;
};

// Up to `limit` bytes of a calibration file (whole file when shorter); `cut` says whether more
// followed.
std::string read_calibration_file(const std::string& path, size_t limit, bool* cut) {
  INFINIGEN_CHECK(fs::is_regular_file(path), path, ": calibration file not found");
  std::ifstream in(path, std::ios::binary);
  INFINIGEN_CHECK(in.good(), path, ": cannot read calibration file");
  std::string text(limit + 1, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<size_t>(in.gcount()));
  *cut = text.size() > limit;
  if (*cut) text.resize(limit);
  INFINIGEN_CHECK(!text.empty(), path, ": calibration file is empty");
  return text;
}

// The rotations of a rotary model as the loader reads them (core/weights.h): per layer one
// (H_kv, d, d) fp32 tensor, A of KV head g at [g].
void write_attention_skew(const fs::path& path, const SkewMatrices& matrices) {
  const int64_t G = matrices.num_heads, d = matrices.head_dim;
  std::vector<TensorRecord> records;
  for (int64_t l = 0; l < matrices.num_layers; ++l) {
    records.push_back({attention_skew_tensor_name(l), DType::F32, {G, d, d}});
  }
  SafetensorsWriter writer(path.string(), records, {{"format", "pt"}});
  std::vector<float> values(static_cast<size_t>(G * d * d));
  for (int64_t l = 0; l < matrices.num_layers; ++l) {
    for (int64_t g = 0; g < G; ++g) {
      const RowMatrixXf a =
          matrices.rotations[static_cast<size_t>(l)][static_cast<size_t>(g)].cast<float>();
      std::copy_n(a.data(), d * d, values.begin() + g * d * d);
    }
    writer.write(attention_skew_tensor_name(l), values.data(), values.size() * sizeof(float));
  }
  writer.finish();
}

}  // namespace

double top_column_energy(const Eigen::MatrixXd& queries, double ratio, double* total) {
  const Eigen::Index cols = queries.cols();
  const Eigen::VectorXd l1 = queries.cwiseAbs().colwise().sum().transpose();       // (cols)
  const Eigen::VectorXd energy = queries.cwiseAbs2().colwise().sum().transpose();  // (cols)
  const Eigen::Index r =
      std::max<Eigen::Index>(1, static_cast<Eigen::Index>(std::floor(ratio * cols)));
  std::vector<Eigen::Index> order(static_cast<size_t>(cols));
  std::iota(order.begin(), order.end(), 0);
  // Ties to the lower column, so the choice does not depend on the sort's stability.
  std::partial_sort(
      order.begin(), order.begin() + std::min(r, cols), order.end(),
      [&](Eigen::Index a, Eigen::Index b) { return l1(a) != l1(b) ? l1(a) > l1(b) : a < b; });
  double top = 0.0;
  for (Eigen::Index i = 0; i < std::min(r, cols); ++i) top += energy(order[static_cast<size_t>(i)]);
  if (total) *total = energy.sum();
  return top;
}

std::vector<int32_t> calibration_tokens(const std::vector<int32_t>& ids,
                                        std::optional<int32_t> bos_id, int64_t length) {
  INFINIGEN_CHECK(length >= 1, "calibration length ", length, " must be positive");
  INFINIGEN_CHECK(length == 1 || !ids.empty(), "no calibration tokens");
  std::vector<int32_t> tokens;
  tokens.reserve(static_cast<size_t>(length));
  if (bos_id) tokens.push_back(*bos_id);
  for (size_t i = 0; static_cast<int64_t>(tokens.size()) < length; ++i) {
    tokens.push_back(ids[i % ids.size()]);
  }
  return tokens;
}

SkewMatrices compute_skew_matrices(Model& model, const std::vector<int32_t>& tokens,
                                   const SkewProgress& progress) {
  const ModelConfig& config = model.config();
  const int64_t n = static_cast<int64_t>(tokens.size());
  INFINIGEN_CHECK(n >= 2 && n <= config.max_positions, config.name, ": ", n,
                  " calibration tokens, expected 2..", config.max_positions);
  SkewMatrices out;
  out.num_layers = config.num_layers;
  out.num_heads = config.rope.enabled() ? config.kv_heads() : config.num_heads;
  out.head_dim = config.head_dim();
  const size_t L = static_cast<size_t>(config.num_layers);
  out.rotations.assign(L, std::vector<Eigen::MatrixXd>(static_cast<size_t>(out.num_heads)));
  out.singular_values.assign(L, std::vector<Eigen::VectorXd>(static_cast<size_t>(out.num_heads)));
  out.energy_before.assign(L, 0.0);
  out.energy_after.assign(L, 0.0);
  CalibrationCache cache(config, n, model.device(), &out, progress);
  model.prefill(tokens, {0}, cache);
  INFINIGEN_CHECK(cache.layers_seen() == config.num_layers, config.name, ": calibration saw ",
                  cache.layers_seen(), " of ", config.num_layers, " layers");
  return out;
}

Eigen::MatrixXd rotate_head_rows(const Eigen::MatrixXd& rows,
                                 const std::vector<Eigen::MatrixXd>& layer_rotations) {
  const Eigen::Index H = static_cast<Eigen::Index>(layer_rotations.size());
  INFINIGEN_CHECK(H > 0 && rows.rows() % H == 0, "rotate_head_rows: ", rows.rows(),
                  " rows do not split into ", H, " heads");
  const Eigen::Index d = rows.rows() / H;
  Eigen::MatrixXd out(rows.rows(), rows.cols());
  for (Eigen::Index h = 0; h < H; ++h) {
    const Eigen::MatrixXd& a = layer_rotations[static_cast<size_t>(h)];  // (d, d)
    INFINIGEN_CHECK(a.rows() == d && a.cols() == d, "rotate_head_rows: head ", h, " rotation is ",
                    a.rows(), "x", a.cols(), ", expected ", d, "x", d);
    out.middleRows(h * d, d).noalias() = a.transpose() * rows.middleRows(h * d, d);
  }
  return out;
}

Tensor rotate_projection(const Tensor& projection,
                         const std::vector<Eigen::MatrixXd>& layer_rotations) {
  INFINIGEN_CHECK(projection.rank() == 1 || projection.rank() == 2,
                  "rotate_projection: expected a weight (D, D) or a bias (D), got ",
                  shape_string(projection.shape()));
  const Tensor host = on_host(projection);
  // Row-major (D, cols) in fp64 -> rotated -> back to row-major fp32 -> the stored dtype. fp32
  // to F16/BF16 rounds once more, which is below the 16-bit types' own resolution in practice.
  const Eigen::MatrixXd rotated = rotate_head_rows(rows_f64(host, 0, host.dim(0)), layer_rotations);
  const RowMatrixXf narrow = rotated.cast<float>();
  Tensor out = Tensor::empty(host.shape(), host.dtype());
  convert_from_f32(narrow.data(), out.raw(), out.dtype(), static_cast<size_t>(out.numel()));
  return out;
}

double SkewReport::mean_energy_before() const {
  return energy_before.empty() ? 0.0
                               : std::accumulate(energy_before.begin(), energy_before.end(), 0.0) /
                                     static_cast<double>(energy_before.size());
}

double SkewReport::mean_energy_after() const {
  return energy_after.empty() ? 0.0
                              : std::accumulate(energy_after.begin(), energy_after.end(), 0.0) /
                                    static_cast<double>(energy_after.size());
}

SkewReport skew_checkpoint(const std::string& in_dir, const std::string& out_dir,
                           const SkewOptions& options, const SkewProgress& progress) {
  INFINIGEN_CHECK(fs::is_directory(in_dir), in_dir, ": no such directory");
  INFINIGEN_CHECK(!fs::exists(fs::path(in_dir) / "skew.json"), in_dir,
                  ": already skewed (skew.json)");
  const fs::path target = checked_output_directory(out_dir);

  const ModelConfig config = load_hf_config(in_dir);
  const SafetensorsCheckpoint checkpoint = SafetensorsCheckpoint::open(in_dir);
  const std::vector<std::string> stored = check_checkpoint(checkpoint, config);

  SkewReport report;
  report.source = fs::weakly_canonical(fs::absolute(in_dir)).string();
  report.calib_len = options.calib_len.value_or(
      std::min<int64_t>(kDefaultCalibrationLength, config.max_positions));
  INFINIGEN_CHECK(report.calib_len >= 2 && report.calib_len <= config.max_positions, "calib-len ",
                  report.calib_len, ": must be between 2 and the model's max_positions (",
                  config.max_positions, ")");

  // The checkpoint's tokenizer, when it ships one, also says which BOS its prompts start with.
  const bool has_tokenizer = fs::exists(fs::path(in_dir) / "vocab.json") ||
                             fs::exists(fs::path(in_dir) / "tokenizer.json");
  const std::optional<Tokenizer> tokenizer =
      has_tokenizer ? std::optional<Tokenizer>(Tokenizer::from_directory(in_dir)) : std::nullopt;
  const std::optional<int32_t> bos = tokenizer ? tokenizer->bos_id() : config.bos_token_id;
  std::vector<int32_t> ids = options.calib_tokens;
  if (!ids.empty()) {
    report.calib_source = "token ids";
  } else {
    std::string text;
    bool cut = false;
    const size_t limit = kCalibrationBytesPerToken * static_cast<size_t>(report.calib_len);
    if (options.calib_file.empty()) {
      report.calib_source = "bundled calibration text";
      const std::string_view corpus = *embedded_config("calibration.txt");
      text.assign(corpus.substr(0, std::min(corpus.size(), limit + 1)));
      cut = text.size() > limit;
      if (cut) text.resize(limit);
    } else {
      report.calib_source = fs::path(options.calib_file).filename().string();
      text = read_calibration_file(options.calib_file, limit, &cut);
    }
    INFINIGEN_CHECK(tokenizer.has_value(), in_dir,
                    ": no tokenizer (tokenizer.json, or vocab.json and merges.txt) to encode the "
                    "calibration text, and no calibration token ids given");
    ids = tokenizer->encode(text);
    if (cut && ids.size() > 1) ids.pop_back();  // the cut may have split the last token
    INFINIGEN_CHECK(!ids.empty(), report.calib_source, ": calibration text has no tokens");
  }
  for (int32_t id : ids) {
    INFINIGEN_CHECK(id >= 0 && id < config.vocab_size, report.calib_source, ": token id ", id,
                    " is outside the vocabulary of ", config.vocab_size);
  }
  const std::vector<int32_t> tokens = calibration_tokens(ids, bos, report.calib_len);

  SkewMatrices matrices;
  {
    const std::unique_ptr<Model> model =
        make_model(config, load_checkpoint_weights(checkpoint, config, Device::Cpu), Device::Cpu);
    matrices = compute_skew_matrices(*model, tokens, progress);
  }  // the weights go before the output is written
  report.energy_before = matrices.energy_before;
  report.energy_after = matrices.energy_after;

  // Rotary models keep the skew beside the weights (they are copied unchanged); the others have
  // it folded into their query and key projections: stored name of each rotated tensor -> its
  // layer.
  const bool beside = config.rope.enabled();
  const std::vector<TensorSpec> specs = weight_layout(config).all();
  std::map<std::string, size_t, std::less<>> rotated;
  for (size_t i = 0; i < specs.size() && !beside; ++i) {
    if (folded_skew(specs[i].role)) rotated[stored[i]] = static_cast<size_t>(specs[i].layer);
  }
  const auto query = std::ranges::find(specs, TensorRole::QueryWeight, &TensorSpec::role);
  report.dtype = checkpoint.entry(stored[static_cast<size_t>(query - specs.begin())]).dtype;

  // Every tensor of the input, in its original order (file, then offset).
  std::vector<std::string> names = checkpoint.names();
  std::stable_sort(names.begin(), names.end(), [&](const std::string& a, const std::string& b) {
    const std::string &fa = checkpoint.file_of(a).path(), &fb = checkpoint.file_of(b).path();
    return fa != fb ? fa < fb : checkpoint.entry(a).begin < checkpoint.entry(b).begin;
  });
  std::vector<TensorRecord> records;
  for (const std::string& name : names) {
    const SafetensorsEntry& e = checkpoint.entry(name);
    records.push_back({name, e.dtype, e.shape});
  }
  std::map<std::string, std::string> metadata = checkpoint.metadata();
  metadata.emplace("format", "pt");  // transformers refuses safetensors without it

  write_directory_atomically(target, [&](const fs::path& staging) {
    SafetensorsWriter writer((staging / "model.safetensors").string(), records, metadata);
    int64_t done = 0;
    const int64_t total = static_cast<int64_t>(names.size());
    for (const std::string& name : names) {
      check_interrupt();
      if (const auto it = rotated.find(name); it != rotated.end()) {
        const Tensor t = rotate_projection(checkpoint.load(name), matrices.rotations[it->second]);
        writer.write(name, t.raw(), t.nbytes());
      } else {
        const SafetensorsEntry& e = checkpoint.entry(name);
        writer.write(name, checkpoint.file_of(name).bytes(e), e.nbytes);
      }
      if (progress) progress("writing", ++done, total);
    }
    writer.finish();
    if (beside) write_attention_skew(staging / kAttentionSkewFile, matrices);
    for (const char* file : kCopiedFiles) {
      const fs::path from = fs::path(in_dir) / file;
      if (fs::exists(from)) fs::copy_file(from, staging / file);
    }
    nlohmann::json layers = nlohmann::json::array();
    for (size_t l = 0; l < report.energy_before.size(); ++l) {
      layers.push_back({{"layer", l},
                        {"energy_before", report.energy_before[l]},
                        {"energy_after", report.energy_after[l]}});
    }
    const nlohmann::json record = {
        {"format_version", kSkewFormatVersion},
        {"generator", "infinigen skew"},
        {"source", report.source},
        {"calibration", {{"tokens", report.calib_len}, {"source", report.calib_source}}},
        {"dtype", dtype_name(report.dtype)},
        {"rotated", beside ? std::string("kept beside the weights in ") + kAttentionSkewFile +
                                 ": per layer and KV head, applied after the rotary embedding "
                                 "to the queries of its group and to its keys"
                           : std::string("q_proj, k_proj (weight and bias) of every head")},
        {"energy_column_ratio", kSkewEnergyColumnRatio},
        {"energy_before", report.mean_energy_before()},
        {"energy_after", report.mean_energy_after()},
        {"layers", layers}};
    write_text_file(staging / "skew.json", record.dump(2) + "\n");
  });
  return report;
}

}  // namespace infinigen
