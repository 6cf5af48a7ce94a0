// kernels/cpu: LayerNorm, one row per iteration, two passes (mean, then variance) as PyTorch does.
#include "kernels/cpu/layer_norm.h"

#include <cmath>

#include "kernels/cpu/parallel.h"

namespace infinigen::kernels::cpu {

void layer_norm(const float* x, const float* gamma, const float* beta, float* y, int64_t rows,
                int64_t cols, float eps) {
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelWork)
  for (int64_t r = 0; r < rows; ++r) {
    const float* in = x + r * cols;
    float* out = y + r * cols;
    double sum = 0.0;
    for (int64_t c = 0; c < cols; ++c) sum += in[c];
    const float mean = static_cast<float>(sum / static_cast<double>(cols));
    double sq = 0.0;
    for (int64_t c = 0; c < cols; ++c) {
      const float centred = in[c] - mean;
      sq += static_cast<double>(centred) * centred;
    }
    const float inv_std =
        1.0f / std::sqrt(static_cast<float>(sq / static_cast<double>(cols)) + eps);
    for (int64_t c = 0; c < cols; ++c) out[c] = (in[c] - mean) * inv_std * gamma[c] + beta[c];
  }
}

}  // namespace infinigen::kernels::cpu
