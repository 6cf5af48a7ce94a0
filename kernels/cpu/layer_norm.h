// kernels/cpu: LayerNorm over the last axis.
#pragma once

#include <cstdint>

namespace infinigen::kernels::cpu {

// y (rows, cols) = (x - mean) / sqrt(var + eps) * gamma + beta, statistics per row in fp32.
// `y` may alias `x`.
void layer_norm(const float* x, const float* gamma, const float* beta, float* y, int64_t rows,
                int64_t cols, float eps);

}  // namespace infinigen::kernels::cpu
