// kernels/cpu: multi-head attention for prefill (causal, left padding) and decode (KV cache).
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

// q, out: (B, H, d) fp32, q scaled; k_cache, v_cache: (B, H_kv, capacity, d) of `cache_type`,
// query head h reading KV head h / (H / H_kv). Sequence b attends to cache rows
// [first_valid[b], length), and, when shared_rows > 0, first to rows [0, shared_rows) of
// sequence 0: a prompt prefix the batch shares, stored once (first_valid[b] >= shared_rows; the
// rows [0, shared_rows) of the other sequences are never read).
void attention_decode(const float* q, const void* k_cache, const void* v_cache, Element cache_type,
                      float* out, int64_t B, int64_t H, int64_t H_kv, int64_t d, int64_t capacity,
                      int64_t length, const int32_t* first_valid, int64_t shared_rows = 0);

// Stores rows src (B, n, H, d) fp32 into cache (B, H, capacity, d) at tokens [offset, offset+n).
void cache_store(const float* src, void* cache, Element cache_type, int64_t B, int64_t n, int64_t H,
                 int64_t d, int64_t capacity, int64_t offset);

}  // namespace infinigen::kernels::cpu
