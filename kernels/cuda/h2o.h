// kernels/cuda: the `h2o` policy on the device (offload/h2o_kv.h): accumulated attention scores,
// the keep/evict choice and the store of the new token to its pool row.
//
// The scores are the CPU's (offload/h2o_kv.cc) up to fp32 rounding, not bit for bit: the logits
// are tiled products with FMAs (the prefill) or warp sums (decode), softmax sums are parallel
// reductions (the prefill's an online softmax), and a key's probabilities are added in another
// order. Scores agree within a relative 1e-5 or so (tests allow a few times that); the keys are
// read, or rounded, as the KV dtype stores them, as on the CPU. The keep and evict choices are
// exact functions of the scores (the CPU's orders, ties included), so the kept sets are the
// CPU's except where two scores at the boundary are within that rounding of each other (a
// near-tie), and exact ties the inputs force (probabilities that underflow to 0 on both) stay
// ties.
#pragma once

#include <cstdint>

#include "kernels/cuda/element_type.h"

namespace infinigen::kernels::cuda {

// Decode, one layer: scores each (b, h)'s kept rows and the new one, then places the new one.
//
// q: (B, H, d) fp32, scaled by 1/sqrt(d); keys: (B, H_kv, rows, d) of `key_type` (the layer's
// staging), sequence b's kept rows in [first_row[b], rows - 1) and the new token in row rows - 1;
// query head i reads KV head i / (H / H_kv). scores (B, H_kv, rows) fp32 and tokens (B, H_kv,
// rows) int32 are the layer's bookkeeping (accumulated attention probability and token index of
// each row); probs (B, H_kv, rows) fp32 is scratch.
//
// Scoring (one block per (b, h)): row rows - 1 gets token `token` and score 0; then, for each
// query head of the group in turn, the softmax of its logits over rows [first_row[b], rows) is
// added to their scores (a warp per row's logit, block reductions for the maximum and the sum).
// Placing (one warp per (b, h)): the new token's row is first_row[b] - 1 while there is room
// (first_row[b] > 0), else the victim's: the lowest score among rows [0, rows) whose token is
// older than `recent_start`, ties to the smallest token (offload/h2o_kv.h, h2o_choose_victim;
// -1 if there is none, which a budget of at least two rows never leaves). The new row's score
// and token move there, and the row goes to placed[b * H_kv + h] (int32, device).
// first_row (B) is an int32 device array.
int h2o_decode(const float* q, const void* keys, Element key_type, float* scores, int32_t* tokens,
               float* probs, int32_t* placed, const int32_t* first_row, int64_t B, int64_t H,
               int64_t H_kv, int64_t d, int64_t rows, int32_t token, int32_t recent_start,
               void* stream);

// Prefill, one layer: scores every valid prompt key and keeps `slots` of them per (b, h).
// Two tiled passes (64 x 64 tiles of logits per block, queries and keys through shared memory,
// FMAs): each valid query's causal softmax maximum and sum, then each key's received
// probabilities; about 2 n^2 d flops per (b, query head), none of it serial per row.
//
// q: (B, n, H, d) fp32, scaled; k, v: (B, n, H_kv, d) fp32; sequence b's tokens before
// first_valid[b] (int32 device array, B) are padding. A key's score is the sum, over the group's
// query heads and then over the valid queries at or after it, of the causal softmax
// probability it receives, the keys rounded through `kv_type`. Sequence b keeps all of its
// valid = n - first_valid[b] tokens when valid <= slots; otherwise its `recent` newest and the
// slots - recent older ones of highest score (ties keep the newer). The kept tokens, in token
// order, go to rows [slots - kept, slots) of (b, h): K and V rounded to `kv_type` into
// keys_out and values_out (B, H_kv, rows, d), score and token index into scores and tokens
// (B, H_kv, rows). Other rows are not written.
// Scratch: row_stats (2, B, H, n) fp32 (each query's softmax maximum and sum), key_scores (B,
// H_kv, n) fp32, kept (B, H_kv, n) int32 (the older keys' keep flags).
int h2o_prefill(const float* q, const float* k, const float* v, Element kv_type, void* keys_out,
                void* values_out, float* scores, int32_t* tokens, float* row_stats,
                float* key_scores, int32_t* kept, const int32_t* first_valid, int64_t B, int64_t n,
                int64_t H, int64_t H_kv, int64_t d, int64_t rows, int64_t slots, int64_t recent,
                void* stream);

// The store of a decode step's new rows, a transfer on the store stream: row rows - 1 of each
// (b, h) of keys and values (B, H_kv, rows, d; row_bytes each) to row placed[b * H_kv + h] of
// pool_keys and pool_values (B, H_kv, rows - 1, row_bytes), mapped pinned host memory that the
// kernel writes over the link. A (b, h) placed at -1 is skipped. A small grid of warps, one row
// each at a time (16-byte words when aligned), as the gather kernel (gather.h) keeps most of the
// device to the compute beside it.
int h2o_store_placed(void* pool_keys, void* pool_values, const void* keys, const void* values,
                     const int32_t* placed, int64_t B, int64_t H_kv, int64_t rows,
                     int64_t row_bytes, void* stream);

}  // namespace infinigen::kernels::cuda
