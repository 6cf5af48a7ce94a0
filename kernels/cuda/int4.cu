// kernels/cuda: the 4-bit KV codec on the device. Every operation is the CPU codec's
// (kernels/cpu/int4.cc) in the same order: fp32 subtraction and division (IEEE-rounded: the
// project never builds with fast math), rintf (ties to even, as std::nearbyint), fp16 conversions
// to nearest even, and the decode min + q * scale (q * scale is exact in fp32, so nvcc's fused
// multiply-add gives the same value); the min and max scans are written as std::min and std::max
// are, so a group of zeros of both signs keeps the CPU's signed min.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/int4.h"

namespace infinigen::kernels::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kGroupSize = 64;

__host__ __device__ __forceinline__ int64_t group_size(int64_t d) {
  return d < kGroupSize ? d : kGroupSize;
}

__device__ __forceinline__ float half_value(uint16_t bits) {
  return __half2float(__ushort_as_half(bits));
}
__device__ __forceinline__ uint16_t half_bits(float value) {
  return __half_as_ushort(__float2half_rn(value));
}

// The smallest fp16 above `h` (finite h).
__device__ __forceinline__ uint16_t next_up(uint16_t h) {
  if ((h & 0x7fffu) == 0) return 0x0001;  // +0 or -0: the smallest subnormal
  if (h & 0x8000u) return static_cast<uint16_t>(h - 1);
  return static_cast<uint16_t>(h + 1);
}

// fp16 roundings toward +inf and -inf.
__device__ __forceinline__ uint16_t round_up(float v) {
  const uint16_t h = half_bits(v);
  return half_value(h) >= v ? h : next_up(h);
}
__device__ __forceinline__ uint16_t round_down(float v) {
  return static_cast<uint16_t>(round_up(-v) ^ 0x8000u);
}

// One thread per (kind, sequence, token, head, group): the group's 64 elements in order, as the
// CPU's loop. Items are numbered (kind, b, t, h, g), so consecutive threads read consecutive
// groups of the source rows.
__global__ void quantize_kernel(const float* keys, const float* values, int64_t B, int64_t n,
                                int64_t H, int64_t d, uint8_t* codes, uint16_t* meta, int64_t rows,
                                int64_t count) {
  const int64_t group = group_size(d), groups = d / group;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    const int64_t g = i % groups;
    int64_t rest = i / groups;
    const int64_t h = rest % H;
    rest /= H;
    const int64_t t = rest % n;
    rest /= n;
    const int64_t b = rest % B;
    const int64_t kind = rest / B;
    const float* x = (kind == 0 ? keys : values) + ((b * n + t) * H + h) * d + g * group;
    const int64_t row = ((kind * B + b) * H + h) * rows + t;
    uint8_t* code = codes + row * (d / 2) + g * group / 2;
    uint16_t* m = meta + row * 2 * groups + 2 * g;

    float lo = x[0], hi = x[0];
    for (int64_t k = 1; k < group; ++k) {
      const float v = x[k];
      lo = v < lo ? v : lo;  // std::min(lo, v)
      hi = hi < v ? v : hi;  // std::max(hi, v)
    }
    const uint16_t min16 = round_down(lo);
    const float min = half_value(min16);
    const uint16_t scale16 = hi > min ? round_up((hi - min) / 15.0f) : uint16_t{0};
    const float scale = half_value(scale16);
    m[0] = min16;
    m[1] = scale16;
    for (int64_t k = 0; k < group; k += 2) {
      unsigned q[2] = {0, 0};
      if (scale > 0.0f) {
        for (int j = 0; j < 2; ++j) {
          const float v = rintf((x[k + j] - min) / scale);
          q[j] = static_cast<unsigned>(v < 0.0f ? 0.0f : (15.0f < v ? 15.0f : v));  // std::clamp
        }
      }
      code[k / 2] = static_cast<uint8_t>(q[0] | (q[1] << 4));
    }
  }
}

// One thread per code byte (two elements) of rows [t0, t1): items numbered (kind, b, h, t, byte),
// so a warp reads consecutive code bytes and writes consecutive fp16 pairs. Bytes of rows that
// land in sequence b's left padding are skipped.
__global__ void dequantize_kernel(const uint8_t* codes, const uint16_t* meta, int64_t rows,
                                  int64_t B, int64_t H, int64_t d, int64_t t0, int64_t t1,
                                  const int32_t* first_valid, int64_t row0, __half* keys,
                                  __half* values, int64_t capacity, int64_t count) {
  const int64_t group = group_size(d), groups = d / group, bytes = d / 2, span = t1 - t0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    const int64_t j = i % bytes;
    int64_t rest = i / bytes;
    const int64_t t = t0 + rest % span;
    rest /= span;
    const int64_t h = rest % H;
    rest /= H;
    const int64_t b = rest % B;
    const int64_t kind = rest / B;
    const int64_t out_row = row0 + t - t0;
    if (out_row < first_valid[b]) continue;  // left padding: never read, never decoded
    const int64_t row = ((kind * B + b) * H + h) * rows + t;
    const uint16_t* m = meta + row * 2 * groups + 2 * (2 * j / group);
    const float min = half_value(m[0]);
    const float scale = half_value(m[1]);
    const unsigned byte = codes[row * bytes + j];
    __half* out = (kind == 0 ? keys : values) + ((b * H + h) * capacity + out_row) * d + 2 * j;
    out[0] = __float2half_rn(min + static_cast<float>(byte & 0x0fu) * scale);
    out[1] = __float2half_rn(min + static_cast<float>(byte >> 4) * scale);
  }
}

bool valid_head_dim(int64_t d) {
  return d > 0 && d % 2 == 0 && (d < kGroupSize || d % kGroupSize == 0);
}

}  // namespace

int int4_quantize(const float* keys, const float* values, int64_t B, int64_t n, int64_t H,
                  int64_t d, uint8_t* codes, uint16_t* meta, int64_t rows, void* stream) {
  if (!valid_head_dim(d) || n > rows) return cudaErrorInvalidValue;
  const int64_t count = 2 * B * n * H * (d / group_size(d));
  if (count <= 0) return cudaSuccess;  // a launch of zero blocks is an error
  INFINIGEN_LAUNCH(detail::grid_stride_blocks(count, kThreads), kThreads, 0,
                   detail::as_stream(stream), quantize_kernel)
  (keys, values, B, n, H, d, codes, meta, rows, count);
  return cudaGetLastError();
}

int int4_dequantize(const uint8_t* codes, const uint16_t* meta, int64_t rows, int64_t B, int64_t H,
                    int64_t d, int64_t t0, int64_t t1, const int32_t* first_valid, int64_t row0,
                    uint16_t* keys, uint16_t* values, int64_t capacity, void* stream) {
  if (!valid_head_dim(d) || t0 < 0 || t1 > rows || row0 < 0 || row0 + (t1 - t0) > capacity) {
    return cudaErrorInvalidValue;
  }
  const int64_t count = 2 * B * H * (t1 - t0) * (d / 2);
  if (count <= 0) return cudaSuccess;
  INFINIGEN_LAUNCH(detail::grid_stride_blocks(count, kThreads), kThreads, 0,
                   detail::as_stream(stream), dequantize_kernel)
  (codes, meta, rows, B, H, d, t0, t1, first_valid, row0, reinterpret_cast<__half*>(keys),
   reinterpret_cast<__half*>(values), capacity, count);
  return cudaGetLastError();
}

}  // namespace infinigen::kernels::cuda
