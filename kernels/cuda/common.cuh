// kernels/cuda: device-side helpers shared by the .cu files (never included by C++ code).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/element_type.h"

// A kernel launch, kernel<<<grid, block, shared_bytes, stream>>>(args...), is written
// INFINIGEN_LAUNCH(grid, block, shared_bytes, stream, kernel)(args...), and a kernel's dynamic
// shared memory, `extern __shared__ T name[]`, INFINIGEN_DYNAMIC_SHARED(T, name): the same source
// then also builds against the emulated device (kernels/cuda/emulation), where a launch is a call.
#ifdef INFINIGEN_CUDA_EMULATION
#define INFINIGEN_LAUNCH(grid, block, shared_bytes, stream, ...) \
  INFINIGEN_EMULATED_LAUNCH(grid, block, shared_bytes, stream, __VA_ARGS__)
#define INFINIGEN_DYNAMIC_SHARED(type, name) INFINIGEN_EMULATED_DYNAMIC_SHARED(type, name)
#else
#define INFINIGEN_LAUNCH(grid, block, shared_bytes, stream, ...) \
  __VA_ARGS__<<<grid, block, shared_bytes, stream>>>
#define INFINIGEN_DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#endif

namespace infinigen::kernels::cuda::detail {

inline constexpr int kWarpSize = 32;
inline constexpr unsigned kFullMask = 0xffffffffu;

inline cudaStream_t as_stream(void* stream) {
  return static_cast<cudaStream_t>(stream);
}

// Blocks for a grid-stride loop over `count` items: enough to fill any current GPU, few enough
// that the launch never exceeds grid limits whatever `count` is.
inline unsigned grid_stride_blocks(int64_t count, int threads) {
  const int64_t wanted = (count + threads - 1) / threads;
  return static_cast<unsigned>(wanted < 8192 ? wanted : 8192);
}

__device__ __forceinline__ float to_float(float value) {
  return value;
}
__device__ __forceinline__ float to_float(__half value) {
  return __half2float(value);
}
__device__ __forceinline__ float to_float(__nv_bfloat16 value) {
  return __bfloat162float(value);
}

template <typename T>
__device__ __forceinline__ T from_float(float value);
template <>
__device__ __forceinline__ float from_float<float>(float value) {
  return value;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float value) {
  return __float2half_rn(value);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float value) {
  return __float2bfloat16_rn(value);
}

// Sum and max over the 32 lanes of a warp; every lane gets the result (butterfly reduction).
__device__ __forceinline__ float warp_sum(float value) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2)
    value += __shfl_xor_sync(kFullMask, value, offset);
  return value;
}
__device__ __forceinline__ float warp_max(float value) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2)
    value = fmaxf(value, __shfl_xor_sync(kFullMask, value, offset));
  return value;
}

// Sum of `value` over the block (blockDim.x a multiple of the warp size); every thread gets the
// result. `partials` holds one value per warp. The leading barrier lets a previous call's
// readers finish before it is overwritten.
__device__ __forceinline__ float block_sum(float value, float* partials) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int warps = blockDim.x / kWarpSize;
  value = warp_sum(value);
  __syncthreads();
  if (lane == 0) partials[warp] = value;
  __syncthreads();
  return warp_sum(lane < warps ? partials[lane] : 0.0f);
}

// Calls `f(type_tag)` with a value of the C++ type stored for `element`: one switch instead of
// one per kernel launch site.
template <typename F>
int dispatch_element(Element element, F&& f) {
  switch (element) {
    case Element::F32:
      return f(float{});
    case Element::F16:
      return f(__half{});
    case Element::BF16:
      return f(__nv_bfloat16{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace infinigen::kernels::cuda::detail
