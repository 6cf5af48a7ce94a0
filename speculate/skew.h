// speculate: offline skewing of a checkpoint (InfiniGen, OSDI'24; docs/skewing.md).
//
// Per layer l and head h, the queries of calibration text Q_h (n, d), taken before the 1/sqrt(d)
// scaling, have the SVD Q_h = U S V^T; A_h = V (d, d) has the right singular vectors as columns,
// by descending singular value. Rotating the head's query and key projections by the same
// orthogonal A_h (HF layout, weight is (out, in): Wq[h rows] <- A_h^T Wq[h rows], bq[h] <- A_h^T
// bq[h], the same for Wk, bk) leaves every attention logit unchanged, since
// (Q A)(K A)^T = Q A A^T K^T = Q K^T, while concentrating the queries' energy in their first
// columns: what lets speculation attend with a few columns only. The result is an ordinary
// checkpoint of the same architecture.
//
// Rotary models (the Llama family) rotate q and k by their positions after the projections, so
// no A can be folded into W_q and W_k (RoPE mixes pairs of channels with angles that depend on
// the position). There, A is computed per KV head from the rotated queries of its group of
// query heads, and kept beside the unchanged weights (core/weights.h, kAttentionSkewFile);
// speculation applies it to the rotated partial query and to the rotated keys
// (speculate/speculation.h). The model's own attention never uses it, so skewing changes no
// output at all.
#pragma once

#include <Eigen/Dense>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "core/model.h"
#include "core/tensor.h"

namespace infinigen {

// Fraction of a head's columns whose energy the diagnostics report (InfiniGen's partial ratio).
inline constexpr double kSkewEnergyColumnRatio = 0.3;
// Calibration length when none is given (capped at the model's max_positions).
inline constexpr int64_t kDefaultCalibrationLength = 2048;
// Bumped when skew.json or the meaning of a skewed checkpoint changes.
inline constexpr int kSkewFormatVersion = 1;

// (stage, done, total): stages "calibrating" (layers), "writing" (tensors).
using SkewProgress = std::function<void(const std::string& stage, int64_t done, int64_t total)>;

struct SkewMatrices {
  // num_heads: the rotations per layer, one per head (or per KV head of a rotary model).
  int64_t num_layers = 0, num_heads = 0, head_dim = 0;
  // [layer][head]: A_h (d, d), orthogonal, columns ordered by descending singular value.
  std::vector<std::vector<Eigen::MatrixXd>> rotations;
  // [layer][head]: the singular values of Q_h (d), descending (zeros past n when n < d).
  std::vector<std::vector<Eigen::VectorXd>> singular_values;
  // [layer]: fraction of the layer's query energy (sum of squares over all heads) held by each
  // head's top floor(0.3 d) columns, ranked by sum_t |Q[t, j]|, before and after the rotation.
  std::vector<double> energy_before, energy_after;
};

// Sum over the top floor(ratio * cols) columns (at least one) of `queries` (n, cols), ranked by
// sum_t |q[t, j]|, of their squared entries; the squared Frobenius norm goes to `total`.
double top_column_energy(const Eigen::MatrixXd& queries, double ratio, double* total);

// BOS (when the model has one) followed by `ids` repeated and truncated to `length` tokens in
// all (ids must be non-empty when length > 1).
std::vector<int32_t> calibration_tokens(const std::vector<int32_t>& ids,
                                        std::optional<int32_t> bos_id, int64_t length);

// Runs `tokens` (one sequence, fp32 KV) through `model` and computes A_h for every layer and
// head from the fp64 queries x Wq[h rows]^T + bq[h] of each layer's attention input x (rotary
// models: A_g per KV head from the rotated queries of its group, stacked). The heads of a layer
// run in parallel (OpenMP) while the model waits; nothing but the matrices is kept.
SkewMatrices compute_skew_matrices(Model& model, const std::vector<int32_t>& tokens,
                                   const SkewProgress& progress = {});

// `rows` (D, cols) = H blocks of d rows (a projection weight in HF layout, or a bias as one
// column) with block h replaced by A_h^T times it, in fp64.
Eigen::MatrixXd rotate_head_rows(const Eigen::MatrixXd& rows,
                                 const std::vector<Eigen::MatrixXd>& layer_rotations);
// The same for a stored weight (D, D) or bias (D) of any floating dtype: widened to fp64, rotated,
// and rounded back into its dtype.
Tensor rotate_projection(const Tensor& projection,
                         const std::vector<Eigen::MatrixXd>& layer_rotations);

struct SkewOptions {
  // Calibration tokens, BOS included: 2..max_positions; default min(2048, max_positions).
  std::optional<int64_t> calib_len;
  // Calibration text file; empty means the bundled calibration text (configs/calibration.txt).
  std::string calib_file;
  // Token ids used instead of text (then no tokenizer is needed); BOS is prepended.
  std::vector<int32_t> calib_tokens;
};

struct SkewReport {
  std::string source;        // input directory
  std::string calib_source;  // calibration file name, "bundled calibration text" or "token ids"
  int64_t calib_len = 0;     // tokens, BOS included
  DType dtype = DType::F32;  // stored dtype of the query projections
  std::vector<double> energy_before, energy_after;  // per layer, as in SkewMatrices
  double mean_energy_before() const;
  double mean_energy_after() const;
};

// Skews the checkpoint in `in_dir` into `out_dir` (must not exist, or be empty): the query and
// key projections rotated (rotary models: the rotations written beside the weights instead),
// every other tensor copied bit for bit, config.json and the tokenizer files copied, and
// skew.json recording the calibration and the energy diagnostics. Written into
// a sibling temporary directory and renamed into place. Throws a one-line Error for an input that
// is already skewed, a malformed checkpoint, a non-empty output, a calibration length outside
// 2..max_positions, a missing or empty calibration file, or calibration text without a tokenizer.
SkewReport skew_checkpoint(const std::string& in_dir, const std::string& out_dir,
                           const SkewOptions& options = {}, const SkewProgress& progress = {});

}  // namespace infinigen
