// kernels/cuda: the `h2o` policy's scores, keep/evict choice and new-row store on the device.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/h2o.h"

namespace infinigen::kernels::cuda {
namespace {

using detail::kFullMask;
using detail::kWarpSize;
using detail::to_float;

constexpr int kThreads = 128;

// `value` as a KV cache of type T stores it.
template <typename T>
__device__ __forceinline__ float rounded(float value) {
  return to_float(detail::from_float<T>(value));
}

// Maximum of `value` over the block (blockDim.x a multiple of the warp size); every thread gets
// it. `partials` holds one value per warp; the leading barrier lets a previous call's readers
// finish first.
__device__ __forceinline__ float block_max(float value, float* partials) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int warps = blockDim.x / kWarpSize;
  value = detail::warp_max(value);
  __syncthreads();
  if (lane == 0) partials[warp] = value;
  __syncthreads();
  return detail::warp_max(lane < warps ? partials[lane] : -INFINITY);
}

// ---- decode ----

// Grid (H_kv, B), kThreads threads. For each query head of the group in turn: warp w computes
// the logits of rows first_row[b] + w, + warps, ... (its lanes split the row's d dims, coalesced,
// and sum by shuffles) into `probs`; then thread t owns rows first_row[b] + t, + kThreads, ...:
// their exponentials after the block's maximum, a block sum of them, and the score updates.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    decode_scores_kernel(const float* q, const T* keys, float* scores, int32_t* tokens,
                         float* probs, const int32_t* first_row, int64_t H, int64_t H_kv, int64_t d,
                         int64_t rows, int32_t token) {
  __shared__ float partials[kThreads / kWarpSize];
  const int64_t h = blockIdx.x, b = blockIdx.y, group = H / H_kv;
  const int64_t base = (b * H_kv + h) * rows;  // (b, h)'s first row in (B, H_kv, rows)
  const int64_t row0 = first_row[b], fresh = rows - 1;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize, warps = kThreads / kWarpSize;
  if (threadIdx.x == 0) {
    scores[base + fresh] = 0.0f;
    tokens[base + fresh] = token;
  }
  for (int64_t g = 0; g < group; ++g) {
    const float* query = q + (b * H + h * group + g) * d;
    float local = -INFINITY;
    for (int64_t r = row0 + warp; r < rows; r += warps) {
      const T* key = keys + (base + r) * d;
      float logit = 0.0f;
      for (int64_t e = lane; e < d; e += kWarpSize) logit = fmaf(query[e], to_float(key[e]), logit);
      logit = detail::warp_sum(logit);
      if (lane == 0) probs[base + r] = logit;
      local = fmaxf(local, logit);
    }
    // The barrier inside block_max also makes every warp's logits visible to every thread.
    const float top = block_max(local, partials);
    float sum = 0.0f;
    for (int64_t r = row0 + threadIdx.x; r < rows; r += blockDim.x) {
      const float p = expf(probs[base + r] - top);
      probs[base + r] = p;
      sum += p;
    }
    const float total = detail::block_sum(sum, partials);
    for (int64_t r = row0 + threadIdx.x; r < rows; r += blockDim.x) {
      scores[base + r] += probs[base + r] / total;
    }
    __syncthreads();  // the next head's warps rewrite `probs`, which other threads read here
  }
}

// Grid (H_kv, B), one warp. The victim is the minimum of (score, token) over the candidates, a
// strict order (tokens differ), so the warp's reduction finds the CPU's sequential choice.
__global__ void __launch_bounds__(kWarpSize)
    place_kernel(float* scores, int32_t* tokens, int32_t* placed, const int32_t* first_row,
                 int64_t H_kv, int64_t rows, int32_t recent_start) {
  const int64_t h = blockIdx.x, b = blockIdx.y;
  const int64_t base = (b * H_kv + h) * rows, fresh = rows - 1;
  const int lane = static_cast<int>(threadIdx.x);
  const int64_t row0 = first_row[b];
  int32_t to = static_cast<int32_t>(row0 - 1);
  if (row0 == 0) {  // full: evict
    float best_score = 0.0f;
    int32_t best_token = 0, best_row = -1;
    for (int64_t r = lane; r < rows; r += kWarpSize) {
      const int32_t t = tokens[base + r];
      if (t >= recent_start) continue;
      const float s = scores[base + r];
      if (best_row < 0 || s < best_score || (s == best_score && t < best_token)) {
        best_score = s;
        best_token = t;
        best_row = static_cast<int32_t>(r);
      }
    }
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
      const float s = __shfl_xor_sync(kFullMask, best_score, offset);
      const int32_t t = __shfl_xor_sync(kFullMask, best_token, offset);
      const int32_t r = __shfl_xor_sync(kFullMask, best_row, offset);
      if (r >= 0 && (best_row < 0 || s < best_score || (s == best_score && t < best_token))) {
        best_score = s;
        best_token = t;
        best_row = r;
      }
    }
    to = best_row;
  }
  if (lane == 0) {
    if (to >= 0) {
      scores[base + to] = scores[base + fresh];
      tokens[base + to] = tokens[base + fresh];
    }
    placed[b * H_kv + h] = to;
  }
}

// ---- prefill ----
//
// Both passes compute the causal logits of one (b, query head) as a small matrix product, a
// (kTile queries) x (kTile keys) tile per step: a block of kSide x kSide threads, thread (ty, tx)
// holding the kPer x kPer logits of queries ty + kSide a and keys tx + kSide c (a, c < kPer) in
// registers, accumulated with FMAs. Queries and keys pass through shared memory kDimChunk dims
// at a time, transposed to [dim][row] with rows padded to kTile + 1 floats: the loads (a warp
// reads 32 consecutive dims of one row, coalesced) and the reads (one dim of kSide consecutive
// keys, and of two queries, broadcast) both hit distinct banks. Tiles are numbered from the
// sequence's first valid token, so padding is never loaded; rows past the last valid token load
// as zeros. The keys are rounded through the KV dtype as they enter shared memory.
//
// Cost at OPT-13B's shape (B 8, H 40, d 128, n 1920), one layer: each pass computes the causal
// half of the (n, n) logits per (b, head), n (n + kTile) / 2 * 2d flops per (b, head): 0.16
// TFLOP a pass, 0.32 for both, and one expf per causal logit in each. Each step of the inner loop
// is 2 kPer shared-memory reads for kPer^2 FMAs, which bounds the tile product at about half of
// the fp32 peak (~30 TFLOP/s on an H100); with the loads, barriers, exponentials and masked
// halves of the diagonal tiles, 10 to 15 TFLOP/s is the expectation: 20 to 30 ms per layer (the
// kernels they replace ran at ~0.4 TFLOP/s, 1.4 s). Global traffic is small beside it: each tile
// step reads a (kTile, d) block of queries and one of keys (64 KiB at d = 128, mostly from L2)
// for 2 kTile^2 d flops.

constexpr int kTile = 64;                    // queries and keys per tile
constexpr int kSide = 16;                    // threads per side of the block
constexpr int kPer = kTile / kSide;          // logits per thread per side
constexpr int kTileThreads = kSide * kSide;  // 256
constexpr int kDimChunk = 32;                // dims per shared-memory pass
constexpr int kRowsPerLoad = kTileThreads / kDimChunk;

// A tile's queries and keys, kDimChunk dims of each: [dim][row], rows padded.
struct TileChunk {
  float q[kDimChunk][kTile + 1];
  float k[kDimChunk][kTile + 1];
};

// logits[a][c] = query row ty + kSide a of `queries` . key row tx + kSide c of `keys` (the key
// rounded through T). Rows are `q_stride` and `k_stride` floats apart; rows at or past `q_count`
// and `k_count` read as zeros. Every thread of the block must call it (it holds barriers).
template <typename T>
__device__ __forceinline__ void tile_logits(const float* queries, int64_t q_stride, int64_t q_count,
                                            const float* keys, int64_t k_stride, int64_t k_count,
                                            int64_t d, TileChunk& chunk,
                                            float (&logits)[kPer][kPer]) {
  const int tid = static_cast<int>(threadIdx.x), tx = tid % kSide, ty = tid / kSide;
  const int e = tid % kDimChunk;
#pragma unroll
  for (int a = 0; a < kPer; ++a) {
#pragma unroll
    for (int c = 0; c < kPer; ++c) logits[a][c] = 0.0f;
  }
  for (int64_t d0 = 0; d0 < d; d0 += kDimChunk) {
    const bool dim_in = d0 + e < d;
    for (int r = tid / kDimChunk; r < kTile; r += kRowsPerLoad) {
      chunk.q[e][r] = dim_in && r < q_count ? queries[r * q_stride + d0 + e] : 0.0f;
      chunk.k[e][r] = dim_in && r < k_count ? rounded<T>(keys[r * k_stride + d0 + e]) : 0.0f;
    }
    __syncthreads();
#pragma unroll 8
    for (int x = 0; x < kDimChunk; ++x) {
      float qx[kPer], kx[kPer];
#pragma unroll
      for (int a = 0; a < kPer; ++a) qx[a] = chunk.q[x][ty + kSide * a];
#pragma unroll
      for (int c = 0; c < kPer; ++c) kx[c] = chunk.k[x][tx + kSide * c];
#pragma unroll
      for (int a = 0; a < kPer; ++a) {
#pragma unroll
        for (int c = 0; c < kPer; ++c) logits[a][c] = fmaf(qx[a], kx[c], logits[a][c]);
      }
    }
    __syncthreads();  // the chunk is overwritten next
  }
}

// Grid (query tiles, H, B), kTileThreads threads: a block owns a tile of valid queries of (b,
// head) and walks the key tiles up to its diagonal. Each thread keeps, per query of its own, an
// online softmax (running maximum and sum of exponentials) over its own keys; the kSide threads
// of a query row (lanes of one half-warp) then merge theirs by shuffles. Writes each valid
// query's maximum logit and sum of exp(logit - maximum). The grid's first blocks take the last
// query tiles, which have the most keys.
template <typename T>
__global__ void __launch_bounds__(kTileThreads)
    prefill_stats_kernel(const float* q, const float* k, float* row_max, float* row_sum,
                         const int32_t* first_valid, int64_t n, int64_t H, int64_t H_kv,
                         int64_t d) {
  __shared__ TileChunk chunk;
  const int64_t head = blockIdx.y, b = blockIdx.z, h = head / (H / H_kv);
  const int64_t start = first_valid[b], valid = n - start;
  const int64_t qt = static_cast<int64_t>(gridDim.x) - 1 - blockIdx.x;
  if (qt * kTile >= valid) return;  // the whole block: no barrier is reached
  const int tx = static_cast<int>(threadIdx.x) % kSide, ty = static_cast<int>(threadIdx.x) / kSide;
  const int64_t q0 = qt * kTile;  // valid queries are numbered from 0 (token start)
  const float* queries = q + ((b * n + start + q0) * H + head) * d;
  float top[kPer], sum[kPer];  // this thread's keys only; (-inf, 0) while it has none
#pragma unroll
  for (int a = 0; a < kPer; ++a) {
    top[a] = -INFINITY;
    sum[a] = 0.0f;
  }
  for (int64_t k0 = 0; k0 <= q0; k0 += kTile) {
    float logits[kPer][kPer];
    tile_logits<T>(queries, H * d, valid - q0, k + ((b * n + start + k0) * H_kv + h) * d, H_kv * d,
                   valid - k0, d, chunk, logits);
#pragma unroll
    for (int a = 0; a < kPer; ++a) {
      const int64_t i = q0 + ty + kSide * a;
      float m = top[a];
#pragma unroll
      for (int c = 0; c < kPer; ++c) {
        if (k0 + tx + kSide * c <= i) m = fmaxf(m, logits[a][c]);
      }
      if (m == -INFINITY) continue;  // none of this thread's keys is visible yet
      float s = sum[a] * expf(top[a] - m);
#pragma unroll
      for (int c = 0; c < kPer; ++c) {
        if (k0 + tx + kSide * c <= i) s += expf(logits[a][c] - m);
      }
      top[a] = m;
      sum[a] = s;
    }
  }
#pragma unroll
  for (int a = 0; a < kPer; ++a) {
    float m = top[a], s = sum[a];
    for (int offset = kSide / 2; offset > 0; offset /= 2) {  // within the half-warp of row a
      const float other_m = __shfl_xor_sync(kFullMask, m, offset);
      const float other_s = __shfl_xor_sync(kFullMask, s, offset);
      const float merged = fmaxf(m, other_m);
      s = (s == 0.0f ? 0.0f : s * expf(m - merged)) +
          (other_s == 0.0f ? 0.0f : other_s * expf(other_m - merged));
      m = merged;
    }
    const int64_t i = q0 + ty + kSide * a;
    if (tx == 0 && i < valid) {
      const int64_t at = (b * H + head) * n + start + i;
      row_max[at] = m;
      row_sum[at] = s;
    }
  }
}

// Grid (key tiles, H_kv, B), kTileThreads threads: a block owns a tile of valid keys of (b, h)
// and walks, for each query head of the group, the query tiles from its diagonal to the last.
// Thread (ty, tx) adds exp(logit - max) / sum of its queries to its kPer keys' partial scores;
// the kSide partials of a key are summed through shared memory at the end.
template <typename T>
__global__ void __launch_bounds__(kTileThreads)
    prefill_key_scores_kernel(const float* q, const float* k, const float* row_max,
                              const float* row_sum, float* key_scores, const int32_t* first_valid,
                              int64_t n, int64_t H, int64_t H_kv, int64_t d) {
  __shared__ TileChunk chunk;
  __shared__ float partial[kSide][kTile];
  const int64_t h = blockIdx.y, b = blockIdx.z, group = H / H_kv;
  const int64_t start = first_valid[b], valid = n - start;
  const int64_t k0 = static_cast<int64_t>(blockIdx.x) * kTile;
  if (k0 >= valid) return;  // the whole block: no barrier is reached
  const int tid = static_cast<int>(threadIdx.x), tx = tid % kSide, ty = tid / kSide;
  const float* keys = k + ((b * n + start + k0) * H_kv + h) * d;
  float score[kPer] = {};
  for (int64_t g = 0; g < group; ++g) {
    const int64_t head = h * group + g;
    const int64_t stats = (b * H + head) * n + start;  // row statistics of valid query 0
    for (int64_t q0 = k0; q0 < valid; q0 += kTile) {
      float logits[kPer][kPer];
      tile_logits<T>(q + ((b * n + start + q0) * H + head) * d, H * d, valid - q0, keys, H_kv * d,
                     valid - k0, d, chunk, logits);
#pragma unroll
      for (int a = 0; a < kPer; ++a) {
        const int64_t i = q0 + ty + kSide * a;
        if (i >= valid) continue;
        const float m = row_max[stats + i], s = row_sum[stats + i];
#pragma unroll
        for (int c = 0; c < kPer; ++c) {
          if (k0 + tx + kSide * c <= i) score[c] += expf(logits[a][c] - m) / s;
        }
      }
    }
  }
#pragma unroll
  for (int c = 0; c < kPer; ++c) partial[ty][tx + kSide * c] = score[c];
  __syncthreads();
  if (tid < kTile && k0 + tid < valid) {
    float total = 0.0f;
    for (int y = 0; y < kSide; ++y) total += partial[y][tid];
    key_scores[(b * H_kv + h) * n + start + k0 + tid] = total;
  }
}

// Key t of (b, h) goes to row `row`: K and V rounded to T, its score and token index.
template <typename T>
__device__ void keep_key(const float* k, const float* v, T* keys_out, T* values_out, float* scores,
                         int32_t* tokens, float score, int64_t b, int64_t h, int64_t t, int64_t row,
                         int64_t n, int64_t H_kv, int64_t d, int64_t rows) {
  const int64_t src = ((b * n + t) * H_kv + h) * d, at = (b * H_kv + h) * rows + row;
  for (int64_t e = 0; e < d; ++e) {
    keys_out[at * d + e] = detail::from_float<T>(k[src + e]);
    values_out[at * d + e] = detail::from_float<T>(v[src + e]);
  }
  scores[at] = score;
  tokens[at] = static_cast<int32_t>(t);
}

// Grid (H_kv, B), kThreads threads. With more valid keys than slots, the older keys (all but the
// `recent` newest) are ranked by (score, index) descending, the CPU's sort order: key j's rank is
// the number of older keys before it, and it is kept when the rank is below slots - recent. Its
// row is then the number of kept keys before it.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    prefill_keep_kernel(const float* key_scores, const float* k, const float* v, T* keys_out,
                        T* values_out, float* scores, int32_t* tokens, int32_t* kept,
                        const int32_t* first_valid, int64_t n, int64_t H_kv, int64_t d,
                        int64_t rows, int64_t slots, int64_t recent) {
  const int64_t h = blockIdx.x, b = blockIdx.y;
  const int64_t start = first_valid[b], valid = n - start;
  const float* score = key_scores + (b * H_kv + h) * n + start;  // by index j = t - start
  if (valid <= slots) {                                          // every valid key is kept
    for (int64_t j = threadIdx.x; j < valid; j += blockDim.x) {
      keep_key(k, v, keys_out, values_out, scores, tokens, score[j], b, h, start + j,
               slots - valid + j, n, H_kv, d, rows);
    }
    return;
  }
  const int64_t older = valid - recent, heavy = slots - recent;
  int32_t* keep = kept + (b * H_kv + h) * n + start;
  for (int64_t j = threadIdx.x; j < older; j += blockDim.x) {
    int64_t rank = 0;
    for (int64_t x = 0; x < older; ++x) {
      rank += score[x] > score[j] || (score[x] == score[j] && x > j) ? 1 : 0;
    }
    keep[j] = rank < heavy ? 1 : 0;
  }
  __syncthreads();
  for (int64_t j = threadIdx.x; j < valid; j += blockDim.x) {
    int64_t row = heavy + j - older;  // a recent key
    if (j < older) {
      if (keep[j] == 0) continue;
      row = 0;
      for (int64_t x = 0; x < j; ++x) row += keep[x];
    }
    keep_key(k, v, keys_out, values_out, scores, tokens, score[j], b, h, start + j, row, n, H_kv, d,
             rows);
  }
}

// ---- the store of the new rows ----

constexpr int kStoreThreads = 256;
constexpr int kStoreBlocks =
    8;  // as the gather kernel's grid: the compute beside it keeps the rest

// Item i of 2 * B * H_kv: K (i even) or V of (b, h) = i / 2. A warp per item.
__global__ void __launch_bounds__(kStoreThreads)
    store_placed_kernel(char* pool_keys, char* pool_values, const char* keys, const char* values,
                        const int32_t* placed, int64_t items, int64_t rows, int64_t row_bytes) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / kWarpSize;
  for (int64_t item = warp; item < items; item += warps) {
    const int64_t head = item / 2;  // b * H_kv + h
    const int32_t row = placed[head];
    if (row < 0) continue;
    const bool is_key = item % 2 == 0;
    const char* from = (is_key ? keys : values) + (head * rows + rows - 1) * row_bytes;
    char* to = (is_key ? pool_keys : pool_values) + (head * (rows - 1) + row) * row_bytes;
    const auto bits = reinterpret_cast<unsigned long long>(from) |
                      reinterpret_cast<unsigned long long>(to) |
                      static_cast<unsigned long long>(row_bytes);
    if ((bits & 15) == 0) {
      const auto* src = reinterpret_cast<const uint4*>(from);
      auto* dst = reinterpret_cast<uint4*>(to);
      for (int64_t w = lane; w < row_bytes / 16; w += kWarpSize) dst[w] = src[w];
    } else {
      for (int64_t c = lane; c < row_bytes; c += kWarpSize) to[c] = from[c];
    }
  }
}

}  // namespace

int h2o_decode(const float* q, const void* keys, Element key_type, float* scores, int32_t* tokens,
               float* probs, int32_t* placed, const int32_t* first_row, int64_t B, int64_t H,
               int64_t H_kv, int64_t d, int64_t rows, int32_t token, int32_t recent_start,
               void* stream) {
  if (B <= 0 || H_kv <= 0) return cudaSuccess;
  if (rows < 2 || H % H_kv != 0 || d <= 0) return cudaErrorInvalidValue;
  const cudaStream_t s = detail::as_stream(stream);
  const dim3 grid(static_cast<unsigned>(H_kv), static_cast<unsigned>(B));
  const int scored = detail::dispatch_element(key_type, [&](auto tag) {
    using T = decltype(tag);
    INFINIGEN_LAUNCH(grid, kThreads, 0, s, decode_scores_kernel<T>)
    (q, static_cast<const T*>(keys), scores, tokens, probs, first_row, H, H_kv, d, rows, token);
    return static_cast<int>(cudaGetLastError());
  });
  if (scored != cudaSuccess) return scored;
  INFINIGEN_LAUNCH(grid, kWarpSize, 0, s, place_kernel)
  (scores, tokens, placed, first_row, H_kv, rows, recent_start);
  return cudaGetLastError();
}

int h2o_prefill(const float* q, const float* k, const float* v, Element kv_type, void* keys_out,
                void* values_out, float* scores, int32_t* tokens, float* row_stats,
                float* key_scores, int32_t* kept, const int32_t* first_valid, int64_t B, int64_t n,
                int64_t H, int64_t H_kv, int64_t d, int64_t rows, int64_t slots, int64_t recent,
                void* stream) {
  if (B <= 0 || n <= 0 || H_kv <= 0) return cudaSuccess;
  if (H % H_kv != 0 || d <= 0 || slots < 1 || slots >= rows || recent < 0 || recent > slots) {
    return cudaErrorInvalidValue;
  }
  const cudaStream_t s = detail::as_stream(stream);
  const auto tiles = static_cast<unsigned>((n + kTile - 1) / kTile);
  float* row_max = row_stats;
  float* row_sum = row_stats + B * H * n;
  return detail::dispatch_element(kv_type, [&](auto tag) {
    using T = decltype(tag);
    INFINIGEN_LAUNCH(dim3(tiles, static_cast<unsigned>(H), static_cast<unsigned>(B)), kTileThreads,
                     0, s, prefill_stats_kernel<T>)
    (q, k, row_max, row_sum, first_valid, n, H, H_kv, d);
    cudaError_t status = cudaGetLastError();
    if (status != cudaSuccess) return static_cast<int>(status);
    INFINIGEN_LAUNCH(dim3(tiles, static_cast<unsigned>(H_kv), static_cast<unsigned>(B)),
                     kTileThreads, 0, s, prefill_key_scores_kernel<T>)
    (q, k, row_max, row_sum, key_scores, first_valid, n, H, H_kv, d);
    status = cudaGetLastError();
    if (status != cudaSuccess) return static_cast<int>(status);
    INFINIGEN_LAUNCH(dim3(static_cast<unsigned>(H_kv), static_cast<unsigned>(B)), kThreads, 0, s,
                     prefill_keep_kernel<T>)
    (key_scores, k, v, static_cast<T*>(keys_out), static_cast<T*>(values_out), scores, tokens, kept,
     first_valid, n, H_kv, d, rows, slots, recent);
    return static_cast<int>(cudaGetLastError());
  });
}

int h2o_store_placed(void* pool_keys, void* pool_values, const void* keys, const void* values,
                     const int32_t* placed, int64_t B, int64_t H_kv, int64_t rows,
                     int64_t row_bytes, void* stream) {
  const int64_t items = 2 * B * H_kv;
  if (items <= 0) return cudaSuccess;
  if (rows < 2 || row_bytes <= 0) return cudaErrorInvalidValue;
  constexpr int64_t per_block = kStoreThreads / kWarpSize;
  const int64_t wanted = (items + per_block - 1) / per_block;
  const auto grid = static_cast<unsigned>(wanted < kStoreBlocks ? wanted : kStoreBlocks);
  INFINIGEN_LAUNCH(grid, kStoreThreads, 0, detail::as_stream(stream), store_placed_kernel)
  (static_cast<char*>(pool_keys), static_cast<char*>(pool_values), static_cast<const char*>(keys),
   static_cast<const char*>(values), placed, items, rows, row_bytes);
  return cudaGetLastError();
}

}  // namespace infinigen::kernels::cuda
