// kernels/cpu: fully connected layer on Eigen GEMMs, parallel over blocks of output features.
#include "kernels/cpu/linear.h"

#include <Eigen/Core>
#include <algorithm>
#include <vector>

#include "kernels/cpu/parallel.h"

namespace infinigen::kernels::cpu {
namespace {

using RowMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using ConstRows = Eigen::Map<const RowMajor>;
using StridedRows = Eigen::Map<RowMajor, 0, Eigen::OuterStride<>>;

// Output features per block: a block of widened weights (64 x K fp32) stays in L2.
constexpr int64_t kBlockRows = 64;

}  // namespace

void linear(const float* x, const void* w, Element w_type, const float* bias, float* y, int64_t M,
            int64_t N, int64_t K, bool relu) {
  const ConstRows X(x, M, K);
  const int64_t n_blocks = (N + kBlockRows - 1) / kBlockRows;
#pragma omp parallel if (M * N * K >= kParallelWork)
  {
    // One buffer per thread for the life of the thread: a fresh 64 x K fp32 block per call is
    // big enough for malloc to map and unmap it, and the page faults of each call cost more
    // than a decode-shape product of a narrow matrix (a 512 x 4096 one ran 1.5x slower).
    thread_local std::vector<float> widened;
#pragma omp for schedule(static)
    for (int64_t block = 0; block < n_blocks; ++block) {
      const int64_t row0 = block * kBlockRows;
      const int64_t rows = std::min(kBlockRows, N - row0);
      const float* w_block;
      if (w_type == Element::F32) {
        w_block = static_cast<const float*>(w) + row0 * K;
      } else {
        widened.resize(static_cast<size_t>(rows * K));
        widen(w, w_type, static_cast<size_t>(row0 * K), widened.data(), widened.size());
        w_block = widened.data();
      }
      StridedRows Y(y + row0, M, rows, Eigen::OuterStride<>(N));
      Y.noalias() = X * ConstRows(w_block, rows, K).transpose();
      if (bias != nullptr) Y.rowwise() += Eigen::Map<const Eigen::RowVectorXf>(bias + row0, rows);
      if (relu) Y = Y.cwiseMax(0.0f);
    }
  }
}

}  // namespace infinigen::kernels::cpu
