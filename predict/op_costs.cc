// predict: FLOP and byte counts of the ops.
#include "predict/op_costs.h"

namespace infinigen {

double linear_flops(int64_t M, int64_t N, int64_t K) {
  return 2.0 * static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K);
}

double linear_bytes(int64_t M, int64_t N, int64_t K, size_t weight_bytes) {
  // Weights once, fp32 activations in and out.
  return static_cast<double>(N) * static_cast<double>(K) * static_cast<double>(weight_bytes) +
         4.0 * static_cast<double>(M) * static_cast<double>(K + N);
}

double attention_prefill_flops(int64_t B, int64_t H, int64_t n, int64_t d) {
  // Causal: n (n + 1) / 2 visible (query, key) pairs, each a d-long dot for the score and a
  // d-long multiply-add for the output.
  const double pairs = static_cast<double>(n) * static_cast<double>(n + 1) / 2.0;
  return 4.0 * static_cast<double>(B * H) * pairs * static_cast<double>(d);
}

double attention_decode_bytes(int64_t B, int64_t H, int64_t rows, int64_t d, size_t kv_bytes) {
  return 2.0 * static_cast<double>(B * H) * static_cast<double>(rows) * static_cast<double>(d) *
         static_cast<double>(kv_bytes);
}

double attention_decode_flops(int64_t B, int64_t H, int64_t rows, int64_t d) {
  return 4.0 * static_cast<double>(B * H) * static_cast<double>(rows) * static_cast<double>(d);
}

double layer_norm_bytes(int64_t rows, int64_t D) {
  return 8.0 * static_cast<double>(rows) * static_cast<double>(D);  // fp32 in and out
}

}  // namespace infinigen
