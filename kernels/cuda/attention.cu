// kernels/cuda: attention. A prompt's pass and an extension of the cache by many rows are tiled
// (flash-attention style, fp32 on CUDA cores): a block owns a tile of queries of one (sequence,
// head), streams the rows they may see through shared memory a tile at a time and keeps an online
// softmax per query, so no score matrix is stored and each row is read once per tile of queries.
// A decode step (and an extension by a few rows) gives one block to each (sequence, head, new
// row); its warps split the cache rows and merge their partial softmaxes at the end.
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

// ---- tiled attention: a prompt's pass, and an extension over the cache ----

constexpr int kTileWarps = 4;
constexpr int kRowsPerWarp = 4;
constexpr int kQueryTile = kTileWarps * kRowsPerWarp;  // queries per block
constexpr int kKeyTile = kWarpSize;                    // keys per tile: one per lane
constexpr int kTileThreads = kTileWarps * kWarpSize;
// An extension of at least this many rows per sequence takes the tiled kernel, which reads each
// key once per tile of queries; fewer take the decode kernel once per row, whose blocks keep all
// their warps busy (a tile of 2 rows would leave 3 of its 4 warps idle).
constexpr int64_t kTiledExtensionRows = kQueryTile / 2;

size_t tile_shared_bytes(int64_t d) {
  // q_tile (kQueryTile, d), k_tile (kKeyTile, d + 1), v_tile (kKeyTile, d), all fp32.
  return static_cast<size_t>(kQueryTile * d + kKeyTile * (d + 1) + kKeyTile * d) * sizeof(float);
}

// Where a tile's keys come from. A source gives, for one (sequence, KV head), the K and V rows a
// query may see numbered from 0 (`key(r)`, `value(r)`: d values each), and how many of them
// query i of the pass sees (`visible(i)`: 0 for a padding query, non-decreasing in i).

// A prompt's pass: its own K and V, (B, n, H_kv, d) fp32; query i sees tokens
// [first_valid[b], i].
struct PromptRows {
  const float* k;
  const float* v;
  int64_t n, H_kv, d;
  const int32_t* first_valid;

  struct Slice {
    const float* k;  // token first_valid[b] of (b, KV head)
    const float* v;
    int64_t stride, start;
    __device__ const float* key(int64_t r) const { return k + r * stride; }
    __device__ const float* value(int64_t r) const { return v + r * stride; }
    __device__ int64_t visible(int64_t i) const { return i < start ? 0 : i + 1 - start; }
  };
  __device__ Slice slice(int64_t b, int64_t kv_head) const {
    const int64_t stride = H_kv * d, start = first_valid[b];
    const int64_t at = (b * n + start) * stride + kv_head * d;
    return {k + at, v + at, stride, start};
  }
};

// An extension of the stored tokens by n rows, over the cache (B, H_kv, capacity, d) of T: query
// i is cache row length - n + i and sees rows [prefix_begin[b], prefix_end) of sequence
// prefix_source[b] (its group's shared prefix; none when prefix_end is 0), then its own rows
// [first_valid[b], length - n + i].
template <typename T>
struct CacheRows {
  const T* k;
  const T* v;
  int64_t n, H_kv, d, capacity, length;
  const int32_t* first_valid;
  const int32_t* prefix_begin;
  const int32_t* prefix_source;
  int64_t prefix_end;

  struct Slice {
    const T* shared_k;  // row prefix_begin[b] of the prefix's (source, KV head)
    const T* shared_v;
    const T* own_k;  // row first_valid[b] of (b, KV head)
    const T* own_v;
    int64_t d, shared_rows, start, first_query_row;
    __device__ const T* key(int64_t r) const {
      return r < shared_rows ? shared_k + r * d : own_k + (r - shared_rows) * d;
    }
    __device__ const T* value(int64_t r) const {
      return r < shared_rows ? shared_v + r * d : own_v + (r - shared_rows) * d;
    }
    __device__ int64_t visible(int64_t i) const {
      const int64_t end = first_query_row + i + 1;  // the query's own row, included
      return end <= start ? 0 : shared_rows + end - start;
    }
  };
  __device__ Slice slice(int64_t b, int64_t kv_head) const {
    const int64_t from = prefix_end > 0 ? prefix_begin[b] : 0;
    const int64_t source = prefix_end > 0 ? prefix_source[b] : b;
    const int64_t start = first_valid[b];
    const int64_t shared_at = ((source * H_kv + kv_head) * capacity + from) * d;
    const int64_t own_at = ((b * H_kv + kv_head) * capacity + start) * d;
    return {k + shared_at,     v + shared_at, k + own_at, v + own_at, d,
            prefix_end - from, start,         length - n};
  }
};

// Grid (ceil(n / kQueryTile), H, B). Query i of sequence b, head h, dim c is element
// (b * n + i) * D + h * d + c of q and out, D = H * d; query head h reads KV head h / (H / H_kv)
// of `rows`.
//
// Warp w owns queries q0 + w * kRowsPerWarp + r. For each key tile, lane j scores row r0 + j
// against the query (the key rows are padded to d + 1 floats, so the 32 lanes reading the same
// dim of 32 different rows hit 32 different banks), the warp takes the tile's max and sum, and
// then each lane accumulates its own dims of p . V. Rows a query may not see (after it: causal)
// get probability 0; rows no query of the tile sees are never loaded.
template <typename Rows, int kPerLane>
__global__ void __launch_bounds__(kTileThreads)
    tiled_attention_kernel(const float* q, float* out, int64_t n, int64_t H, int64_t H_kv,
                           int64_t d, Rows rows) {
  INFINIGEN_DYNAMIC_SHARED(float, shared);
  float* q_tile = shared;                       // (kQueryTile, d)
  float* k_tile = q_tile + kQueryTile * d;      // (kKeyTile, d + 1)
  float* v_tile = k_tile + kKeyTile * (d + 1);  // (kKeyTile, d)

  const int64_t b = blockIdx.z, h = blockIdx.y;
  const int64_t D = H * d;
  const int64_t base = b * n * D + h * d;  // (b, query 0, h, dim 0)
  const auto slice = rows.slice(b, h / (H / H_kv));
  const int64_t q0 = static_cast<int64_t>(blockIdx.x) * kQueryTile;
  const int64_t q_end = q0 + kQueryTile < n ? q0 + kQueryTile : n;
  // The tile's last query sees the most rows.
  const int64_t row_end = slice.visible(q_end - 1);
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

  // row_end is the same for the whole block, so every thread meets every barrier.
  for (int64_t r0 = 0; r0 < row_end; r0 += kKeyTile) {
    __syncthreads();  // the previous tile is consumed (and, the first time, q_tile is written)
    for (int64_t idx = threadIdx.x; idx < kKeyTile * d; idx += blockDim.x) {
      const int64_t j = idx / d, c = idx % d, r = r0 + j;
      // Rows past row_end are zero, not garbage: p = 0 times a NaN would still be NaN.
      const bool present = r < row_end;
      k_tile[j * (d + 1) + c] = present ? detail::to_float(slice.key(r)[c]) : 0.0f;
      v_tile[j * d + c] = present ? detail::to_float(slice.value(r)[c]) : 0.0f;
    }
    __syncthreads();

#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int row = warp * kRowsPerWarp + r;
      const int64_t i = q0 + row;
      if (i >= q_end) continue;
      // Uniform across the warp. When r0 < seen, lane 0's row r0 is visible, so the tile max
      // below is finite.
      const int64_t seen = slice.visible(i);
      if (r0 >= seen) continue;
      const bool visible = r0 + lane < seen;
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
    // Padding queries saw no row (acc = 0, l = 0): they are written as zeros.
    const float inv_l = slice.visible(i) == 0 ? 0.0f : 1.0f / l[r];
#pragma unroll
    for (int jj = 0; jj < kPerLane; ++jj) {
      const int64_t c = lane + jj * kWarpSize;
      if (c < d) out[base + i * D + c] = acc[r][jj] * inv_l;
    }
  }
}

template <int kPerLane, typename Rows>
int launch_tiled(const float* q, float* out, int64_t B, int64_t n, int64_t H, int64_t H_kv,
                 int64_t d, const Rows& rows, cudaStream_t stream) {
  const size_t shared_bytes = tile_shared_bytes(d);
  if (shared_bytes > 48 * 1024) {  // beyond the default limit a kernel must opt in
    const cudaError_t status = cudaFuncSetAttribute(tiled_attention_kernel<Rows, kPerLane>,
                                                    cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                    static_cast<int>(shared_bytes));
    if (status != cudaSuccess) return status;
  }
  const dim3 grid(static_cast<unsigned>((n + kQueryTile - 1) / kQueryTile),
                  static_cast<unsigned>(H), static_cast<unsigned>(B));
  INFINIGEN_LAUNCH(grid, kTileThreads, shared_bytes, stream, tiled_attention_kernel<Rows, kPerLane>)
  (q, out, n, H, H_kv, d, rows);
  return cudaGetLastError();
}

template <typename Rows>
int launch_tiled(const float* q, float* out, int64_t B, int64_t n, int64_t H, int64_t H_kv,
                 int64_t d, const Rows& rows, cudaStream_t stream) {
  switch (values_per_lane(d)) {
    case 1:
      return launch_tiled<1>(q, out, B, n, H, H_kv, d, rows, stream);
    case 2:
      return launch_tiled<2>(q, out, B, n, H, H_kv, d, rows, stream);
    case 4:
      return launch_tiled<4>(q, out, B, n, H, H_kv, d, rows, stream);
    case 8:
      return launch_tiled<8>(q, out, B, n, H, H_kv, d, rows, stream);
    default:
      return cudaErrorInvalidValue;
  }
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
  return launch_tiled(q, out, B, n, H, H_kv, d, PromptRows{k, v, n, H_kv, d, first_valid},
                      detail::as_stream(stream));
}

int attention_decode(const float* q, const void* k_cache, const void* v_cache, Element cache_type,
                     float* out, int64_t B, int64_t n, int64_t H, int64_t H_kv, int64_t d,
                     int64_t capacity, int64_t length, const int32_t* first_valid,
                     const int32_t* prefix_begin, const int32_t* prefix_source, int64_t prefix_end,
                     void* stream) {
  if (B <= 0 || n <= 0 || H <= 0 || d <= 0) return cudaSuccess;
  if (H_kv <= 0 || H % H_kv != 0) return cudaErrorInvalidValue;
  const bool tiled = n >= kTiledExtensionRows;
  if (!(tiled ? grid_fits((n + kQueryTile - 1) / kQueryTile, H, B) : grid_fits(H, B, n))) {
    return cudaErrorInvalidValue;
  }
  if (n > length || length > capacity) return cudaErrorInvalidValue;
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
    if (tiled) {
      const CacheRows<T> rows{keys,      values, n,           H_kv,         d,
                              capacity,  length, first_valid, prefix_begin, prefix_source,
                              prefix_end};
      return launch_tiled(q, out, B, n, H, H_kv, d, rows, s);
    }
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
