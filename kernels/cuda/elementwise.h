// kernels/cuda: small elementwise ops on fp32 device buffers.
#pragma once

#include <cstdint>

namespace infinigen::kernels::cuda {

// y (n) += x (n) (the residual connection). `stream` is a cudaStream_t (null: default stream).
int add_inplace(float* y, const float* x, int64_t n, void* stream);
// y (n) *= factor.
int scale_inplace(float* y, float factor, int64_t n, void* stream);
// gate (n) = silu(gate) * up (n), silu(g) = g / (1 + exp(-g)).
int silu_mul(float* gate, const float* up, int64_t n, void* stream);

}  // namespace infinigen::kernels::cuda
