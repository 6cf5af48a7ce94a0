// kernels/cuda: rotary position embedding applied in place.
#pragma once

#include <cstdint>

namespace infinigen::kernels::cuda {

// x (rows, heads, head_dim) fp32 on the device, rotated in place: in each head, channels
// (i, i + head_dim / 2) by the angle positions[row] * inv_freq[i] (positions (rows) and
// inv_freq (head_dim / 2) on the device), as kernels/cpu/rope.h.
int rope(float* x, const int32_t* positions, const float* inv_freq, int64_t rows, int64_t heads,
         int64_t head_dim, void* stream);

}  // namespace infinigen::kernels::cuda
