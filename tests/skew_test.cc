// tests: offline skewing: the rotation is exact (fp64), a skewed checkpoint computes the same
// logits and generations as its source, the rotation concentrates query energy, bad inputs get
// one-line errors, and the `infinigen skew` command; for a rotary model, the skew kept beside
// unchanged weights.
#include "speculate/skew.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "core/generation.h"
#include "core/model_loader.h"
#include "core/safetensors.h"
#include "core/synthetic_model.h"
#include "core/tokenizer.h"
#include "core/weights.h"
#include "offload/runtime.h"
#include "tests/test_util.h"

namespace infinigen {
namespace {

namespace fs = std::filesystem;
using testing_util::relative_error;
using testing_util::TempDir;

// Token ids of tools/make_hf_reference.py's prompts (BOS first, different lengths).
const std::vector<std::vector<int32_t>> kPrompts = {
    {2, 133, 1234, 77, 901, 45},
    {2, 600, 18, 1999, 402, 333, 12, 1500, 7, 88, 250},
    {2, 1000, 1001},
    {2, 45, 46, 47, 48, 49, 50, 51},
};
constexpr int64_t kCalibLen = 128;

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

using testing_util::expect_error;

// The stored tensor `name` widened to fp64, row-major (rows, cols); a bias is one column.
Eigen::MatrixXd load_f64(const SafetensorsCheckpoint& checkpoint, const std::string& name) {
  const Tensor t = checkpoint.load(name);
  const std::vector<float> v = t.to_floats();
  const int64_t cols = t.rank() == 1 ? 1 : t.dim(1);
  return Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>(
             v.data(), t.dim(0), cols)
      .cast<double>();
}

std::string attn(int64_t layer, const std::string& tensor) {
  return "model.decoder.layers." + std::to_string(layer) + ".self_attn." + tensor;
}

// Keeps each layer's queries (n, H * d) as the model computes them.
class QueryRecorder : public KvCache {
 public:
  QueryRecorder(const ModelConfig& config, int64_t capacity)
      : KvCache(config, 1, capacity, DType::F32, Device::Cpu) {}
  void observe(int64_t layer, const AttentionInput& input) override {
    if (static_cast<int64_t>(queries_.size()) <= layer) queries_.resize(layer + 1);
    queries_[static_cast<size_t>(layer)] = input.queries.clone();
  }
  std::vector<Tensor> queries_;
};

// Per layer: the fraction of query energy in each head's top 30% columns (by sum_t |q[t, j]|).
std::vector<double> query_energy(const std::string& dir, const std::vector<int32_t>& tokens) {
  const LoadedModel loaded = load_model(dir, {});
  const ModelConfig& c = loaded.model->config();
  QueryRecorder recorder(c, static_cast<int64_t>(tokens.size()));
  loaded.model->prefill(tokens, {0}, recorder);
  std::vector<double> fractions;
  for (const Tensor& q : recorder.queries_) {
    const std::vector<float> v = q.to_floats();
    const Eigen::MatrixXd all =
        Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>(
            v.data(), q.dim(0), q.dim(1))
            .cast<double>();  // (n, H * d)
    double top = 0.0, total = 0.0;
    for (int64_t h = 0; h < c.num_heads; ++h) {
      double head_total = 0.0;
      top += top_column_energy(all.middleCols(h * c.head_dim(), c.head_dim()),
                               kSkewEnergyColumnRatio, &head_total);
      total += head_total;
    }
    fractions.push_back(top / total);
  }
  return fractions;
}

class SkewTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = new TempDir("skew");
    ModelConfig config = load_preset("opt-tiny");
    config.dtype = DType::F32;
    SyntheticModelOptions synthetic;
    synthetic.seed = 7;
    write_synthetic_checkpoint(config, synthetic, original());
    SkewOptions options;
    options.calib_len = kCalibLen;
    report_ = new SkewReport(skew_checkpoint(original(), skewed(), options));
  }
  static void TearDownTestSuite() {
    delete report_;
    delete root_;
  }

  static std::string original() { return (root_->path() / "original").string(); }
  static std::string skewed() { return (root_->path() / "skewed").string(); }
  // A fresh path under the suite's directory.
  static std::string fresh(const std::string& tag) {
    static int counter = 0;
    return (root_->path() / (tag + "-" + std::to_string(counter++))).string();
  }
  // A copy of the original checkpoint that a test may damage.
  static std::string copy_of_original() {
    const std::string copy = fresh("copy");
    fs::copy(original(), copy, fs::copy_options::recursive);
    return copy;
  }

  static TempDir* root_;
  static SkewReport* report_;
};
TempDir* SkewTest::root_ = nullptr;
SkewReport* SkewTest::report_ = nullptr;

TEST(CalibrationTokens, BosThenIdsRepeatedToLength) {
  EXPECT_EQ(calibration_tokens({5, 6, 7}, 2, 6), (std::vector<int32_t>{2, 5, 6, 7, 5, 6}));
  EXPECT_EQ(calibration_tokens({5, 6, 7, 8, 9}, 2, 3), (std::vector<int32_t>{2, 5, 6}));
  // A model whose tokenizer adds no BOS (Qwen2) calibrates on the text alone.
  EXPECT_EQ(calibration_tokens({5, 6, 7}, std::nullopt, 4), (std::vector<int32_t>{5, 6, 7, 5}));
}

TEST(TopColumnEnergy, RanksColumnsByAbsoluteSum) {
  Eigen::MatrixXd q(2, 10);  // 10 columns: the top floor(0.3 * 10) = 3 count
  q.setConstant(1.0);
  q.col(4).setConstant(3.0);
  q.col(7) << -2.0, 2.0;
  q.col(1) << 0.5, -4.0;  // |sum| 4.5 ranks it second
  double total = 0.0;
  const double top = top_column_energy(q, 0.3, &total);
  EXPECT_DOUBLE_EQ(top, 18.0 + 16.25 + 8.0);
  EXPECT_DOUBLE_EQ(total, 18.0 + 16.25 + 8.0 + 7 * 2.0);
}

TEST_F(SkewTest, RotationIsOrthogonalAndKeepsAttentionLogitsExactInFp64) {
  const LoadedModel loaded = load_model(original(), {});
  const ModelConfig c = loaded.model->config();
  const Tokenizer tokenizer = Tokenizer::from_directory(original());
  const std::vector<int32_t> tokens = calibration_tokens(
      tokenizer.encode("The quick brown fox jumps over the lazy dog. It was a bright cold day."),
      c.bos_token_id, 64);
  const SkewMatrices m = compute_skew_matrices(*loaded.model, tokens);
  ASSERT_EQ(m.num_layers, c.num_layers);
  ASSERT_EQ(m.num_heads, c.num_heads);
  const int64_t d = c.head_dim(), D = c.hidden_size, n = 9;

  std::mt19937_64 rng(11);
  std::normal_distribution<double> normal;
  const Eigen::MatrixXd x = Eigen::MatrixXd::NullaryExpr(n, D, [&] { return normal(rng); });
  const SafetensorsCheckpoint checkpoint = SafetensorsCheckpoint::open(original());
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const auto& rotations = m.rotations[static_cast<size_t>(l)];
    for (int64_t h = 0; h < c.num_heads; ++h) {
      const Eigen::MatrixXd& a = rotations[static_cast<size_t>(h)];
      ASSERT_EQ(a.rows(), d);
      ASSERT_EQ(a.cols(), d);
      EXPECT_LE((a.transpose() * a - Eigen::MatrixXd::Identity(d, d)).cwiseAbs().maxCoeff(), 1e-12)
          << "layer " << l << " head " << h;
      const Eigen::VectorXd& s = m.singular_values[static_cast<size_t>(l)][static_cast<size_t>(h)];
      for (int64_t i = 1; i < d; ++i) EXPECT_GE(s(i - 1), s(i));
    }
    const Eigen::MatrixXd wq = load_f64(checkpoint, attn(l, "q_proj.weight"));  // (D, D)
    const Eigen::MatrixXd bq = load_f64(checkpoint, attn(l, "q_proj.bias"));    // (D, 1)
    const Eigen::MatrixXd wk = load_f64(checkpoint, attn(l, "k_proj.weight"));
    const Eigen::MatrixXd bk = load_f64(checkpoint, attn(l, "k_proj.bias"));
    // (n, D) projections, original and from the rotated fp64 weights.
    const auto project = [&](const Eigen::MatrixXd& w, const Eigen::MatrixXd& b) {
      Eigen::MatrixXd y = x * w.transpose();
      y.rowwise() += b.col(0).transpose();
      return y;
    };
    const Eigen::MatrixXd q = project(wq, bq), k = project(wk, bk);
    const Eigen::MatrixXd qs =
        project(rotate_head_rows(wq, rotations), rotate_head_rows(bq, rotations));
    const Eigen::MatrixXd ks =
        project(rotate_head_rows(wk, rotations), rotate_head_rows(bk, rotations));
    for (int64_t h = 0; h < c.num_heads; ++h) {
      const Eigen::MatrixXd logits =
          q.middleCols(h * d, d) * k.middleCols(h * d, d).transpose();  // (n, n)
      const Eigen::MatrixXd skewed_logits =
          qs.middleCols(h * d, d) * ks.middleCols(h * d, d).transpose();
      EXPECT_LE((skewed_logits - logits).norm() / logits.norm(), 1e-10)
          << "layer " << l << " head " << h;
      // The rotation is not the identity: the queries themselves changed.
      EXPECT_GT((qs.middleCols(h * d, d) - q.middleCols(h * d, d)).norm(),
                1e-3 * q.middleCols(h * d, d).norm());
    }
  }
}

TEST_F(SkewTest, SkewedCheckpointGivesTheSameLogitsAndGenerations) {
  const LoadedModel a = load_model(original(), {});
  const LoadedModel b = load_model(skewed(), {});
  const int64_t V = a.model->config().vocab_size;
  std::vector<int32_t> first_valid;
  const std::vector<int32_t> tokens = left_pad(kPrompts, 1, &first_valid);
  const int64_t B = static_cast<int64_t>(kPrompts.size());
  const int64_t n = static_cast<int64_t>(tokens.size()) / B;
  KvCache cache_a(a.model->config(), B, n, DType::F32, Device::Cpu);
  KvCache cache_b(b.model->config(), B, n, DType::F32, Device::Cpu);
  const Tensor la = a.model->prefill(tokens, first_valid, cache_a, true);  // (B, n, V)
  const Tensor lb = b.model->prefill(tokens, first_valid, cache_b, true);
  for (int64_t s = 0; s < B; ++s) {
    for (int64_t i = first_valid[static_cast<size_t>(s)]; i < n; ++i) {
      const int64_t offset = (s * n + i) * V;
      EXPECT_LE(relative_error(lb.data<float>() + offset, la.data<float>() + offset, V), 1e-4)
          << "sequence " << s << " position " << i;
    }
  }
  GenerationRequest request;
  request.prompts = kPrompts;
  request.gen_len = 12;
  request.kv_dtype = DType::F32;
  EXPECT_EQ(generate(*a.model, request).tokens, generate(*b.model, request).tokens);
}

TEST_F(SkewTest, OnlyQueryAndKeyProjectionsChange) {
  const SafetensorsCheckpoint a = SafetensorsCheckpoint::open(original());
  const SafetensorsCheckpoint b = SafetensorsCheckpoint::open(skewed());
  ASSERT_EQ(a.names(), b.names());
  int rotated = 0;
  for (const std::string& name : a.names()) {
    const SafetensorsEntry &ea = a.entry(name), &eb = b.entry(name);
    ASSERT_EQ(ea.dtype, eb.dtype) << name;
    ASSERT_EQ(ea.shape, eb.shape) << name;
    const bool same =
        std::memcmp(a.file_of(name).bytes(ea), b.file_of(name).bytes(eb), ea.nbytes) == 0;
    const bool is_rotated =
        name.find("q_proj") != std::string::npos || name.find("k_proj") != std::string::npos;
    EXPECT_EQ(same, !is_rotated) << name;
    rotated += is_rotated;
  }
  EXPECT_EQ(rotated, 4 * 2);  // opt-tiny: 2 layers x {q, k} x {weight, bias}
  for (const char* file : {"config.json", "vocab.json", "merges.txt"}) {
    EXPECT_EQ(read_file(fs::path(skewed()) / file), read_file(fs::path(original()) / file)) << file;
  }
  EXPECT_FALSE(fs::exists(fs::path(skewed()) / "synthetic.json"));

  const nlohmann::json record = nlohmann::json::parse(read_file(fs::path(skewed()) / "skew.json"));
  EXPECT_EQ(record["format_version"], kSkewFormatVersion);
  EXPECT_EQ(record["calibration"]["tokens"], kCalibLen);
  EXPECT_EQ(record["calibration"]["source"], "bundled calibration text");
  EXPECT_EQ(record["dtype"], "F32");
  EXPECT_EQ(record["source"], fs::weakly_canonical(original()).string());
  ASSERT_EQ(record["layers"].size(), 2u);
  for (const auto& layer : record["layers"]) {
    EXPECT_GT(layer["energy_after"].get<double>(), layer["energy_before"].get<double>());
  }
}

TEST_F(SkewTest, WrittenProjectionsAreTheRotatedStoredValues) {
  // With explicit calibration ids the matrices can be recomputed here and compared bit for bit.
  const std::vector<int32_t> ids = {133, 1234, 77, 901, 45, 600, 18, 1999, 402, 333};
  SkewOptions options;
  options.calib_len = 40;
  options.calib_tokens = ids;
  const std::string out = fresh("ids");
  const SkewReport report = skew_checkpoint(original(), out, options);
  EXPECT_EQ(report.calib_source, "token ids");
  const LoadedModel loaded = load_model(original(), {});
  const ModelConfig c = loaded.model->config();
  const SkewMatrices m =
      compute_skew_matrices(*loaded.model, calibration_tokens(ids, c.bos_token_id, 40));
  const SafetensorsCheckpoint a = SafetensorsCheckpoint::open(original());
  const SafetensorsCheckpoint b = SafetensorsCheckpoint::open(out);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    for (const char* tensor : {"q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias"}) {
      const Tensor expected =
          rotate_projection(a.load(attn(l, tensor)), m.rotations[static_cast<size_t>(l)]);
      const Tensor written = b.load(attn(l, tensor));
      ASSERT_EQ(expected.nbytes(), written.nbytes());
      EXPECT_EQ(std::memcmp(expected.raw(), written.raw(), written.nbytes()), 0)
          << "layer " << l << " " << tensor;
    }
  }
  EXPECT_EQ(report.energy_after, m.energy_after);
}

TEST_F(SkewTest, SkewConcentratesQueryEnergy) {
  // Text the calibration did not see.
  const Tokenizer tokenizer = Tokenizer::from_directory(original());
  std::vector<int32_t> tokens = {2};
  for (int32_t id : tokenizer.encode(
           "Rivers carve valleys over thousands of years, carrying sand and silt down to the sea. "
           "Engineers who build bridges must account for floods, ice and the slow drift of the "
           "banks, and a good map of the river bed is worth more than any formula.")) {
    tokens.push_back(id);
  }
  const std::vector<double> before = query_energy(original(), tokens);
  const std::vector<double> after = query_energy(skewed(), tokens);
  ASSERT_EQ(before.size(), after.size());
  for (size_t l = 0; l < before.size(); ++l) {
    EXPECT_GT(after[l], before[l]) << "layer " << l;
    EXPECT_GT(after[l], 0.5) << "layer " << l;
  }
  ASSERT_EQ(report_->energy_before.size(), before.size());
  for (size_t l = 0; l < before.size(); ++l) {
    EXPECT_GT(report_->energy_after[l], report_->energy_before[l]) << "layer " << l;
  }
  EXPECT_GT(report_->mean_energy_after(), report_->mean_energy_before());
}

TEST_F(SkewTest, F16CheckpointStaysF16AndClose) {
  const std::string f16 = fresh("f16");
  ModelConfig config = load_preset("opt-tiny");
  config.dtype = DType::F16;
  write_synthetic_checkpoint(config, {}, f16);
  SkewOptions options;
  options.calib_len = 64;
  const std::string out = fresh("f16-skewed");
  const SkewReport report = skew_checkpoint(f16, out, options);
  EXPECT_EQ(report.dtype, DType::F16);
  EXPECT_EQ(SafetensorsCheckpoint::open(out).entry(attn(0, "q_proj.weight")).dtype, DType::F16);
  GenerationRequest request;
  request.prompts = kPrompts;
  request.gen_len = 6;
  request.kv_dtype = DType::F32;
  const LoadedModel a = load_model(f16, {});
  const LoadedModel b = load_model(out, {});
  const GenerationResult ra = generate(*a.model, request), rb = generate(*b.model, request);
  // Rounding the rotated weights to fp16 perturbs logits by about fp16's resolution; the first
  // greedy token of every prompt survives that on this model.
  for (size_t s = 0; s < kPrompts.size(); ++s) EXPECT_EQ(ra.tokens[s][0], rb.tokens[s][0]);
}

TEST_F(SkewTest, AlreadySkewedInputIsRefused) {
  expect_error([&] { skew_checkpoint(skewed(), fresh("again")); },
               {skewed(), "already skewed (skew.json)"});
}

TEST_F(SkewTest, NonEmptyOutputIsRefused) {
  const std::string out = fresh("busy");
  fs::create_directories(out);
  std::ofstream(fs::path(out) / "keep.txt") << "mine";
  expect_error([&] { skew_checkpoint(original(), out); },
               {out, "already exists and is not an empty directory"});
  EXPECT_EQ(read_file(fs::path(out) / "keep.txt"), "mine");
}

TEST_F(SkewTest, MissingOrMalformedTensorsAreRefused) {
  const std::string missing = copy_of_original();
  {
    const SafetensorsCheckpoint checkpoint = SafetensorsCheckpoint::open(missing);
    std::vector<std::pair<std::string, Tensor>> tensors;
    for (const std::string& name : checkpoint.names()) {
      if (name != attn(1, "k_proj.bias")) tensors.emplace_back(name, checkpoint.load(name));
    }
    const std::string path = (fs::path(missing) / "model.safetensors").string();
    fs::remove(path);
    write_safetensors(path, tensors);
  }
  const std::string out = fresh("out");
  expect_error([&] { skew_checkpoint(missing, out); },
               {"missing tensor", "layers.1.self_attn.k_proj.bias"});
  EXPECT_FALSE(fs::exists(out));

  const std::string truncated = copy_of_original();
  fs::resize_file(fs::path(truncated) / "model.safetensors", 1000);
  expect_error([&] { skew_checkpoint(truncated, fresh("out")); }, {"model.safetensors"});

  expect_error([&] { skew_checkpoint(fresh("nowhere"), fresh("out")); }, {"no such directory"});
}

TEST_F(SkewTest, CalibrationLengthOutOfRangeIsRefused) {
  for (int64_t length : {int64_t{1}, int64_t{0}, int64_t{257}}) {
    SkewOptions options;
    options.calib_len = length;
    expect_error([&] { skew_checkpoint(original(), fresh("out"), options); },
                 {"calib-len " + std::to_string(length), "max_positions (256)"});
  }
}

TEST_F(SkewTest, MissingOrEmptyCalibrationFileIsRefused) {
  SkewOptions options;
  options.calib_len = 16;
  options.calib_file = fresh("no-such-text") + ".txt";
  expect_error([&] { skew_checkpoint(original(), fresh("out"), options); },
               {options.calib_file, "calibration file not found"});
  options.calib_file = fresh("empty") + ".txt";
  std::ofstream(options.calib_file).close();
  expect_error([&] { skew_checkpoint(original(), fresh("out"), options); },
               {options.calib_file, "calibration file is empty"});
  // A real file works, and is recorded by name.
  options.calib_file = fresh("text") + ".txt";
  std::ofstream(options.calib_file) << "A short calibration text about nothing in particular.";
  const std::string out = fresh("out");
  const SkewReport report = skew_checkpoint(original(), out, options);
  EXPECT_EQ(report.calib_source, fs::path(options.calib_file).filename().string());
  EXPECT_EQ(report.calib_len, 16);
}

TEST_F(SkewTest, CheckpointWithoutTokenizerNeedsTokenIds) {
  const std::string bare = copy_of_original();
  fs::remove(fs::path(bare) / "vocab.json");
  fs::remove(fs::path(bare) / "merges.txt");
  SkewOptions options;
  options.calib_len = 16;
  expect_error([&] { skew_checkpoint(bare, fresh("out"), options); },
               {bare, "no tokenizer", "token ids"});
  options.calib_tokens = {100, 200, 300};
  const std::string out = fresh("out");
  skew_checkpoint(bare, out, options);
  EXPECT_FALSE(fs::exists(fs::path(out) / "vocab.json"));
  options.calib_tokens = {100, 9000};
  expect_error([&] { skew_checkpoint(bare, fresh("out"), options); },
               {"token id 9000", "vocabulary"});
}

TEST_F(SkewTest, CommandLineSkewsOnceAndRefusesTheSecondTime) {
  const std::string copy = copy_of_original();
  const std::string out = fresh("cli");
  const testing_util::CommandResult first =
      testing_util::run_infinigen({"skew", "--model", copy, "--out", out, "--calib-len", "64"});
  ASSERT_EQ(first.exit_code, 0) << first.err;
  EXPECT_EQ(std::count(first.out.begin(), first.out.end(), '\n'), 1) << first.out;
  for (const char* fragment : {"skewed", "64 tokens", "bundled calibration text", "->"}) {
    EXPECT_NE(first.out.find(fragment), std::string::npos) << fragment << "\n" << first.out;
  }
  EXPECT_TRUE(first.err.empty()) << first.err;  // no progress display when stderr is no terminal
  EXPECT_TRUE(fs::exists(fs::path(out) / "skew.json"));

  const testing_util::CommandResult second =
      testing_util::run_infinigen({"skew", "--model", out, "--out", fresh("cli")});
  EXPECT_NE(second.exit_code, 0);
  EXPECT_EQ(std::count(second.err.begin(), second.err.end(), '\n'), 1) << second.err;
  EXPECT_NE(second.err.find("already skewed (skew.json)"), std::string::npos) << second.err;

  const testing_util::CommandResult bad = testing_util::run_infinigen(
      {"skew", "--model", copy, "--out", fresh("cli"), "--calib-len", "1"});
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_EQ(std::count(bad.err.begin(), bad.err.end(), '\n'), 1) << bad.err;
  EXPECT_NE(bad.err.find("calib-len 1"), std::string::npos) << bad.err;
}

// Rotary models: the skew is computed per KV head from the group's rotated queries and kept
// beside weights that stay bit for bit the same.
class RotarySkewTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    root_ = new TempDir("rotary-skew");
    SkewOptions options;
    options.calib_len = kCalibLen;
    options.calib_tokens = {5, 17, 300, 42, 1024, 8, 99, 1500};
    report_ = new SkewReport(skew_checkpoint(original(), skewed(), options));
  }
  static void TearDownTestSuite() {
    delete report_;
    delete root_;
  }
  // tools/make_hf_checkpoint.py's Llama-3-style checkpoint: 6 query heads, 2 KV heads.
  static std::string original() {
    return (std::filesystem::path(INFINIGEN_FIXTURES_DIR) / "llama-tiny").string();
  }
  static std::string skewed() { return (root_->path() / "skewed").string(); }
  static std::string fresh(const std::string& tag) {
    static int counter = 0;
    return (root_->path() / (tag + "-" + std::to_string(counter++))).string();
  }

  static TempDir* root_;
  static SkewReport* report_;
};
TempDir* RotarySkewTest::root_ = nullptr;
SkewReport* RotarySkewTest::report_ = nullptr;

TEST_F(RotarySkewTest, WeightsStayAndOrthogonalRotationsPerKvHeadGoBeside) {
  const SafetensorsCheckpoint before = SafetensorsCheckpoint::open(original());
  const SafetensorsCheckpoint after = SafetensorsCheckpoint::open(skewed());
  for (const std::string& name : before.names()) {
    const SafetensorsEntry& a = before.entry(name);
    const SafetensorsEntry& b = after.entry(name);
    ASSERT_EQ(a.nbytes, b.nbytes) << name;
    EXPECT_EQ(std::memcmp(before.file_of(name).bytes(a), after.file_of(name).bytes(b), a.nbytes), 0)
        << name;
  }
  const ModelConfig config = load_hf_config(skewed());
  const std::vector<Tensor> skew = load_attention_skew(skewed(), config, Device::Cpu);
  ASSERT_EQ(static_cast<int64_t>(skew.size()), config.num_layers);
  const int64_t G = config.kv_heads(), d = config.head_dim();
  for (const Tensor& layer : skew) {
    ASSERT_EQ(layer.shape(), Shape({G, d, d}));
    for (int64_t g = 0; g < G; ++g) {
      const Eigen::Map<const Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>>
          a(layer.data<float>() + g * d * d, d, d);
      EXPECT_LT((a.transpose() * a - Eigen::MatrixXf::Identity(d, d)).cwiseAbs().maxCoeff(), 1e-5f);
    }
  }
  EXPECT_GT(report_->mean_energy_after(), report_->mean_energy_before());
}

TEST_F(RotarySkewTest, SkewedRunsEqualTheOriginalAndSelectingEverythingEqualsFull) {
  GenerationRequest request;
  request.prompts = {{1, 133, 1234, 77, 901, 45}, {1, 600, 18, 1999, 402, 333, 12, 1500, 7, 88}};
  request.gen_len = 6;
  request.kv_dtype = DType::F32;
  OffloadOptions full;
  full.policy = "full";
  const OffloadRun reference =
      run_offloaded(resolve_model(original(), {}), request, full, Device::Cpu);
  OffloadOptions everything;
  everything.policy = "infinigen";
  everything.speculation.alpha = 1e9;
  everything.speculation.max_num_kv = 1 << 20;
  const OffloadRun skewed_run =
      run_offloaded(resolve_model(skewed(), {}), request, everything, Device::Cpu);
  EXPECT_EQ(skewed_run.result.tokens, reference.result.tokens);
  // At a small ratio the skewed speculation still runs and fetches part of the KV.
  OffloadOptions partial;
  partial.policy = "infinigen";
  partial.speculation.partial_ratio = 0.25;
  partial.speculation.alpha = 2;
  const OffloadRun small =
      run_offloaded(resolve_model(skewed(), {}), request, partial, Device::Cpu);
  EXPECT_EQ(small.result.tokens.size(), request.prompts.size());
}

TEST_F(RotarySkewTest, ABadSkewFileIsRefusedInOneLine) {
  const std::string copy = fresh("copy");
  fs::copy(skewed(), copy, fs::copy_options::recursive);
  const fs::path file = fs::path(copy) / kAttentionSkewFile;
  const ModelConfig config = load_hf_config(copy);
  // One layer missing.
  {
    std::vector<TensorRecord> records = {
        {attention_skew_tensor_name(0),
         DType::F32,
         {config.kv_heads(), config.head_dim(), config.head_dim()}}};
    SafetensorsWriter writer(file.string(), records, {{"format", "pt"}});
    std::vector<float> zeros(static_cast<size_t>(shape_numel(records[0].shape)), 0.0f);
    writer.write(records[0].name, zeros.data(), zeros.size() * sizeof(float));
    writer.finish();
  }
  expect_error([&] { load_weights(resolve_model(copy, {}), Device::Cpu); },
               {kAttentionSkewFile, "missing tensor", attention_skew_tensor_name(1)});
  // A skew beside a model that folds it into its weights.
  const std::string opt = fresh("opt");
  ModelConfig opt_config = load_preset("opt-tiny");
  write_synthetic_checkpoint(opt_config, {}, opt);
  fs::copy_file(fs::path(skewed()) / kAttentionSkewFile, fs::path(opt) / kAttentionSkewFile);
  expect_error([&] { load_weights(resolve_model(opt, {}), Device::Cpu); },
               {kAttentionSkewFile, "rotary"});
}

}  // namespace
}  // namespace infinigen
