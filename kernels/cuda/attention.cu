// kernels/cuda: attention. Prefill is tiled (flash-attention style, fp32 on CUDA cores): a block
// owns a tile of queries of one (sequence, head), streams the keys it may see through shared
// memory a tile at a time and keeps an online softmax per query, so no score matrix is stored.
// Attention over the KV cache gives one block to each (sequence, head, new row); its warps split
// the cache rows and merge their partial softmaxes at the end.
#include <cmath>
#include <type_traits>

#include "kernels/cuda/attention.h"
#include "kernels/cuda/common.cuh"

namespace infinigen::kernels::cuda {
namespace {

using detail::kFullMask;
using detail::kWarpSize;

// Head dimensions are split over the lanes of a warp: lane l holds dims l, l + 32, l + 64, ...
// kPerLane values each, so d <= 32 * kPerLane. Returns 0 when d is too large.
int values_per_lane(int64_t d) {
  if (d <= 32) return 1;
  if (d <= 64) return 2;
  if (d <= 128) return 4;
  if (d <= kMaxHeadDim) return 8;
  return 0;
}

// ---- prefill ----

constexpr int kPrefillWarps = 4;
constexpr int kRowsPerWarp = 4;
constexpr int kQueryTile = kPrefillWarps * kRowsPerWarp;  // queries per block
constexpr int kKeyTile = kWarpSize;                       // keys per tile: one per lane
constexpr int kPrefillThreads = kPrefillWarps * kWarpSize;

size_t prefill_shared_bytes(int64_t d) {
  // q_tile (kQueryTile, d), k_tile (kKeyTile, d + 1), v_tile (kKeyTile, d), all fp32.
  return static_cast<size_t>(kQueryTile * d + kKeyTile * (d + 1) + kKeyTile * d) * sizeof(float);
}

// Grid (ceil(n / kQueryTile), H, B). Token t of sequence b, head h, dim c is element
// (b * n + t) * D + h * d + c of q and out, D = H * d, and of k and v the same with D_kv and
// the KV head h / (H / H_kv).
//
// Warp w owns queries q0 + w * kRowsPerWarp + r. For each key tile, lane j scores key k0 + j
// against the query (the key rows are padded to d + 1 floats, so the 32 lanes reading the same
// dim of 32 different rows hit 32 different banks), the warp takes the tile's max and sum, and
// then each lane accumulates its own dims of p . V. Keys a query may not see (after it: causal)
// get probability 0; left padding is never loaded because tiles start at first_valid[b].
template <int kPerLane>
__global__ void __launch_bounds__(kPrefillThreads)
    prefill_kernel(const float* q, const float* k, const float* v, float* out, int64_t n, int64_t H,
                   int64_t H_kv, int64_t d, const int32_t* first_valid) {
  INFINIGEN_DYNAMIC_SHARED(float, shared);
  float* q_tile = shared;                       // (kQueryTile, d)
  float* k_tile = q_tile + kQueryTile * d;      // (kKeyTile, d + 1)
  float* v_tile = k_tile + kKeyTile * (d + 1);  // (kKeyTile, d)

  const int64_t b = blockIdx.z, h = blockIdx.y;
  const int64_t D = H * d, D_kv = H_kv * d;
  const int64_t base = b * n * D + h * d;                     // (b, token 0, h, dim 0)
  const int64_t kv_base = b * n * D_kv + h / (H / H_kv) * d;  // its KV head
  const int64_t start = first_valid[b];
  const int64_t q0 = static_cast<int64_t>(blockIdx.x) * kQueryTile;
  const int64_t q_end = q0 + kQueryTile < n ? q0 + kQueryTile : n;
  // Causal: the last query of the tile sees keys up to q_end - 1, so keys [start, q_end).
  const int64_t key_end = q_end;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;

  for (int64_t idx = threadIdx.x; idx < kQueryTile * d; idx += blockDim.x) {
    const int64_t t = q0 + idx / d;
    q_tile[idx] = t < q_end ? q[base + t * D + idx % d] : 0.0f;
  }

  float m[kRowsPerWarp], l[kRowsPerWarp], acc[kRowsPerWarp][kPerLane];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
#pragma unroll
    for (int jj = 0; jj < kPerLane; ++jj) acc[r][jj] = 0.0f;
  }

  // start and key_end are the same for the whole block, so every thread meets every barrier.
  for (int64_t k0 = start; k0 < key_end; k0 += kKeyTile) {
    __syncthreads();  // the previous tile is consumed (and, the first time, q_tile is written)
    for (int64_t idx = threadIdx.x; idx < kKeyTile * d; idx += blockDim.x) {
      const int64_t j = idx / d, c = idx % d, t = k0 + j;
      // Rows past key_end are zero, not garbage: p = 0 times a NaN would still be NaN.
      const bool present = t < key_end;
      k_tile[j * (d + 1) + c] = present ? k[kv_base + t * D_kv + c] : 0.0f;
      v_tile[j * d + c] = present ? v[kv_base + t * D_kv + c] : 0.0f;
    }
    __syncthreads();

#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int row = warp * kRowsPerWarp + r;
      const int64_t i = q0 + row;
      // Uniform across the warp. When k0 <= i, lane 0's key k0 is visible, so the tile max below
      // is finite.
      if (i >= q_end || i < start || k0 > i) continue;
      const bool visible = k0 + lane <= i;
      float s = -INFINITY;
      if (visible) {
        const float* q_row = q_tile + row * d;
        const float* k_row = k_tile + lane * (d + 1);
        float dot = 0.0f;
        for (int64_t c = 0; c < d; ++c) dot += q_row[c] * k_row[c];
        s = dot;
      }
      const float m_new = fmaxf(m[r], detail::warp_max(s));
      const float p = visible ? expf(s - m_new) : 0.0f;
      const float correction = expf(m[r] - m_new);  // 0 on the row's first tile (m = -inf)
      l[r] = l[r] * correction + detail::warp_sum(p);
#pragma unroll
      for (int jj = 0; jj < kPerLane; ++jj) acc[r][jj] *= correction;
      for (int j = 0; j < kKeyTile; ++j) {
        const float p_j = __shfl_sync(kFullMask, p, j);
#pragma unroll
        for (int jj = 0; jj < kPerLane; ++jj) {
          const int64_t c = lane + jj * kWarpSize;
          if (c < d) acc[r][jj] += p_j * v_tile[j * d + c];
        }
      }
      m[r] = m_new;
    }
  }

#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int64_t i = q0 + warp * kRowsPerWarp + r;
    if (i >= q_end) continue;
    // Padding rows have acc = 0 and l = 0: they are written as zeros.
    const float inv_l = i < start ? 0.0f : 1.0f / l[r];
#pragma unroll
    for (int jj = 0; jj < kPerLane; ++jj) {
      const int64_t c = lane + jj * kWarpSize;
      if (c < d) out[base + i * D + c] = acc[r][jj] * inv_l;
    }
  }
}

template <int kPerLane>
int launch_prefill(const float* q, const float* k, const float* v, float* out, int64_t B, int64_t n,
                   int64_t H, int64_t H_kv, int64_t d, const int32_t* first_valid,
                   cudaStream_t stream) {
  const size_t shared_bytes = prefill_shared_bytes(d);
  if (shared_bytes > 48 * 1024) {  // beyond the default limit a kernel must opt in
    const cudaError_t status =
        cudaFuncSetAttribute(prefill_kernel<kPerLane>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                             static_cast<int>(shared_bytes));
    if (status != cudaSuccess) return status;
  }
  const dim3 grid(static_cast<unsigned>((n + kQueryTile - 1) / kQueryTile),
                  static_cast<unsigned>(H), static_cast<unsigned>(B));
  INFINIGEN_LAUNCH(grid, kPrefillThreads, shared_bytes, stream, prefill_kernel<kPerLane>)
  (q, k, v, out, n, H, H_kv, d, first_valid);
  return cudaGetLastError();
}

// ---- decode ----

constexpr int kDecodeWarps = 8;
constexpr int kDecodeThreads = kDecodeWarps * kWarpSize;

// Grid (H, B, n). The block of query i of (b, h), cache row length - n + i, reads rows
// [prefix_begin[b], prefix_end) of sequence prefix_source[b]'s (capacity, d) slice of its KV head
// h / (H / H_kv) in each cache (none when prefix_end is 0), then rows [first_valid[b],
// length - n + i + 1) of its own; warp w takes the rows numbered w, w + kDecodeWarps, ... in that
// order, its lanes covering the dims (coalesced row reads), with an online softmax per warp. The
// warps' (max, sum, acc) are then merged in shared memory. A padding query (its row before
// first_valid[b]) writes zeros.
template <typename T, int kPerLane>
__global__ void __launch_bounds__(kDecodeThreads)
    decode_kernel(const float* q, const T* k_cache, const T* v_cache, float* out, int64_t n,
                  int64_t H, int64_t H_kv, int64_t d, int64_t capacity, int64_t length,
                  const int32_t* first_valid, const int32_t* prefix_begin,
                  const int32_t* prefix_source, int64_t prefix_end) {
  __shared__ float warp_m[kDecodeWarps], warp_l[kDecodeWarps];
  __shared__ float warp_acc[kDecodeWarps][kMaxHeadDim];

  const int64_t b = blockIdx.y, h = blockIdx.x, i = blockIdx.z;
  const int64_t head = (b * n + i) * H + h;          // index of (b, i, h) in (B, n, H)
  const int64_t kv_index = h / (H / H_kv);           // the KV head
  const int64_t kv_head = b * H_kv + kv_index;       // its (b, KV head) in (B, H_kv)
  const T* keys = k_cache + kv_head * capacity * d;  // (capacity, d)
  const T* values = v_cache + kv_head * capacity * d;
  const int64_t from = prefix_end > 0 ? prefix_begin[b] : 0;
  const int64_t source = prefix_end > 0 ? prefix_source[b] : b;
  const int64_t shared_rows = prefix_end - from;
  const T* shared_keys = k_cache + (source * H_kv + kv_index) * capacity * d;
  const T* shared_values = v_cache + (source * H_kv + kv_index) * capacity * d;
  const int64_t start = first_valid[b];
  const int64_t end = length - n + i + 1;  // the query's own row, included
  if (end <= start) {                      // a padding query
    for (int64_t c = threadIdx.x; c < d; c += blockDim.x) out[head * d + c] = 0.0f;
    return;
  }
  const int64_t rows = shared_rows + end - start;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;

  float q_part[kPerLane], acc[kPerLane];
#pragma unroll
  for (int jj = 0; jj < kPerLane; ++jj) {
    const int64_t c = lane + jj * kWarpSize;
    q_part[jj] = c < d ? q[head * d + c] : 0.0f;
    acc[jj] = 0.0f;
  }
  float m = -INFINITY, l = 0.0f;
  for (int64_t r = warp; r < rows; r += kDecodeWarps) {
    const bool shared = r < shared_rows;
    const int64_t t = shared ? from + r : start + r - shared_rows;
    const T* k_row = (shared ? shared_keys : keys) + t * d;
    float dot = 0.0f;
#pragma unroll
    for (int jj = 0; jj < kPerLane; ++jj) {
      const int64_t c = lane + jj * kWarpSize;
      if (c < d) dot += q_part[jj] * detail::to_float(k_row[c]);
    }
    const float s = detail::warp_sum(dot);
    const float m_new = fmaxf(m, s);
    const float correction = expf(m - m_new);  // 0 on the warp's first row (m = -inf)
    const float p = expf(s - m_new);
    l = l * correction + p;
    const T* v_row = (shared ? shared_values : values) + t * d;
#pragma unroll
    for (int jj = 0; jj < kPerLane; ++jj) {
      const int64_t c = lane + jj * kWarpSize;
      if (c < d) acc[jj] = acc[jj] * correction + p * detail::to_float(v_row[c]);
    }
    m = m_new;
  }

  if (lane == 0) {
    warp_m[warp] = m;
    warp_l[warp] = l;
  }
#pragma unroll
  for (int jj = 0; jj < kPerLane; ++jj) {
    const int64_t c = lane + jj * kWarpSize;
    if (c < d) warp_acc[warp][c] = acc[jj];
  }
  __syncthreads();

  float top = -INFINITY;
  for (int w = 0; w < kDecodeWarps; ++w) top = fmaxf(top, warp_m[w]);
  for (int64_t c = threadIdx.x; c < d; c += blockDim.x) {
    float total = 0.0f, value = 0.0f;
    for (int w = 0; w < kDecodeWarps; ++w) {
      if (warp_m[w] == -INFINITY) continue;  // a warp that saw no row
      const float scale = expf(warp_m[w] - top);
      total += warp_l[w] * scale;
      value += warp_acc[w][c] * scale;
    }
    out[head * d + c] = total > 0.0f ? value / total : 0.0f;
  }
}

// ---- cache store ----

// Element i of src (B, n, H, d) goes to token offset + t of cache (B, H, capacity, d).
template <typename T>
__global__ void cache_store_kernel(const float* src, T* cache, int64_t n, int64_t H, int64_t d,
                                   int64_t capacity, int64_t offset, int64_t count) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    const int64_t c = i % d;
    int64_t rest = i / d;
    const int64_t h = rest % H;
    rest /= H;
    const int64_t t = rest % n;
    const int64_t b = rest / n;
    cache[((b * H + h) * capacity + offset + t) * d + c] = detail::from_float<T>(src[i]);
  }
}

bool grid_fits(int64_t x, int64_t y, int64_t z) {
  return x <= 0x7fffffff && y <= 65535 && z <= 65535;
}

}  // namespace

int attention_prefill(const float* q, const float* k, const float* v, float* out, int64_t B,
                      int64_t n, int64_t H, int64_t H_kv, int64_t d, const int32_t* first_valid,
                      void* stream) {
  if (B <= 0 || n <= 0 || H <= 0 || d <= 0) return cudaSuccess;
  if (H_kv <= 0 || H % H_kv != 0) return cudaErrorInvalidValue;
  if (!grid_fits((n + kQueryTile - 1) / kQueryTile, H, B)) return cudaErrorInvalidValue;
  const cudaStream_t s = detail::as_stream(stream);
  switch (values_per_lane(d)) {
    case 1:
      return launch_prefill<1>(q, k, v, out, B, n, H, H_kv, d, first_valid, s);
    case 2:
      return launch_prefill<2>(q, k, v, out, B, n, H, H_kv, d, first_valid, s);
    case 4:
      return launch_prefill<4>(q, k, v, out, B, n, H, H_kv, d, first_valid, s);
    case 8:
      return launch_prefill<8>(q, k, v, out, B, n, H, H_kv, d, first_valid, s);
    default:
      return cudaErrorInvalidValue;
  }
}

int attention_decode(const float* q, const void* k_cache, const void* v_cache, Element cache_type,
                     float* out, int64_t B, int64_t n, int64_t H, int64_t H_kv, int64_t d,
                     int64_t capacity, int64_t length, const int32_t* first_valid,
                     const int32_t* prefix_begin, const int32_t* prefix_source, int64_t prefix_end,
                     void* stream) {
  if (B <= 0 || n <= 0 || H <= 0 || d <= 0) return cudaSuccess;
  if (H_kv <= 0 || H % H_kv != 0) return cudaErrorInvalidValue;
  if (!grid_fits(H, B, n) || n > length || length > capacity) return cudaErrorInvalidValue;
  if (prefix_end < 0 || prefix_end > length) return cudaErrorInvalidValue;
  if (prefix_end > 0 && (prefix_begin == nullptr || prefix_source == nullptr)) {
    return cudaErrorInvalidValue;
  }
  const int per_lane = values_per_lane(d);
  if (per_lane == 0) return cudaErrorInvalidValue;
  const cudaStream_t s = detail::as_stream(stream);
  const dim3 grid(static_cast<unsigned>(H), static_cast<unsigned>(B), static_cast<unsigned>(n));
  return detail::dispatch_element(cache_type, [&](auto tag) {
    using T = decltype(tag);
    const T* keys = static_cast<const T*>(k_cache);
    const T* values = static_cast<const T*>(v_cache);
    const auto launch = [&](auto per_lane_tag) {
      constexpr int kPerLane = decltype(per_lane_tag)::value;
      INFINIGEN_LAUNCH(grid, kDecodeThreads, 0, s, decode_kernel<T, kPerLane>)
      (q, keys, values, out, n, H, H_kv, d, capacity, length, first_valid, prefix_begin,
       prefix_source, prefix_end);
    };
    switch (per_lane) {
      case 1:
        launch(std::integral_constant<int, 1>{});
        break;
      case 2:
        launch(std::integral_constant<int, 2>{});
        break;
      case 4:
        launch(std::integral_constant<int, 4>{});
        break;
      default:
        launch(std::integral_constant<int, 8>{});
        break;
    }
    return static_cast<int>(cudaGetLastError());
  });
}

int cache_store(const float* src, void* cache, Element cache_type, int64_t B, int64_t n, int64_t H,
                int64_t d, int64_t capacity, int64_t offset, void* stream) {
  const int64_t count = B * n * H * d;
  if (count <= 0) return cudaSuccess;
  if (offset < 0 || offset + n > capacity) return cudaErrorInvalidValue;
  constexpr int threads = 256;
  const cudaStream_t s = detail::as_stream(stream);
  return detail::dispatch_element(cache_type, [&](auto tag) {
    using T = decltype(tag);
    INFINIGEN_LAUNCH(detail::grid_stride_blocks(count, threads), threads, 0, s,
                     cache_store_kernel<T>)
    (src, static_cast<T*>(cache), n, H, d, capacity, offset, count);
    return static_cast<int>(cudaGetLastError());
  });
}

}  // namespace infinigen::kernels::cuda
