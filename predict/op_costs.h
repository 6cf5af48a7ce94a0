// predict: what each op of a trace (core/trace.h) costs in FLOPs and bytes, and which rates of a
// hardware profile it runs at. Counted alike here and by the profile measurement that times the
// ops, so that the rates it measures price the same counts.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/trace.h"

namespace infinigen {

// Which rates of the profile an op runs at (predict/hardware_profile.h).
enum class OpClass {
  Gemm,              // linear_table where the profile has one, else gemm_flops and
                     // device_memory_bytes_per_s
  AttentionPrefill,  // attention_flops, device_memory_bytes_per_s
  AttentionDecode,   // attention_flops, attention_bytes_per_s
  Elementwise,       // elementwise_bytes_per_s
  Codec,             // kv_codec_bytes_per_s
  Speculation,       // speculation_flops, speculation_bytes_per_s
  Scoring,           // scoring_flops
  Transfer,          // the link (and the host copy on the CPU backend)
  Gather,            // host threads gathering rows into pinned staging (cuda backend)
  DiskRead,          // disk_read_bytes_per_s: a session's history (lane disk)
  HostCopy,          // host_copy_bytes_per_s: the host thread copying, e.g. a session's rows
};

// The work of one compute op: its class, FLOPs and bytes through device memory, and for a GEMM
// y (M, N) = x (M, K) w (N, K)^T its shape and weight bytes (a linear table prices it by shape).
struct OpWork {
  OpClass op_class = OpClass::Elementwise;
  double flops = 0;
  double bytes = 0;
  int64_t rows = 0, out_features = 0, in_features = 0;
  double weight_bytes = 0;
};

// The work of a traced compute op, by its name and sizes (core/ops.h, speculate/speculation.h,
// the policies of offload/). An op with no entry here is an Error: every op a run records must
// be priced.
OpWork op_work(const TracedOp& op);

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
