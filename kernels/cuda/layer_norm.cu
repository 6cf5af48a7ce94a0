// kernels/cuda: LayerNorm, one thread block per row, two passes over the row as the CPU kernel
// (mean first, then the variance of the centred values: no cancellation on rows with a large
// mean, which OPT's outlier channels produce).
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/layer_norm.h"

namespace infinigen::kernels::cuda {
namespace {

constexpr int kThreads = 256;  // a multiple of the warp size (block_sum relies on it)

// x and y may alias: each thread reads element c of the row before it writes element c, and the
// statistics are complete (barriers in block_sum) before any write.
__global__ void layer_norm_kernel(const float* x, const float* gamma, const float* beta, float* y,
                                  int64_t cols, float eps) {
  __shared__ float partials[kThreads / detail::kWarpSize];
  const float* in = x + static_cast<int64_t>(blockIdx.x) * cols;
  float* out = y + static_cast<int64_t>(blockIdx.x) * cols;
  float sum = 0.0f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) sum += in[c];
  const float mean = detail::block_sum(sum, partials) / static_cast<float>(cols);
  float sq = 0.0f;
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
    const float centred = in[c] - mean;
    sq += centred * centred;
  }
  const float inv_std =
      1.0f / sqrtf(detail::block_sum(sq, partials) / static_cast<float>(cols) + eps);
  for (int64_t c = threadIdx.x; c < cols; c += blockDim.x)
    out[c] = (in[c] - mean) * inv_std * gamma[c] + beta[c];
}

}  // namespace

int layer_norm(const float* x, const float* gamma, const float* beta, float* y, int64_t rows,
               int64_t cols, float eps, void* stream) {
  if (rows <= 0 || cols <= 0) return cudaSuccess;
  if (rows > 0x7fffffff) return cudaErrorInvalidValue;  // grid.x limit
  INFINIGEN_LAUNCH(static_cast<unsigned>(rows), kThreads, 0, detail::as_stream(stream),
                   layer_norm_kernel)
  (x, gamma, beta, y, cols, eps);
  return cudaGetLastError();
}

}  // namespace infinigen::kernels::cuda
