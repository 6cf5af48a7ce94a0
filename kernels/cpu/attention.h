// kernels/cpu: multi-head attention for prefill (causal, left padding) and decode (KV cache).
#pragma once

#include <cstdint>

#include "kernels/cpu/element_type.h"

namespace infinigen::kernels::cpu {

// q, k, v, out: (B, n, H, d) fp32, q already scaled by 1/sqrt(d). Causal. In sequence b the
// tokens before first_valid[b] are left padding: never attended to, and their rows of `out`
// are zero.
void attention_prefill(const float* q, const float* k, const float* v, float* out, int64_t B,
                       int64_t n, int64_t H, int64_t d, const int32_t* first_valid);

// q, out: (B, H, d) fp32, q scaled; k_cache, v_cache: (B, H, capacity, d) of `cache_type`.
// Sequence b attends to cache rows [first_valid[b], length).
void attention_decode(const float* q, const void* k_cache, const void* v_cache, Element cache_type,
                      float* out, int64_t B, int64_t H, int64_t d, int64_t capacity, int64_t length,
                      const int32_t* first_valid);

// Stores rows src (B, n, H, d) fp32 into cache (B, H, capacity, d) at tokens [offset, offset+n).
void cache_store(const float* src, void* cache, Element cache_type, int64_t B, int64_t n, int64_t H,
                 int64_t d, int64_t capacity, int64_t offset);

}  // namespace infinigen::kernels::cpu
