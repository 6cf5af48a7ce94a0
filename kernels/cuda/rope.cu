// kernels/cuda: RoPE, a grid-stride loop over (row, head, pair) triples; each thread rotates one
// channel pair, so nothing is shared and x is updated in place without hazards.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/rope.h"

namespace infinigen::kernels::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void rope_kernel(float* x, const int32_t* positions, const float* inv_freq, int64_t rows,
                            int64_t heads, int64_t half) {
  const int64_t pairs = rows * heads * half;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t p = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; p < pairs;
       p += stride) {
    const int64_t i = p % half, row_head = p / half, row = row_head / heads;
    // Precise sincosf (not the intrinsic): angles reach thousands of radians.
    float s, c;
    sincosf(static_cast<float>(positions[row]) * inv_freq[i], &s, &c);
    float* head = x + row_head * 2 * half;
    const float x1 = head[i], x2 = head[i + half];
    head[i] = x1 * c - x2 * s;
    head[i + half] = x2 * c + x1 * s;
  }
}

}  // namespace

int rope(float* x, const int32_t* positions, const float* inv_freq, int64_t rows, int64_t heads,
         int64_t head_dim, void* stream) {
  const int64_t pairs = rows * heads * (head_dim / 2);
  if (pairs <= 0) return cudaSuccess;
  INFINIGEN_LAUNCH(detail::grid_stride_blocks(pairs, kThreads), kThreads, 0,
                   detail::as_stream(stream), rope_kernel)
  (x, positions, inv_freq, rows, heads, head_dim / 2);
  return cudaGetLastError();
}

}  // namespace infinigen::kernels::cuda
