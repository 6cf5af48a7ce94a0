// kernels/cpu: rotary position embedding applied in place.
#pragma once

#include <cstdint>

namespace infinigen::kernels::cpu {

// x (rows, heads, head_dim) fp32, rotated in place: in each head, the pair of channels
// (i, i + head_dim / 2) by the angle positions[row] * inv_freq[i] (fp32, as transformers computes
// it), i.e. x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin (the "rotate half" convention).
void rope(float* x, const int32_t* positions, const float* inv_freq, int64_t rows, int64_t heads,
          int64_t head_dim);

// One head's (2 * half) channels rotated in place by the angles whose cosines and sines are
// `cos` and `sin` (half each): the rotate-half step of rope(), shared with the keys a session
// moves to other positions (core/rope.h, RotaryShift).
inline void rotate_half(float* head, const float* cos, const float* sin, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = head[i], x2 = head[i + half];
    head[i] = x1 * cos[i] - x2 * sin[i];
    head[i + half] = x2 * cos[i] + x1 * sin[i];
  }
}

}  // namespace infinigen::kernels::cpu
