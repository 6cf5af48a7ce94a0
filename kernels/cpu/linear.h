// kernels/cpu: fully connected layer with fp32 activations and fp32/fp16/bf16 weights.
#pragma once

#include <cstdint>

#include "kernels/cpu/element_type.h"

namespace infinigen::kernels::cpu {

// y (M, N) = x (M, K) . w (N, K)^T + bias (N), then ReLU when `relu`.
// `w` is in HF layout (out x in) of `w_type`; `bias` may be null. 16-bit weights are widened to
// fp32 a block of rows at a time, so memory traffic stays that of the 16-bit matrix.
void linear(const float* x, const void* w, Element w_type, const float* bias, float* y, int64_t M,
            int64_t N, int64_t K, bool relu);

}  // namespace infinigen::kernels::cpu
