// kernels/cpu: rotary position embedding applied in place.
#pragma once

#include <cstdint>

namespace infinigen::kernels::cpu {

// x (rows, heads, head_dim) fp32, rotated in place: in each head, the pair of channels
// (i, i + head_dim / 2) by the angle positions[row] * inv_freq[i] (fp32, as transformers computes
// it), i.e. x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin (the "rotate half" convention).
void rope(float* x, const int32_t* positions, const float* inv_freq, int64_t rows, int64_t heads,
          int64_t head_dim);

}  // namespace infinigen::kernels::cpu
