// kernels/cuda: multi-head attention for prefill (causal, left padding, tiled) and decode over
// a KV cache, plus the store of new K/V rows into the cache.
#pragma once

#include <cstdint>

#include "kernels/cuda/element_type.h"

namespace infinigen::kernels::cuda {

// Largest head size the attention kernels take (each lane of a warp holds d / 32 values).
inline constexpr int64_t kMaxHeadDim = 256;

// q, out: (B, n, H, d) fp32, q already scaled by 1/sqrt(d); k, v: (B, n, H_kv, d), H_kv
// dividing H, query head h reading KV head h / (H / H_kv). Causal. In sequence b the tokens
// before first_valid[b] are left padding: never attended to, and their rows of `out` are zero.
// first_valid (B) is an int32 device array. Tiled with an online softmax: no (n, n) score
// matrix exists anywhere. d <= kMaxHeadDim.
int attention_prefill(const float* q, const float* k, const float* v, float* out, int64_t B,
                      int64_t n, int64_t H, int64_t H_kv, int64_t d, const int32_t* first_valid,
                      void* stream);

// Attention of n new rows per sequence over a KV cache that holds them already: a decode step
// (n = 1) or an extension of stored tokens by n (causal). q, out: (B, n, H, d) fp32, q scaled;
// k_cache, v_cache: (B, H_kv, capacity, d) of `cache_type`, query head h reading KV head
// h / (H / H_kv). Query i of sequence b is cache row length - n + i: it attends first to rows
// [prefix_begin[b], prefix_end) of sequence prefix_source[b] (a prompt prefix its group shares,
// stored once in the group leader's rows; nothing when prefix_end is 0, and the arrays may then
// be null), then to its own rows [first_valid[b], length - n + i + 1), first_valid[b] >=
// prefix_end. A query row before first_valid[b] (padding) gets a zero output. first_valid,
// prefix_begin and prefix_source (B) are int32 device arrays. d <= kMaxHeadDim. An extension by
// 8 rows or more is tiled as the prefill is (each cache row read once per 16 queries); fewer rows
// take one block per row.
int attention_decode(const float* q, const void* k_cache, const void* v_cache, Element cache_type,
                     float* out, int64_t B, int64_t n, int64_t H, int64_t H_kv, int64_t d,
                     int64_t capacity, int64_t length, const int32_t* first_valid,
                     const int32_t* prefix_begin, const int32_t* prefix_source, int64_t prefix_end,
                     void* stream);

// Stores rows src (B, n, H, d) fp32 into cache (B, H, capacity, d) of `cache_type` at tokens
// [offset, offset + n), rounding to nearest even for 16-bit caches.
int cache_store(const float* src, void* cache, Element cache_type, int64_t B, int64_t n, int64_t H,
                int64_t d, int64_t capacity, int64_t offset, void* stream);

}  // namespace infinigen::kernels::cuda
