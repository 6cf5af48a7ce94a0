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

// q, out: (B, H, d) fp32, q scaled; k_cache, v_cache: (B, H_kv, capacity, d) of `cache_type`,
// query head h reading KV head h / (H / H_kv). Sequence b attends to cache rows
// [first_valid[b], length) and, when shared_rows > 0, first to rows [0, shared_rows) of
// sequence 0 (a prompt prefix the batch shares, stored once; first_valid[b] >= shared_rows);
// first_valid (B) is an int32 device array. A sequence with no row in those ranges gets a zero
// output. d <= kMaxHeadDim.
int attention_decode(const float* q, const void* k_cache, const void* v_cache, Element cache_type,
                     float* out, int64_t B, int64_t H, int64_t H_kv, int64_t d, int64_t capacity,
                     int64_t length, const int32_t* first_valid, int64_t shared_rows,
                     void* stream);

// Stores rows src (B, n, H, d) fp32 into cache (B, H, capacity, d) of `cache_type` at tokens
// [offset, offset + n), rounding to nearest even for 16-bit caches.
int cache_store(const float* src, void* cache, Element cache_type, int64_t B, int64_t n, int64_t H,
                int64_t d, int64_t capacity, int64_t offset, void* stream);

}  // namespace infinigen::kernels::cuda
