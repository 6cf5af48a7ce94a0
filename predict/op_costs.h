// predict: what the ops of a decode step cost in FLOPs and bytes, counted alike by the schedule
// and by the profile measurement that times them.
#pragma once

#include <cstddef>
#include <cstdint>

namespace infinigen {

// Linear y (M, N) = x (M, K) w (N, K)^T + b with weights of `weight_bytes` per element.
double linear_flops(int64_t M, int64_t N, int64_t K);
double linear_bytes(int64_t M, int64_t N, int64_t K, size_t weight_bytes);
// Causal prefill attention of B * H heads over n tokens of head size d.
double attention_prefill_flops(int64_t B, int64_t H, int64_t n, int64_t d);
// Decode attention of B * H queries over `rows` KV rows each, KV of kv_bytes per element.
double attention_decode_bytes(int64_t B, int64_t H, int64_t rows, int64_t d, size_t kv_bytes);
double attention_decode_flops(int64_t B, int64_t H, int64_t rows, int64_t d);
// LayerNorm of (rows, D) fp32.
double layer_norm_bytes(int64_t rows, int64_t D);

}  // namespace infinigen
