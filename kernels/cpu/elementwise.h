// kernels/cpu: small elementwise ops on fp32 buffers.
#pragma once

#include <cstdint>

namespace infinigen::kernels::cpu {

// y[i] += x[i] for i < n (the residual connection).
void add_inplace(float* y, const float* x, int64_t n);
// y[i] *= factor for i < n.
void scale_inplace(float* y, float factor, int64_t n);
// gate[i] = silu(gate[i]) * up[i] for i < n, silu(g) = g / (1 + exp(-g)) (SwiGLU's product).
void silu_mul(float* gate, const float* up, int64_t n);

}  // namespace infinigen::kernels::cpu
