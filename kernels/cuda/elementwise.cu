// kernels/cuda: elementwise ops, grid-stride loops over fp32 elements.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/elementwise.h"

namespace infinigen::kernels::cuda {
namespace {

constexpr int kThreads = 256;

__global__ void add_kernel(float* y, const float* x, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    y[i] += x[i];
}

__global__ void scale_kernel(float* y, float factor, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    y[i] *= factor;
}

__global__ void silu_mul_kernel(float* gate, const float* up, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    gate[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

}  // namespace

int add_inplace(float* y, const float* x, int64_t n, void* stream) {
  if (n <= 0) return cudaSuccess;  // a launch of zero blocks is an error
  INFINIGEN_LAUNCH(detail::grid_stride_blocks(n, kThreads), kThreads, 0, detail::as_stream(stream),
                   add_kernel)
  (y, x, n);
  return cudaGetLastError();
}

int scale_inplace(float* y, float factor, int64_t n, void* stream) {
  if (n <= 0) return cudaSuccess;
  INFINIGEN_LAUNCH(detail::grid_stride_blocks(n, kThreads), kThreads, 0, detail::as_stream(stream),
                   scale_kernel)
  (y, factor, n);
  return cudaGetLastError();
}

int silu_mul(float* gate, const float* up, int64_t n, void* stream) {
  if (n <= 0) return cudaSuccess;
  INFINIGEN_LAUNCH(detail::grid_stride_blocks(n, kThreads), kThreads, 0, detail::as_stream(stream),
                   silu_mul_kernel)
  (gate, up, n);
  return cudaGetLastError();
}

}  // namespace infinigen::kernels::cuda
