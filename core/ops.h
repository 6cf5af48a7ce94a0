// core: the ops of the transformer on Tensors. Each checks shapes and dtypes, then dispatches
// on the tensors' device to kernels/cpu or kernels/cuda.
//
// In a trace (core/trace.h) each op records its name and sizes (and the dtype named):
//   embed {rows, width}; layer_norm {rows, width}; linear {M, N, K} (weights' dtype);
//   add {elements}; scale {elements}; attention_prefill {B, H, n, d, H_kv};
//   attention_decode {B, H, KV rows read over the batch, d, H_kv} (KV dtype);
//   cache_store {rows, width} (cache dtype); rms_norm {rows, width}; rope {rows, width};
//   silu_mul {elements}.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace infinigen::ops {

// True when every op below has a kernel on `device` (the CPU today; CUDA once its kernels land).
bool device_runs_transformer(Device device);

// out (n, D) = tokens_table[tokens[i]] + positions_table[positions[i]]; without a positions
// table (undefined; positions then unused), out (n, D) = tokens_table[tokens[i]].
void embed(const std::vector<int32_t>& tokens, const std::vector<int32_t>& positions,
           const Tensor& tokens_table, const Tensor& positions_table, Tensor& out);

// y (rows, D) = LayerNorm(x) * gamma + beta; y may be x.
void layer_norm(const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps, Tensor& y);

// y (rows, D) = x / sqrt(mean(x^2) + eps) * gamma (RMSNorm); y may be x.
void rms_norm(const Tensor& x, const Tensor& gamma, float eps, Tensor& y);

// Rotary position embedding of x (rows, heads * d), in place: in each head, channel pairs
// (i, i + d/2) rotated by positions[row] * inv_freq[i]; inv_freq (d/2) fp32 on x's device
// (core/rope.h).
void rope(Tensor& x, const std::vector<int32_t>& positions, const Tensor& inv_freq);

// gate = silu(gate) * up (same shape): SwiGLU's product.
void silu_mul(Tensor& gate, const Tensor& up);

// y (M, N) = x (M, K) . w (N, K)^T + bias (N) [then ReLU]; bias may be undefined.
void linear(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y, bool relu = false);

// y += x (same shape).
void add_inplace(Tensor& y, const Tensor& x);
void scale_inplace(Tensor& y, float factor);

// q, out: (B, n, H, d) viewed as (B * n, H * d); k, v: (B, n, H_kv, d) with H_kv dividing H
// (grouped-query attention; H_kv = H for multi-head); left padding per first_valid (B).
void attention_prefill(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                       int64_t batch, int64_t num_heads, const std::vector<int32_t>& first_valid);

// q, out: (B, H * d); caches (B, H_kv, capacity, d), H_kv dividing H; sequence b attends rows
// [0, shared_rows) of sequence 0 (a prefix the batch shares, stored once) and its own rows
// [first_valid[b], length), first_valid[b] >= shared_rows.
void attention_decode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, Tensor& out,
                      int64_t length, const std::vector<int32_t>& first_valid,
                      int64_t shared_rows = 0);

// Writes rows (B * n, H * d) into cache (B, H, capacity, d) at tokens [offset, offset + n).
void cache_store(const Tensor& rows, Tensor& cache, int64_t offset);

}  // namespace infinigen::ops
