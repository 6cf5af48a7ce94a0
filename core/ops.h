// core: the ops of the transformer on Tensors. Each checks shapes and dtypes, then dispatches
// on the tensors' device to kernels/cpu or, through core/ops_cuda.cc, to kernels/cuda. A CUDA op
// launches on the calling thread's current CUDA stream (core/stream.h, current_cuda_stream) and
// allocates nothing: host index arrays reach the device through a persistent upload ring and
// 16-bit GEMMs use a persistent scratch, both per stream (reserve_cuda_scratch below).
//
// In a trace (core/trace.h) each op records its name and sizes (and the dtype named):
//   embed {rows, width}; layer_norm {rows, width}; linear {M, N, K} (weights' dtype);
//   add {elements}; scale {elements}; attention_prefill {B, H, n, d, H_kv};
//   attention_decode {B, H, KV rows read over the batch, d, H_kv} (KV dtype; one new row each);
//   attention_extend {H, H_kv, (query, row) pairs over the batch, KV rows read over the batch,
//   d} (KV dtype; n > 1 new rows each);
//   cache_store {rows, width} (cache dtype); rms_norm {rows, width}; rope {rows, width};
//   silu_mul {elements}; int4_quantize {rows coded, K and V over the batch, d};
//   int4_dequantize {rows decoded, K and V over the batch (left padding left out), d}.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/shared_prefixes.h"
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

// Attention of n new rows per sequence over caches that hold them already (a decode step: n = 1;
// an extension of stored tokens: n > 1, causal). q, out: (B * n, H * d); caches (B, H_kv,
// capacity, d), H_kv dividing H. Row i of sequence b is cache row length - n + i; it attends to
// its shared prefix's rows, [shared->begin(b), shared->rows()) of sequence shared->source(b)
// (none when `shared` is null or empty), then to its own rows [first_valid[b], length - n + i + 1);
// a row before first_valid[b] (padding) gets zeros.
void attention_decode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, Tensor& out,
                      int64_t length, const std::vector<int32_t>& first_valid,
                      const SharedPrefixes* shared = nullptr);

// Writes rows (B * n, H * d) into cache (B, H, capacity, d) at tokens [offset, offset + n).
void cache_store(const Tensor& rows, Tensor& cache, int64_t offset);

// ---- the `h2o` policy on the device (offload/h2o_kv.h; kernels/cuda/h2o.h) ----
//
// CUDA tensors only: on the CPU backend h2o scores on the host, in offload/h2o_kv.cc, whose
// scores these match within fp32 rounding (kernels/cuda/h2o.h; these refuse CPU tensors). Not
// recorded in a trace: their caller records h2o_prefill_scores and h2o_decode_scores once,
// whichever device scores, so that a trace and its prices (predict/op_costs.cc) are the same for
// both.

// Decode, one layer: adds each query head's softmax over sequence b's kept rows [first_row[b],
// rows - 1) and the new token's row rows - 1 to their scores (the new row first gets token
// `token` and score 0), then places the new token of every (b, h): row first_row[b] - 1 while
// there is room, else the victim (the lowest score among rows whose token is before
// `recent_start`, ties to the smallest token), whose score and token it takes; the row goes to
// placed[b, h]. queries (B, H * d) fp32, scaled; keys (B, H_kv, rows, d) of the KV dtype (the
// layer's staging, the new row stored); scores (B, H_kv, rows) F32 and tokens (same) I32, the
// layer's bookkeeping; probs like scores, scratch; placed (B, H_kv) I32; first_row (B).
void h2o_decode(const Tensor& queries, const Tensor& keys, Tensor& scores, Tensor& tokens,
                Tensor& probs, Tensor& placed, const std::vector<int32_t>& first_row, int32_t token,
                int32_t recent_start);

// Prefill, one layer: scores every valid prompt key (the causal softmax of every valid query of
// its group over the valid keys, rounded through the KV dtype, summed per key), keeps all of a
// sequence's valid keys when they fit in `slots`, else its `recent` newest and the heaviest
// older ones (ties keep the newer), and writes the kept ones, in token order, to rows
// [slots - kept, slots) of each (b, h): K and V into keys_out and values_out (B, H_kv, rows, d)
// of the KV dtype, score and token index into scores and tokens (B, H_kv, rows). queries (B * n,
// H * d), keys and values (B * n, H_kv * d) fp32; scratch: row_stats (2, B, H, n) F32,
// key_scores (B, H_kv, n) F32, kept (B, H_kv, n) I32; first_valid (B).
void h2o_prefill(const Tensor& queries, const Tensor& keys, const Tensor& values, Tensor& keys_out,
                 Tensor& values_out, Tensor& scores, Tensor& tokens, Tensor& row_stats,
                 Tensor& key_scores, Tensor& kept, const std::vector<int32_t>& first_valid,
                 int64_t slots, int64_t recent);

// The store of a decode step's new rows: row rows - 1 of each (b, h) of keys and values (B, H_kv,
// rows, d) to row placed[b, h] of pool_keys and pool_values, mapped pinned host memory (B, H_kv,
// rows - 1, d) of the same dtype, which the kernel writes over the link. A transfer: launch it
// from TransferEngine::store_by_kernel (offload/transfer_engine.h), which makes the store stream
// current; it uploads nothing, so no stream scratch is made for that stream.
void h2o_store_placed(const Tensor& keys, const Tensor& values, const Tensor& placed,
                      void* pool_keys, void* pool_values);

// ---- InfiniGen's speculation on the device (speculate/device_partial.h) ----
//
// CUDA tensors only: on the CPU backend PartialLayer (speculate/speculation.h) speculates on the
// host with the same arithmetic in the same order (kernels/cuda/speculation.h says how close).
// Not recorded in a trace: their caller records `speculate` and `partial_append` once, whichever
// device speculates.

// A speculated layer's state on the device, the twin of a PartialLayer's.
struct PartialTensors {
  Tensor head_rows;    // (H + 1) I32: query head h owns columns [head_rows[h], head_rows[h + 1])
                       // of the query rows
  Tensor needed_dims;  // (M) I32: the query dimension (< d) of each of those columns
  Tensor columns;      // (H_kv, r) I32: each KV head's partial columns
  Tensor skew;         // (H_kv, d, d) F32, A per KV head; undefined: no skew
  Tensor inv_freq;     // (d / 2) F32 rotary frequencies; undefined: no rotation
  Tensor keys;         // (B, H_kv, capacity, r) F32 or F16: the partial key cache
  int64_t heads = 0;   // H
  int64_t head_dim = 0;
};

// The estimated attention logits (B, H_kv, used) of positions [0, used) from the query rows (B, M)
// (x W~^T + b~, the layer's partial query weights applied to the previous layer's attention
// input), each sequence's new token at rope_positions[b]: PartialLayer::estimate_logits.
// position_tokens (B, H_kv, capacity) I32, or undefined (position p holds token p): the token of
// each position (-1: empty). -inf where a position holds padding or nothing.
void speculate_logits(const Tensor& query_rows, const PartialTensors& layer,
                      const std::vector<int32_t>& rope_positions, const Tensor& position_tokens,
                      const std::vector<int32_t>& first_valid, const SharedPrefixes* shared,
                      int64_t used, Tensor& logits);

// A selection made on the device (PartialLayer::select's, with the positions left there).
struct SelectionTensors {
  Tensor counts, valid;  // (B, H_kv) I32: each row's alpha count and valid entries
  Tensor fetch;          // (B) I32: each sequence's n'
  // (2 + B) I32: the mean alpha count over every row (a double in the first 8 bytes), then
  // take (B): the tokens each sequence takes, min(n', its valid entries). What the host reads.
  Tensor summary;
  Tensor tokens;  // (B, H_kv, fetch_cap) I32: each row's take[b] positions, ascending, then 0
};

// The alpha counts, n' (the mean count of each sequence's rows, or of all rows when
// `batch_mean`, clamped to [1, max_num_kv]) and each row's top take[b] positions (ties to the
// lower position) of logits (B, H_kv, used): PartialLayer::select.
void select_top(const Tensor& logits, int64_t used, double alpha, int64_t max_num_kv,
                bool batch_mean, SelectionTensors& out);

// The partial keys of one new token per sequence, keys (B, H_kv * d) fp32 (rotated), written at
// `position` of every (sequence, KV head), or at positions[b * H_kv + g] (B, H_kv) I32 when
// defined (a capped pool): PartialLayer::append.
void append_partial_keys(const Tensor& keys, PartialTensors& layer, int64_t position,
                         const Tensor& positions, const SharedPrefixes* shared);

// ---- InfiniGen's prompt-time work on the device (PartialLayer's, speculate/speculation.h) ----
//
// CUDA tensors only, as the speculation's ops above; on the CPU backend PartialLayer does the same
// on the host (kernels/cuda/partial_build.h says how close). Not recorded in a trace: the caller
// records `partial_build` once, whichever device builds.

// PartialLayer::accumulate: adds the column rule's sums over a pass's rows, queries (P * n, H * d)
// and keys (P * n, H_kv * d) fp32, to rows sequences[i] of scores (B, H_kv * d), I64 storage
// holding doubles (the CPU's sums are doubles; no tensor dtype is). Row j of the pass's sequence
// i is its token first_row + j and counts from first_valid[i]; skew (H_kv, d, d) fp32 or
// undefined; with_keys: the QK rule (|Q~| + |K~|), else |Q~| only.
void partial_column_scores(const Tensor& queries, const Tensor& keys, const Tensor& skew,
                           int64_t heads, const std::vector<int64_t>& sequences,
                           const std::vector<int32_t>& first_valid, int64_t first_row,
                           bool with_keys, Tensor& scores);

// dst (rows.size(), D) = the rows `rows` of src (N, D), on one device (any dtype, the same).
void gather_rows(const Tensor& src, const std::vector<int32_t>& rows, Tensor& dst);

// Where a prompt's earlier passes' keys are: the KV pool's key blocks of a layer, an array in
// mapped pinned memory of (B, max_blocks) block addresses (KvPool::block_addresses), each block
// (H_kv, block_tokens, d) of `dtype`.
struct PoolKeyBlocks {
  const void* const* blocks = nullptr;
  int64_t max_blocks = 0, block_tokens = 0;
  DType dtype = DType::F16;
};

// The partial keys of every prompt token (InfinigenKv::write_prompt_partial_keys): tokens
// [0, past) from `pool`, [past, past + n) from fresh (B * n, H_kv * d) fp32, each written at its
// position of layer.keys when sequence b holds it (first_valid, `shared`), a shared prefix's
// once, into its source's slot.
void prompt_partial_keys(const Tensor& fresh, int64_t past, const PoolKeyBlocks& pool,
                         PartialTensors& layer, const std::vector<int32_t>& first_valid,
                         const SharedPrefixes* shared);

// ---- the int4 KV codec (the `int4` policy, offload/int4_kv.h) ----
//
// FlexGen's group-wise asymmetric 4-bit codes (the arithmetic: kernels/cpu/int4.h; the CUDA
// kernels give the same bytes and values): a row of d values is cut into groups of 64 (one group
// of d when d < 64), each kept as d / 2 bytes of packed nibbles and one fp16 (min, scale) pair
// per group.

// Elements per group (64, or d when d < 64); throws Error for a d the codec cannot cut (odd, or
// above 64 and not a multiple of it).
int64_t int4_group_size(int64_t d);
int64_t int4_groups(int64_t d);  // G = d / int4_group_size(d)
// Bytes of one quantised row: d / 2 codes plus G * (min, scale) in fp16.
size_t int4_code_bytes(int64_t d);
size_t int4_meta_bytes(int64_t d);
size_t int4_row_bytes(int64_t d);

// Quantised rows of one layer, laid out [2][B][H][rows] (K then V; sequence; head; token): row
// ((kind * B + b) * H + h) * rows + t has int4_code_bytes(d) bytes at codes and
// int4_meta_bytes(d) at meta, both arrays on `device` (device memory, or host memory for the CPU).
struct Int4Rows {
  uint8_t* codes = nullptr;
  uint8_t* meta = nullptr;
  Device device = Device::Cpu;
  int64_t batch = 0, heads = 0, rows = 0, head_dim = 0;
};

// Quantises keys and values (B * n, H * d) fp32 into rows [0, n) of `dst` (n <= dst.rows).
void int4_quantize(const Tensor& keys, const Tensor& values, const Int4Rows& dst);

// Dequantises rows [t0, t1) of `src` into keys and values (B, H, capacity, d) fp16, row t to row
// row0 + t - t0. Rows of sequence b that land before first_valid[b] (left padding, which
// attention never reads) are not written.
void int4_dequantize(const Int4Rows& src, int64_t t0, int64_t t1,
                     const std::vector<int32_t>& first_valid, int64_t row0, Tensor& keys,
                     Tensor& values);

// ---- the CUDA ops' scratch (core/ops_cuda.cc) ----
//
// Each CUDA stream that ops run on gets, at its first op, two buffers that later ops reuse:
// - the upload ring, a pinned host ring and a device ring of the same size through which host
//   index arrays (token ids, positions, first_valid, shared-prefix rows) reach the kernels, one
//   async copy per op; 64 KiB at first, doubled (or more) when an op's arrays do not fit;
// - the GEMM scratch, device memory into which `linear` rounds its input for 16-bit weights,
//   cuda_linear_scratch_bytes of the largest such input so far.
// Growing either synchronises the stream and reallocates: the first prefill grows them unless
// they were reserved.

// Device bytes of GEMM scratch `linear` needs for an input of `rows` x `K` on CUDA with weights
// of `weights`: the input rounded to their 16-bit type, 0 for fp32 weights. The memory planner's
// device_scratch (offload/memory_planner.cc) counts it for the widest prefill input.
size_t cuda_linear_scratch_bytes(int64_t rows, int64_t K, DType weights);

// Makes the scratch of the current CUDA stream (current_cuda_stream) at least this large now, so
// that no op on it allocates later: `index_bytes` for the upload ring (at least the largest host
// index arrays of one op, 8 * B * n for a prefill's embed, which also bounds how far the host runs
// ahead of the device in uploads before it waits), `gemm_bytes` for the GEMM scratch
// (cuda_linear_scratch_bytes of the widest prefill input). Throws without the CUDA backend.
void reserve_cuda_scratch(size_t index_bytes, size_t gemm_bytes);

// Waits for `stream` (a cudaStream_t; null: the legacy default stream) and frees its scratch.
// The owner of a stream calls it before destroying the stream, once no op runs on it any more
// (a later op on a stream of the same handle would otherwise inherit the scratch). Does nothing
// when the stream has no scratch or the CUDA backend is not compiled.
void release_cuda_scratch(void* stream);

struct CudaScratchStats {
  size_t upload_bytes = 0;     // size of the upload ring (pinned, and as much again on the device)
  size_t gemm_bytes = 0;       // size of the GEMM scratch
  const void* gemm = nullptr;  // the GEMM scratch (device memory), null while there is none
  int64_t uploads = 0;         // op uploads through the ring
  int64_t wraps = 0;           // times the ring came round to its start
  int64_t host_waits = 0;      // uploads that waited for the device to finish copying a part
  int64_t grows = 0;           // reallocations of either buffer (the first allocations included)
};
// The scratch of `stream` (all zero when it has none).
CudaScratchStats cuda_scratch_stats(void* stream);

}  // namespace infinigen::ops
