// kernels/cuda: LayerNorm over the last axis, one thread block per row.
#pragma once

#include <cstdint>

namespace infinigen::kernels::cuda {

// y (rows, cols) = (x - mean) / sqrt(var + eps) * gamma (cols) + beta (cols), all fp32,
// statistics per row in fp32 (two passes: mean, then variance of the centred row). `y` may
// alias `x`.
int layer_norm(const float* x, const float* gamma, const float* beta, float* y, int64_t rows,
               int64_t cols, float eps, void* stream);

}  // namespace infinigen::kernels::cuda
