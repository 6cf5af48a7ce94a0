// kernels/cuda: RMSNorm, one thread block per row.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/rms_norm.h"

namespace infinigen::kernels::cuda {
namespace {

constexpr int kThreads = 256;  // a multiple of the warp size (block_sum relies on it)

// x and y may alias: the statistic is complete (barriers in block_sum) before any write, and each
// thread writes only the elements it read.
__global__ void rms_norm_kernel(const float* x, const float* gamma, float* y, int64_t cols,
                                float eps) {
  __shared__ float partials[kThreads / detail::kWarpSize];
  const float* in = x + static_cast<int64_t>(blockIdx.x) * cols;
  float* out = y + static_cast<int64_t>(blockIdx.x) * cols;
  float sq = 0.0f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) sq += in[c] * in[c];
  const float inv_rms = rsqrtf(detail::block_sum(sq, partials) / static_cast<float>(cols) + eps);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) out[c] = gamma[c] * (in[c] * inv_rms);
}

}  // namespace

int rms_norm(const float* x, const float* gamma, float* y, int64_t rows, int64_t cols, float eps,
             void* stream) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  if (rows > 0x7fffffff) return cudaErrorInvalidValue;  // grid.x limit
  INFINIGEN_LAUNCH(static_cast<unsigned>(rows), kThreads, 0, detail::as_stream(stream),
                   rms_norm_kernel)
  (x, gamma, y, cols, eps);
  return cudaGetLastError();
}

}  // namespace infinigen::kernels::cuda
