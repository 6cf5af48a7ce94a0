// kernels/cuda: InfiniGen's prompt-time work on the device, the twin of PartialLayer's
// begin_prompt / accumulate / choose_columns and the prompt's partial keys
// (speculate/speculation.h): the column rule's sums over a pass's queries and keys, the partial
// query weights gathered from W_q, and every prompt token's partial key written into the partial
// key cache that the decode-time kernels (kernels/cuda/speculation.h) read.
//
// Every array is on the device (or mapped pinned host memory where said); sizes are explicit; the
// stream is a cudaStream_t as void* (null: the legacy default stream); the result is 0 on
// success, else a cudaError_t (docs/cuda.md).
#pragma once

#include <cstdint>

#include "kernels/cuda/element_type.h"

namespace infinigen::kernels::cuda {

// PartialLayer::accumulate: adds the column rule's sums over a pass's rows to each sequence's own.
//
//   queries (P * n, H * d) fp32, keys (P * n, H_kv * d) fp32 (unread without with_keys): the
//           pass's rows as attention uses them; row j of the pass's sequence i is token
//           first_row + j of sequence sequences[i], a token when it is >= first_valid[i].
//   skew    (H_kv, d, d) fp32, row-major A per KV head, or null: the rows are skewed (row A) first.
//   scores  (B, H_kv, d) double, running sums: row sequences[i] gets, per KV head g and column c,
//           |Q~[c]| of the group's query heads, then |K~[c]| when with_keys, token by token.
//
// The CPU's order of additions exactly: one thread per (sequence, KV head, column) adds its
// values in token order (heads in order, then the key) into one double, starting from the sum it
// reads. The skewed values are sequential fp32 sums over d, as partial_of's, which a compiler
// may contract into multiply-adds differently on each side: they can differ by an ulp. d <=
// kMaxPartialBuildHeadDim.
inline constexpr int64_t kMaxPartialBuildHeadDim = 256;
int partial_column_scores(const float* queries, const float* keys, const float* skew,
                          const int32_t* sequences, const int32_t* first_valid, int64_t first_row,
                          int64_t P, int64_t n, int64_t H, int64_t H_kv, int64_t d,
                          bool with_keys, double* scores, void* stream);

// dst row i (row_bytes bytes) = src row rows[i], for i in [0, count): the partial query weights'
// needed rows of W_q, gathered where W_q lives.
int gather_rows(const void* src, int64_t row_bytes, const int32_t* rows, int64_t count, void* dst,
                void* stream);

// The partial keys of a prompt's tokens, written into partial_keys (B, H_kv, capacity, r) of
// key_type (rounded to nearest even), as InfinigenKv::write_prompt_partial_keys writes them with
// PartialLayer::partial_of: position t of (b, g) gets (key A)[columns[g]] (key[columns[g]]
// without a skew) of token t's key row, where
//
//   t in [past, past + n): row (b * n + t - past) of fresh (B * n, H_kv * d) fp32, the last
//                          pass's keys;
//   t in [0, past):        the pool's row, in mapped pinned host memory: block
//                          pool_blocks[b * max_blocks + t / block_tokens] (H_kv, block_tokens, d)
//                          of pool_type, row (g, t % block_tokens), widened to fp32.
//
// Only positions that hold a token of b are written (t >= first_valid[b], or in b's shared
// prefix, rows [prefix_begin[b], prefix_end)), and a prefix's once, by its source sequence
// (prefix_source[b] == b, whose slot the others read); the others are left as they are.
// prefix_end 0: nothing shared, and the prefix arrays may be null. d <= kMaxPartialBuildHeadDim,
// r <= d.
int prompt_partial_keys(const float* fresh, int64_t past, int64_t n, const void* const* pool_blocks,
                        int64_t max_blocks, int64_t block_tokens, Element pool_type,
                        const int32_t* columns, const float* skew, void* partial_keys,
                        Element key_type, const int32_t* first_valid, const int32_t* prefix_begin,
                        const int32_t* prefix_source, int64_t prefix_end, int64_t B, int64_t H_kv,
                        int64_t d, int64_t r, int64_t capacity, void* stream);

}  // namespace infinigen::kernels::cuda
