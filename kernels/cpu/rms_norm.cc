// kernels/cpu: RMSNorm, one row per iteration.
#include "kernels/cpu/rms_norm.h"

#include <cmath>

#include "kernels/cpu/parallel.h"

namespace infinigen::kernels::cpu {

void rms_norm(const float* x, const float* gamma, float* y, int64_t rows, int64_t cols, float eps) {
#pragma omp parallel for schedule(static) if (rows * cols >= kParallelWork)
  for (int64_t r = 0; r < rows; ++r) {
    const float* in = x + r * cols;
    float* out = y + r * cols;
    double sq = 0.0;
    for (int64_t c = 0; c < cols; ++c) sq += static_cast<double>(in[c]) * in[c];
    // As transformers: the fp32 mean square plus eps, its reciprocal square root, then gamma.
    const float inv_rms =
        1.0f / std::sqrt(static_cast<float>(sq / static_cast<double>(cols)) + eps);
    for (int64_t c = 0; c < cols; ++c) out[c] = gamma[c] * (in[c] * inv_rms);
  }
}

}  // namespace infinigen::kernels::cpu
