// kernels/cuda: fully connected layer through cuBLAS, fp32 activations, fp32/fp16/bf16 weights.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/cuda/element_type.h"

namespace infinigen::kernels::cuda {

// y (M, N) fp32 = x (M, K) fp32 . w (N, K)^T + bias (N) fp32, then ReLU when `relu`.
// `w` is in HF layout (out x in) of `w_type`; `bias` may be null. cuBLAS cannot multiply fp32 by
// 16-bit operands, so for 16-bit weights x is first rounded to w's type into `scratch`, device
// memory of `scratch_bytes` >= M * K * 2 (unused, and may be null, for fp32 weights); that is
// also what fp16 inference does, and accumulation is fp32 in every case. The scratch is the
// caller's: it must not be used by work on another stream until this call's work is done (the
// op layer keeps one per stream). M, N and K must fit in an int (cuBLAS's index type). Uses a
// cuBLAS handle of the calling thread, created on first use. Allocates nothing.
int linear(const float* x, const void* w, Element w_type, const float* bias, float* y, int64_t M,
           int64_t N, int64_t K, bool relu, void* scratch, size_t scratch_bytes, void* stream);

}  // namespace infinigen::kernels::cuda
