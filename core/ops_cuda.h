// core: the CUDA side of op dispatch, internal to core. core/ops.cc checks an op's arguments,
// records it in the trace, then calls the function of the same name here when the op's tensors
// live on Device::Cuda, with the sizes it derived. core/ops_cuda.cc defines these on
// kernels/cuda, launching on current_cuda_stream() (core/stream.h) with that stream's persistent
// scratch; a build without the CUDA backend links core/ops_no_cuda.cc instead, whose definitions
// throw. Nothing else includes this header.
#pragma once

#include <cstdint>
#include <span>

#include "core/ops.h"
#include "core/shared_prefixes.h"
#include "core/tensor.h"

namespace infinigen::ops::cuda {

// Shapes as in core/ops.h; every tensor is on the device and has been checked.
void embed(std::span<const int32_t> tokens, std::span<const int32_t> positions,
           const Tensor& tokens_table, const Tensor& positions_table, Tensor& out);
// x, y (rows, D)
void layer_norm(const Tensor& x, const Tensor& gamma, const Tensor& beta, float eps, Tensor& y,
                int64_t rows, int64_t D);
void rms_norm(const Tensor& x, const Tensor& gamma, float eps, Tensor& y, int64_t rows, int64_t D);
// x (rows, heads * head_dim)
void rope(Tensor& x, std::span<const int32_t> positions, const Tensor& inv_freq, int64_t rows,
          int64_t heads, int64_t head_dim);
void silu_mul(Tensor& gate, const Tensor& up);
// x (M, K), w (N, K), y (M, N)
void linear(const Tensor& x, const Tensor& w, const Tensor& bias, Tensor& y, bool relu, int64_t M,
            int64_t N, int64_t K);
void add_inplace(Tensor& y, const Tensor& x);
void scale_inplace(Tensor& y, float factor);
// q, out (B * n, H * d); k, v (B * n, H_kv * d)
void attention_prefill(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, int64_t B,
                       int64_t n, int64_t H, int64_t H_kv, int64_t d,
                       std::span<const int32_t> first_valid);
// q, out (B * n, H * d); caches (B, H_kv, capacity, d); `shared` null when nothing is shared.
void attention_decode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, Tensor& out,
                      int64_t B, int64_t n, int64_t H, int64_t H_kv, int64_t d, int64_t capacity,
                      int64_t length, std::span<const int32_t> first_valid,
                      const SharedPrefixes* shared);
// rows (B * n, H * d) into cache (B, H, capacity, d) at tokens [offset, offset + n)
void cache_store(const Tensor& rows, Tensor& cache, int64_t B, int64_t n, int64_t H, int64_t d,
                 int64_t capacity, int64_t offset);
// h2o (core/ops.h): shapes as there, with the sizes derived
void h2o_decode(const Tensor& queries, const Tensor& keys, Tensor& scores, Tensor& tokens,
                Tensor& probs, Tensor& placed, std::span<const int32_t> first_row, int64_t B,
                int64_t H, int64_t H_kv, int64_t d, int64_t rows, int32_t token,
                int32_t recent_start);
void h2o_prefill(const Tensor& queries, const Tensor& keys, const Tensor& values, Tensor& keys_out,
                 Tensor& values_out, Tensor& scores, Tensor& tokens, Tensor& row_stats,
                 Tensor& key_scores, Tensor& kept, std::span<const int32_t> first_valid, int64_t B,
                 int64_t n, int64_t H, int64_t H_kv, int64_t d, int64_t rows, int64_t slots,
                 int64_t recent);
void h2o_store_placed(const Tensor& keys, const Tensor& values, const Tensor& placed,
                      void* pool_keys, void* pool_values, int64_t B, int64_t H_kv, int64_t rows,
                      int64_t row_bytes);

// InfiniGen's speculation (core/ops.h): shapes as there, with the sizes derived
void speculate_logits(const Tensor& query_rows, const PartialTensors& layer,
                      std::span<const int32_t> rope_positions, const Tensor& position_tokens,
                      std::span<const int32_t> first_valid, const SharedPrefixes* shared, int64_t B,
                      int64_t H_kv, int64_t capacity, int64_t used, Tensor& logits);
void select_top(const Tensor& logits, int64_t B, int64_t H_kv, int64_t used, double alpha,
                int64_t max_num_kv, bool batch_mean, SelectionTensors& out);
void append_partial_keys(const Tensor& keys, PartialTensors& layer, int64_t position,
                         const Tensor& positions, const SharedPrefixes* shared, int64_t B,
                         int64_t H_kv, int64_t capacity);

// InfiniGen's prompt-time work (core/ops.h)
void partial_column_scores(const Tensor& queries, const Tensor& keys, const Tensor& skew,
                           int64_t heads, int64_t kv_heads, std::span<const int32_t> sequences,
                           std::span<const int32_t> first_valid, int64_t first_row, bool with_keys,
                           Tensor& scores);
void gather_rows(const Tensor& src, std::span<const int32_t> rows, Tensor& dst);
void prompt_partial_keys(const Tensor& fresh, int64_t past, int64_t n, const PoolKeyBlocks& pool,
                         PartialTensors& layer, std::span<const int32_t> first_valid,
                         const SharedPrefixes* shared, int64_t B, int64_t H_kv, int64_t capacity);

// keys, values (B * n, H * d) into rows [0, n) of dst
void int4_quantize(const Tensor& keys, const Tensor& values, const Int4Rows& dst, int64_t n);
// rows [t0, t1) of src into keys, values (B, H, capacity, d) fp16 from row row0
void int4_dequantize(const Int4Rows& src, int64_t t0, int64_t t1,
                     std::span<const int32_t> first_valid, int64_t row0, Tensor& keys,
                     Tensor& values);

}  // namespace infinigen::ops::cuda
