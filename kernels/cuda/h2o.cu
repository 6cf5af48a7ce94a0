// kernels/cuda: the `h2o` policy's scores, keep/evict choice and new-row store on the device.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/h2o.h"

namespace infinigen::kernels::cuda {
namespace {

using detail::kFullMask;
using detail::kWarpSize;
using detail::to_float;

constexpr int kThreads = 128;

// The CPU's dot product (offload/h2o_kv.cc): products rounded on their own, summed in order.
// __fmul_rn and __fadd_rn are never contracted into an FMA, whatever the compiler's defaults.
template <typename T>
__device__ __forceinline__ float dot(const float* q, const T* key, int64_t d) {
  float sum = 0.0f;
  for (int64_t e = 0; e < d; ++e) sum = __fadd_rn(sum, __fmul_rn(q[e], to_float(key[e])));
  return sum;
}

// `value` as a KV cache of type T stores it.
template <typename T>
__device__ __forceinline__ float rounded(float value) {
  return to_float(detail::from_float<T>(value));
}

// The same dot product against an fp32 key rounded through T on the fly (the prefill's keys,
// not yet stored).
template <typename T>
__device__ __forceinline__ float dot_rounded(const float* q, const float* key, int64_t d) {
  float sum = 0.0f;
  for (int64_t e = 0; e < d; ++e) sum = __fadd_rn(sum, __fmul_rn(q[e], rounded<T>(key[e])));
  return sum;
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

// Grid (H_kv, B), kThreads threads. Thread t owns rows first_row[b] + t, + kThreads, ...: it
// computes their logits, exponentials and score updates; thread 0 sums the exponentials in row
// order, as the CPU's softmax does.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    decode_scores_kernel(const float* q, const T* keys, float* scores, int32_t* tokens,
                         float* probs, const int32_t* first_row, int64_t H, int64_t H_kv, int64_t d,
                         int64_t rows, int32_t token) {
  __shared__ float partials[kThreads / kWarpSize];
  __shared__ float total;
  const int64_t h = blockIdx.x, b = blockIdx.y, group = H / H_kv;
  const int64_t base = (b * H_kv + h) * rows;  // (b, h)'s first row in (B, H_kv, rows)
  const int64_t row0 = first_row[b], fresh = rows - 1;
  if (threadIdx.x == 0) {
    scores[base + fresh] = 0.0f;
    tokens[base + fresh] = token;
  }
  __syncthreads();
  for (int64_t g = 0; g < group; ++g) {
    const float* query = q + (b * H + h * group + g) * d;
    float local = -INFINITY;
    for (int64_t r = row0 + threadIdx.x; r < rows; r += blockDim.x) {
      const float logit = dot(query, keys + (base + r) * d, d);
      probs[base + r] = logit;
      local = fmaxf(local, logit);
    }
    const float top = block_max(local, partials);
    for (int64_t r = row0 + threadIdx.x; r < rows; r += blockDim.x) {
      probs[base + r] = expf(probs[base + r] - top);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      float sum = 0.0f;
      for (int64_t r = row0; r < rows; ++r) sum += probs[base + r];
      total = sum;
    }
    __syncthreads();
    for (int64_t r = row0 + threadIdx.x; r < rows; r += blockDim.x) {
      scores[base + r] += probs[base + r] / total;
    }
    __syncthreads();  // `total` and the probabilities are rewritten by the next head
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

// Grid (ceil(n / kThreads), H, B): thread i of (b, head) is query i. A valid query's softmax
// over the valid keys up to itself: its maximum logit, then the sum of the exponentials in key
// order (the logits computed again, identically, rather than stored).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    prefill_stats_kernel(const float* q, const float* k, float* row_max, float* row_sum,
                         const int32_t* first_valid, int64_t n, int64_t H, int64_t H_kv,
                         int64_t d) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t head = blockIdx.y, b = blockIdx.z, group = H / H_kv, h = head / group;
  const int64_t start = first_valid[b];
  if (i >= n || i < start) return;
  const float* query = q + ((b * n + i) * H + head) * d;
  float top = -INFINITY;
  for (int64_t t = start; t <= i; ++t) {
    top = fmaxf(top, dot_rounded<T>(query, k + ((b * n + t) * H_kv + h) * d, d));
  }
  float sum = 0.0f;
  for (int64_t t = start; t <= i; ++t) {
    sum += expf(dot_rounded<T>(query, k + ((b * n + t) * H_kv + h) * d, d) - top);
  }
  const int64_t at = (b * H + head) * n + i;
  row_max[at] = top;
  row_sum[at] = sum;
}

// Grid (ceil(n / kThreads), H_kv, B): thread t of (b, h) is key t. Its score sums, for each query
// head of the group in turn and each valid query i >= t in order, the probability query i gives
// it: the CPU's order of additions.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    prefill_key_scores_kernel(const float* q, const float* k, const float* row_max,
                              const float* row_sum, float* key_scores, const int32_t* first_valid,
                              int64_t n, int64_t H, int64_t H_kv, int64_t d) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t h = blockIdx.y, b = blockIdx.z, group = H / H_kv;
  if (t >= n || t < first_valid[b]) return;
  const float* key = k + ((b * n + t) * H_kv + h) * d;
  float score = 0.0f;
  for (int64_t g = 0; g < group; ++g) {
    const int64_t head = h * group + g;
    for (int64_t i = t; i < n; ++i) {
      const int64_t at = (b * H + head) * n + i;
      const float logit = dot_rounded<T>(q + ((b * n + i) * H + head) * d, key, d);
      score += expf(logit - row_max[at]) / row_sum[at];
    }
  }
  key_scores[(b * H_kv + h) * n + t] = score;
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
  const auto tiles = static_cast<unsigned>((n + kThreads - 1) / kThreads);
  float* row_max = row_stats;
  float* row_sum = row_stats + B * H * n;
  return detail::dispatch_element(kv_type, [&](auto tag) {
    using T = decltype(tag);
    INFINIGEN_LAUNCH(dim3(tiles, static_cast<unsigned>(H), static_cast<unsigned>(B)), kThreads, 0,
                     s, prefill_stats_kernel<T>)
    (q, k, row_max, row_sum, first_valid, n, H, H_kv, d);
    cudaError_t status = cudaGetLastError();
    if (status != cudaSuccess) return static_cast<int>(status);
    INFINIGEN_LAUNCH(dim3(tiles, static_cast<unsigned>(H_kv), static_cast<unsigned>(B)), kThreads,
                     0, s, prefill_key_scores_kernel<T>)
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
