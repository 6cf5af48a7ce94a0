// kernels/cpu: multi-head attention for prefill (causal, left padding) and over a KV cache
// (decode steps and extensions).
#pragma once

#include <cstdint>

#include "kernels/cpu/element_type.h"

namespace infinigen::kernels::cpu {

// q, out: (B, n, H, d) fp32, q already scaled by 1/sqrt(d); k, v: (B, n, H_kv, d), H_kv
// dividing H: query head h reads KV head h / (H / H_kv) (grouped-query attention; H_kv = H is
// multi-head attention). Causal. In sequence b the tokens before first_valid[b] are left
// padding: never attended to, and their rows of `out` are zero.
void attention_prefill(const float* q, const float* k, const float* v, float* out, int64_t B,
                       int64_t n, int64_t H, int64_t H_kv, int64_t d, const int32_t* first_valid);

// Attention of n new rows per sequence over a KV cache that holds them already: a decode step
// (n = 1) or an extension of stored tokens by n (causal). q, out: (B, n, H, d) fp32, q scaled;
// k_cache, v_cache: (B, H_kv, capacity, d) of `cache_type`, query head h reading KV head
// h / (H / H_kv). Query i of sequence b is cache row length - n + i: it attends first to rows
// [prefix_begin[b], prefix_end) of sequence prefix_source[b] (a prompt prefix its group shares,
// stored once in the group leader's rows; nothing when prefix_end is 0, and the arrays may then
// be null), then to its own rows [first_valid[b], length - n + i + 1), first_valid[b] >=
// prefix_end. A query row before first_valid[b] (padding) gets a zero output. With at most 64
// queries per KV head (H / H_kv * n: decode steps), each KV head's rows are widened 64 at a time
// and read once for all its query heads, long sequences split over threads; with more (long
// extensions), each (sequence, head) widens all its rows once for its n queries.
void attention_decode(const float* q, const void* k_cache, const void* v_cache, Element cache_type,
                      float* out, int64_t B, int64_t n, int64_t H, int64_t H_kv, int64_t d,
                      int64_t capacity, int64_t length, const int32_t* first_valid,
                      const int32_t* prefix_begin = nullptr, const int32_t* prefix_source = nullptr,
                      int64_t prefix_end = 0);

// Stores rows src (B, n, H, d) fp32 into cache (B, H, capacity, d) at tokens [offset, offset+n).
void cache_store(const float* src, void* cache, Element cache_type, int64_t B, int64_t n, int64_t H,
                 int64_t d, int64_t capacity, int64_t offset);

}  // namespace infinigen::kernels::cpu
