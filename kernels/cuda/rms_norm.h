// kernels/cuda: RMSNorm over the last axis, one thread block per row.
#pragma once

#include <cstdint>

namespace infinigen::kernels::cuda {

// y (rows, cols) = x / sqrt(mean(x^2) + eps) * gamma (cols), all fp32, the mean square per row
// in fp32. `y` may alias `x`. `stream` is a cudaStream_t (null: default stream).
int rms_norm(const float* x, const float* gamma, float* y, int64_t rows, int64_t cols, float eps,
             void* stream);

}  // namespace infinigen::kernels::cuda
