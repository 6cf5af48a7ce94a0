// predict: FLOP and byte counts of the ops.
#include "predict/op_costs.h"

#include <cstring>
#include <functional>
#include <string_view>
#include <utility>

#include "core/error.h"

namespace infinigen {
namespace {

double f(int64_t v) {
  return static_cast<double>(v);
}

OpWork elementwise(double bytes) {
  return {OpClass::Elementwise, 0, bytes, 0, 0, 0, 0};
}

// Each op's work from its sizes `s` and element type size `e` (core/trace.h: what each records).
using Pricing = std::function<OpWork(const std::array<int64_t, 5>& s, double e, DType dtype)>;
const std::pair<std::string_view, Pricing> kPrices[] = {
    // core/ops.h
    {"embed", [](auto& s, double, DType) { return elementwise(12 * f(s[0] * s[1])); }},
    {"layer_norm",
     [](auto& s, double, DType) { return elementwise(layer_norm_bytes(s[0], s[1])); }},
    {"rms_norm", [](auto& s, double, DType) { return elementwise(layer_norm_bytes(s[0], s[1])); }},
    {"rope", [](auto& s, double, DType) { return elementwise(8 * f(s[0] * s[1])); }},
    {"silu_mul", [](auto& s, double, DType) { return elementwise(12 * f(s[0])); }},
    {"add", [](auto& s, double, DType) { return elementwise(12 * f(s[0])); }},
    {"scale", [](auto& s, double, DType) { return elementwise(8 * f(s[0])); }},
    {"cache_store",  // fp32 rows in, rows of the cache's type out
     [](auto& s, double e, DType) { return elementwise(f(s[0] * s[1]) * (4 + e)); }},
    {"linear",
     [](auto& s, double, DType dtype) {
       const size_t w = dtype_size(dtype);
       return OpWork{OpClass::Gemm,
                     linear_flops(s[0], s[1], s[2]),
                     linear_bytes(s[0], s[1], s[2], w),
                     s[0],
                     s[1],
                     s[2],
                     f(s[1] * s[2]) * f(w)};
     }},
    {"attention_prefill",  // q, k, v and the output, fp32
     [](auto& s, double, DType) {
       return OpWork{OpClass::AttentionPrefill,
                     attention_prefill_flops(s[0], s[1], s[2], s[3]),
                     16 * f(s[0] * s[2] * s[1] * s[3]),
                     0,
                     0,
                     0,
                     0};
     }},
    {"attention_decode",  // s[2]: KV rows read over the batch; K and V of H_kv heads
     [](auto& s, double e, DType) {
       return OpWork{OpClass::AttentionDecode,
                     4 * f(s[1] * s[2] * s[3]),
                     2 * f(s[4] * s[2] * s[3]) * e,
                     0,
                     0,
                     0,
                     0};
     }},
    // An extension's attention over the cache: s = {H, H_kv, (query, row) pairs scored over the
    // batch, KV rows read over the batch, d}; each (sequence, KV head)'s rows read once for all
    // of its new rows, as the CPU kernel widens them once (the CUDA kernel reads them once per
    // tile of 16 new rows and query head, mostly from L2: on a GPU a little optimistic).
    {"attention_extend",
     [](auto& s, double e, DType) {
       return OpWork{OpClass::AttentionDecode,
                     4 * f(s[0] * s[2] * s[4]),
                     2 * f(s[1] * s[3] * s[4]) * e,
                     0,
                     0,
                     0,
                     0};
     }},
    {"sample", [](auto& s, double, DType) { return elementwise(4 * f(s[0] * s[1])); }},
    // speculate/speculation.h: partial columns, weights and key cache from the prompt
    {"partial_build",
     [](auto& s, double, DType) {
       const double rows = f(s[0] * s[2]);
       return elementwise(8 * rows * f(s[4]) + 4 * rows * f(s[1] * s[3]) +
                          4 * f(s[1] * s[3] * s[4]));
     }},
    // The estimated logits over every stored position's partial key, and top-k: each key of
    // {B, H_kv, positions, r} read once, dotted with each of the H query heads of its group.
    {"speculate",
     [](auto& s, double e, DType) {
       return OpWork{OpClass::Speculation,
                     2 * f(s[0] * s[4] * s[2] * s[3]),
                     e * f(s[0] * s[1] * s[2] * s[3]),
                     0,
                     0,
                     0,
                     0};
     }},
    // offload/session.h: a resumed session's history rows copied into the pool, s[0] bytes
    {"session_restore",
     [](auto& s, double, DType) { return OpWork{OpClass::HostCopy, 0, f(s[0]), 0, 0, 0, 0}; }},
    // offload/row_cache.h: s[0] rows of s[1] x s[2] values read and written on the device
    {"row_cache_copy",
     [](auto& s, double e, DType) { return elementwise(2 * f(s[0] * s[1] * s[2]) * e); }},
    {"partial_append",
     [](auto& s, double, DType) { return elementwise(8 * f(s[0] * s[1] * s[2])); }},
    // offload/h2o_kv.h: a d-long dot and an exp per (query, key) pair scored
    {"h2o_prefill_scores",
     [](auto& s, double, DType) {
       const double pairs = f(s[2]) * f(s[2] + 1) / 2;
       return OpWork{OpClass::Scoring, f(s[0] * s[1]) * pairs * f(2 * s[3] + 4), 0, 0, 0, 0, 0};
     }},
    // A resumed turn's extension, H2O's and a capped InfiniGen pool's: s[0] query heads, s[1]
    // (query, entry) pairs per head, d = s[2]
    {"extension_scores",
     [](auto& s, double, DType) {
       return OpWork{OpClass::Scoring, f(s[0] * s[1]) * f(2 * s[2] + 4), 0, 0, 0, 0, 0};
     }},
    {"h2o_decode_scores",  // s[2]: entries scored per head, over the batch
     [](auto& s, double, DType) {
       return OpWork{OpClass::Scoring, f(s[1] * s[2]) * f(2 * s[3] + 6), 0, 0, 0, 0, 0};
     }},
    // offload/int4_kv.h: rows of d values through the codec
    {"int4_quantize",
     [](auto& s, double, DType) {
       return OpWork{OpClass::Codec, 0, 2 * f(s[0] * s[1]), 0, 0, 0, 0};
     }},
    {"int4_dequantize",
     [](auto& s, double, DType) {
       return OpWork{OpClass::Codec, 0, 2 * f(s[0] * s[1]), 0, 0, 0, 0};
     }},
};

}  // namespace

OpWork op_work(const TracedOp& op) {
  for (const auto& [name, price] : kPrices) {
    if (name == op.name) {
      return price(op.sizes, static_cast<double>(dtype_size(op.dtype)), op.dtype);
    }
  }
  fail("cost model: no cost for op '", op.name, "' (predict/op_costs.cc prices every traced op)");
}

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
