// predict: a measured table of what one linear layer costs, by activation rows and input width,
// for hardware whose GEMM speed a roofline does not describe. On the CPU backend a decode-shape
// linear runs Eigen's register-blocked kernel, whose speed per weight byte jumps with the row
// count (4 and 8 rows are faster than 3 and 7) and with K; a profile measured there carries this
// table and the cost model (predict/cost_model.h) looks linear layers up in it.
//
// Model, per cell (rows M, input width K, weights in memory or in the last-level cache):
//   seconds = fixed_s + weight_bytes / bytes_per_s
// measured at two output widths N, so fixed_s holds what does not grow with the weights
// (dispatch, the thread team) and bytes_per_s the streaming of widened weights and the arithmetic.
// Between measured cells the model interpolates (linearly in M, in log K); beyond the largest M
// each further row costs its FLOPs at the profile's gemm_flops; K is clamped to the measured range.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace infinigen {

// One weight placement's cells, indexed [k index][rows index].
struct LinearCostGrid {
  std::vector<std::vector<double>> fixed_s;
  std::vector<std::vector<double>> bytes_per_s;
};

struct LinearCostTable {
  std::vector<int64_t> rows;  // activation rows M, increasing, from 1
  std::vector<int64_t> k;     // input widths K, increasing
  LinearCostGrid memory;      // weights streaming from memory
  LinearCostGrid cache;       // weights resident in the last-level cache

  bool empty() const { return rows.empty(); }
  // Seconds of y (M, N) = x (M, K) . w (N, K)^T with `weight_bytes` bytes of weights; `cached`
  // picks the cache grid; `gemm_flops` prices rows beyond the table.
  double seconds(int64_t M, int64_t N, int64_t K, double weight_bytes, bool cached,
                 double gemm_flops) const;
};

// Throws a one-line Error naming `source` unless the axes are increasing and positive (rows from
// 1) and every grid is k.size() x rows.size() with fixed_s >= 0 and bytes_per_s > 0. Profile
// files carry the table as `linear_table` (predict/hardware_profile.cc reads and writes it).
void check_linear_cost_table(const LinearCostTable& table, const std::string& source);

}  // namespace infinigen
