// kernels/cpu: RMSNorm over the last axis (the Llama family's norm).
#pragma once

#include <cstdint>

namespace infinigen::kernels::cpu {

// y (rows, cols) = x / sqrt(mean(x^2) + eps) * gamma (cols), the mean square per row accumulated
// in double. `y` may alias `x`.
void rms_norm(const float* x, const float* gamma, float* y, int64_t rows, int64_t cols, float eps);

}  // namespace infinigen::kernels::cpu
