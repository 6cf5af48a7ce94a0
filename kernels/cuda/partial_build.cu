// kernels/cuda: InfiniGen's prompt-time work. The column sums give a block to each (pass
// sequence, KV head) and a thread to each column, which walks the sequence's rows in token order
// (the CPU's order of additions, into a double); with a skew, the block stages a tile of rows in
// shared memory and each thread skews them against its column of A. The partial keys are one
// thread per written element (a sequential sum over d when skewed, as partial_of); the weight
// gather one thread per 16-byte word.
#include <cstring>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/partial_build.h"

namespace infinigen::kernels::cuda {
namespace {

// ---- column scores ----

constexpr int kScoreTileRows = 8;  // rows skewed per pass over a column of A

// Row m of a block's rows, in the CPU's order: token j0 + m / per_token, then per token the
// group's query heads in order and (with keys) the KV head's key.
struct ScoreRows {
  const float* queries;
  const float* keys;
  int64_t i, g, n, j0, group, per_token, q_width, kv_width, d;

  __device__ const float* row(int64_t m) const {
    const int64_t j = j0 + m / per_token, k = m % per_token;
    return k < group ? queries + (i * n + j) * q_width + (g * group + k) * d
                     : keys + (i * n + j) * kv_width + g * d;
  }
};

// Grid (H_kv, P), blockDim.x >= d (a multiple of the warp size).
__global__ void column_scores_kernel(const float* queries, const float* keys, const float* skew,
                                     const int32_t* sequences, const int32_t* first_valid,
                                     int64_t first_row, int64_t n, int64_t H, int64_t H_kv,
                                     int64_t d, bool with_keys, double* scores) {
  __shared__ float tile[kScoreTileRows * kMaxPartialBuildHeadDim];
  const int64_t g = blockIdx.x, i = blockIdx.y, group = H / H_kv;
  const int64_t per_token = group + (with_keys ? 1 : 0);
  int64_t j0 = first_valid[i] - first_row;
  if (j0 < 0) j0 = 0;
  const int64_t total = j0 < n ? (n - j0) * per_token : 0;
  const ScoreRows rows{queries, keys, i, g, n, j0, group, per_token, H * d, H_kv * d, d};
  const int64_t c = threadIdx.x;
  double* score = scores + (static_cast<int64_t>(sequences[i]) * H_kv + g) * d;
  double sum = c < d ? score[c] : 0.0;
  if (skew == nullptr) {
    if (c < d) {
      for (int64_t m = 0; m < total; ++m) sum += fabsf(rows.row(m)[c]);
    }
  } else {
    const float* a = skew + g * d * d;
    for (int64_t m0 = 0; m0 < total; m0 += kScoreTileRows) {
      const int64_t count = total - m0 < kScoreTileRows ? total - m0 : kScoreTileRows;
      __syncthreads();  // the previous tile is consumed
      for (int64_t e = threadIdx.x; e < count * d; e += blockDim.x) {
        tile[e] = rows.row(m0 + e / d)[e % d];
      }
      __syncthreads();
      if (c < d) {
        // Each row's skewed value of column c: a sequential sum over d, as the CPU's.
        float v[kScoreTileRows];
        for (int t = 0; t < kScoreTileRows; ++t) v[t] = 0.0f;
        for (int64_t e = 0; e < d; ++e) {
          const float w = a[e * d + c];
          for (int t = 0; t < kScoreTileRows; ++t) {
            if (t < count) v[t] += tile[t * d + e] * w;
          }
        }
        for (int t = 0; t < count; ++t) sum += fabsf(v[t]);
      }
    }
  }
  if (c < d) score[c] = sum;
}

// ---- weight rows ----

template <typename W>
__global__ void gather_rows_kernel(const W* src, int64_t words, const int32_t* rows, int64_t count,
                                   W* dst) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count * words;
       i += stride) {
    const int64_t row = i / words, w = i % words;
    dst[i] = src[static_cast<int64_t>(rows[row]) * words + w];
  }
}

// ---- partial keys ----

// PartialLayer::partial_of's column `col` of a key row (d, widened to fp32).
template <typename T>
__device__ float partial_value(const T* key, const float* a, int64_t d, int64_t col) {
  if (a == nullptr) return detail::to_float(key[col]);
  float sum = 0.0f;
  for (int64_t e = 0; e < d; ++e) sum += detail::to_float(key[e]) * a[e * d + col];
  return sum;
}

// One thread per (sequence, KV head, position, partial column), positions [0, past + n).
template <typename P, typename K>
__global__ void prompt_keys_kernel(const float* fresh, int64_t past, int64_t n,
                                   const void* const* pool_blocks, int64_t max_blocks,
                                   int64_t block_tokens, const int32_t* columns, const float* skew,
                                   K* partial_keys, const int32_t* first_valid,
                                   const int32_t* prefix_begin, const int32_t* prefix_source,
                                   int64_t prefix_end, int64_t H_kv, int64_t d, int64_t r,
                                   int64_t capacity, int64_t count) {
  const int64_t T = past + n;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    const int64_t j = i % r, t = (i / r) % T, row = i / (r * T), b = row / H_kv, g = row % H_kv;
    // KvStore::holds_token, and a shared prefix's rows once, through their source's slot.
    const bool in_prefix = prefix_end > 0 && t < prefix_end && t >= prefix_begin[b];
    if (t < first_valid[b] && !in_prefix) continue;
    if (in_prefix && prefix_source[b] != b) continue;
    const float* a = skew != nullptr ? skew + g * d * d : nullptr;
    const int64_t col = columns[g * r + j];
    float value;
    if (t >= past) {
      value = partial_value(fresh + (b * n + t - past) * H_kv * d + g * d, a, d, col);
    } else {
      const P* block = static_cast<const P*>(pool_blocks[b * max_blocks + t / block_tokens]);
      value = partial_value(block + (g * block_tokens + t % block_tokens) * d, a, d, col);
    }
    partial_keys[((b * H_kv + g) * capacity + t) * r + j] = detail::from_float<K>(value);
  }
}

}  // namespace

int partial_column_scores(const float* queries, const float* keys, const float* skew,
                          const int32_t* sequences, const int32_t* first_valid, int64_t first_row,
                          int64_t P, int64_t n, int64_t H, int64_t H_kv, int64_t d,
                          bool with_keys, double* scores, void* stream) {
  if (P <= 0 || n <= 0 || H_kv <= 0) return cudaSuccess;
  if (H <= 0 || H % H_kv != 0 || d <= 0 || d > kMaxPartialBuildHeadDim || H_kv > 0x7fffffff ||
      P > 65535 || first_row < 0) {
    return cudaErrorInvalidValue;
  }
  const int threads = static_cast<int>((d + detail::kWarpSize - 1) / detail::kWarpSize) *
                      detail::kWarpSize;
  const dim3 grid(static_cast<unsigned>(H_kv), static_cast<unsigned>(P));
  INFINIGEN_LAUNCH(grid, threads, 0, detail::as_stream(stream), column_scores_kernel)
  (queries, keys, skew, sequences, first_valid, first_row, n, H, H_kv, d, with_keys, scores);
  return cudaGetLastError();
}

int gather_rows(const void* src, int64_t row_bytes, const int32_t* rows, int64_t count, void* dst,
                void* stream) {
  if (count <= 0 || row_bytes <= 0) return cudaSuccess;
  constexpr int threads = 256;
  const cudaStream_t s = detail::as_stream(stream);
  const bool wide = row_bytes % 16 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0 &&
                    reinterpret_cast<uintptr_t>(dst) % 16 == 0;
  if (wide) {
    const int64_t words = row_bytes / 16;
    INFINIGEN_LAUNCH(detail::grid_stride_blocks(count * words, threads), threads, 0, s,
                     gather_rows_kernel<uint4>)
    (static_cast<const uint4*>(src), words, rows, count, static_cast<uint4*>(dst));
  } else {
    INFINIGEN_LAUNCH(detail::grid_stride_blocks(count * row_bytes, threads), threads, 0, s,
                     gather_rows_kernel<unsigned char>)
    (static_cast<const unsigned char*>(src), row_bytes, rows, count,
     static_cast<unsigned char*>(dst));
  }
  return cudaGetLastError();
}

int prompt_partial_keys(const float* fresh, int64_t past, int64_t n, const void* const* pool_blocks,
                        int64_t max_blocks, int64_t block_tokens, Element pool_type,
                        const int32_t* columns, const float* skew, void* partial_keys,
                        Element key_type, const int32_t* first_valid, const int32_t* prefix_begin,
                        const int32_t* prefix_source, int64_t prefix_end, int64_t B, int64_t H_kv,
                        int64_t d, int64_t r, int64_t capacity, void* stream) {
  if (B <= 0 || H_kv <= 0 || past + n <= 0) return cudaSuccess;
  if (d <= 0 || d > kMaxPartialBuildHeadDim || r <= 0 || r > d || past < 0 || n < 0 ||
      past + n > capacity || prefix_end < 0 || prefix_end > capacity) {
    return cudaErrorInvalidValue;
  }
  if ((past > 0 && (pool_blocks == nullptr || block_tokens <= 0)) ||
      (n > 0 && fresh == nullptr) ||
      (prefix_end > 0 && (prefix_begin == nullptr || prefix_source == nullptr))) {
    return cudaErrorInvalidValue;
  }
  constexpr int threads = 256;
  const int64_t count = B * H_kv * (past + n) * r;
  const cudaStream_t s = detail::as_stream(stream);
  return detail::dispatch_element(past > 0 ? pool_type : Element::F32, [&](auto pool_tag) {
    using P = decltype(pool_tag);
    return detail::dispatch_element(key_type, [&](auto key_tag) {
      using K = decltype(key_tag);
      INFINIGEN_LAUNCH(detail::grid_stride_blocks(count, threads), threads, 0, s,
                       prompt_keys_kernel<P, K>)
      (fresh, past, n, pool_blocks, max_blocks, block_tokens, columns, skew,
       static_cast<K*>(partial_keys), first_valid, prefix_begin, prefix_source, prefix_end, H_kv,
       d, r, capacity, count);
      return static_cast<int>(cudaGetLastError());
    });
  });
}

}  // namespace infinigen::kernels::cuda
