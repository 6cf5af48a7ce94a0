// kernels/cuda: InfiniGen's decode-time speculation on the device, the twin of the CPU's
// PartialLayer (speculate/speculation.h): the estimated attention logits of a layer from its
// partial queries and its partial key cache, the alpha counts, the fetch size n' and each row's
// top-n' positions, and the partial keys of new tokens written into the partial key cache.
//
// Every array is on the device; sizes are explicit; the stream is a cudaStream_t as void* (null:
// the legacy default stream); the result is 0 on success, else a cudaError_t (docs/cuda.md).
#pragma once

#include <cstdint>

#include "kernels/cuda/element_type.h"

namespace infinigen::kernels::cuda {

// Largest head size the speculation kernels take (as attention's kMaxHeadDim).
inline constexpr int64_t kMaxSpeculationHeadDim = 256;

// The estimated attention logits (B, H_kv, used) fp32 of positions [0, used), exactly what
// PartialLayer::estimate_logits computes from the same inputs, in the same order of arithmetic:
//
//   query_rows  (B, query_width) fp32: the needed rows of every head's query, x W~^T + b~ (the
//               caller's `linear` of the layer's attention input by partial_weight/partial_bias);
//               query head h owns columns [head_rows[h], head_rows[h + 1]).
//   head_rows   (H + 1) int32, head_rows[H] == query_width.
//   needed_dims (query_width) int32: the query dimension (< d) of each of those columns
//               (PartialLayer::needed_rows of the head's KV head, repeated head by head).
//   columns     (H_kv, r) int32: each KV head's partial columns (in the skewed space when skewed).
//   skew        (H_kv, d, d) fp32, row-major A per KV head, or null (no skew).
//   inv_freq    (d / 2) fp32 rotary frequencies, or null (no rotation); rope_positions (B) int32:
//               the rotary position of each sequence's new token (unread without inv_freq).
//   partial_keys (B, H_kv, capacity, r) of key_type (F32, F16 or BF16).
//   position_tokens (B, H_kv, capacity) int32, or null: the token that position p of (b, g)
//               holds (-1: empty; a capped pool); null: position p holds token p.
//   first_valid (B) int32: tokens before it are left padding.
//   prefix_begin, prefix_source (B) int32 and prefix_end (core/shared_prefixes.h: begin, source
//               and rows()): position p < prefix_end, p >= prefix_begin[b] of sequence b reads
//               sequence prefix_source[b]'s partial keys, and a token t < prefix_end,
//               t >= prefix_begin[b] counts whatever first_valid says. prefix_end 0: nothing
//               shared, and the two arrays may be null.
//
// Per query head h of KV head g = h / (H / H_kv): its query with the needed dimensions (zero
// elsewhere), rotated at rope_positions[b], skewed (q A), its r columns, times 1/sqrt(d); the
// logit of position p is the maximum over the group's heads of the dot product (summed over the r
// columns in order) with the stored partial key; -inf where the position holds padding or
// nothing. d <= kMaxSpeculationHeadDim, r <= d.
int speculate_logits(const float* query_rows, int64_t query_width, const int32_t* head_rows,
                     const int32_t* needed_dims, const int32_t* columns, const float* skew,
                     const float* inv_freq, const int32_t* rope_positions, const void* partial_keys,
                     Element key_type, const int32_t* position_tokens, const int32_t* first_valid,
                     const int32_t* prefix_begin, const int32_t* prefix_source, int64_t prefix_end,
                     float* logits, int64_t B, int64_t H, int64_t H_kv, int64_t d, int64_t r,
                     int64_t capacity, int64_t used, void* stream);

// What n' is the mean count of (speculate/speculation.h's FetchRule): each sequence's H_kv rows,
// or all B * H_kv rows.
enum class FetchMean { Sequence, Batch };

// PartialLayer::select on the device, from logits (B, H_kv, used) (-inf: not a token):
//
//   counts (B, H_kv) int32: per row the entries s > max - alpha (compared in double, as the CPU);
//   valid  (B, H_kv) int32: per row the entries that are not -inf;
//   fetch  (B) int32: n' = clamp(floor(mean count), 1, max_num_kv), the mean over the sequence's
//          rows (FetchMean::Sequence) or over all rows (Batch), the same for every sequence;
//   take   (B) int32: min(fetch[b], the fewest valid entries of b's rows);
//   mean_count (1) double: the mean count over all B * H_kv rows;
//   tokens (B, H_kv, fetch_cap) int32: per row of sequence b, the positions of its take[b]
//          largest entries (ties to the lower position), ascending; the rest of the row is 0.
//
// fetch_cap >= min(max_num_kv, used), max_num_kv >= 1. Three launches: the per-row counts (a
// block per row), the fetch sizes (one block), the selection (a block per row: a radix select
// over the order-preserving bits of the floats, four passes of 8 bits, then one pass in position
// order that writes the selected positions, ties taking the lowest; O(used) per row).
int select_top(const float* logits, int64_t B, int64_t H_kv, int64_t used, double alpha,
               int64_t max_num_kv, FetchMean mean, int32_t* counts, int32_t* valid, int32_t* fetch,
               int32_t* take, double* mean_count, int32_t* tokens, int64_t fetch_cap, void* stream);

// PartialLayer::append on the device, one new token per sequence: its partial keys, from keys
// (B, H_kv * d) fp32 (rotated), (key A)[columns] with skew (H_kv, d, d) or key[columns] without
// (null), written into partial_keys (B, H_kv, capacity, r) of key_type (rounded to nearest even)
// at `position` of every (sequence, KV head), or at positions[b * H_kv + g] when positions (B,
// H_kv) int32 is given (a capped pool; `position` is then unread, and a position outside
// [0, capacity) is not written). A position in sequence b's shared prefix (prefix_begin,
// prefix_source, prefix_end as for speculate_logits) is written to its source's slot, as the CPU
// does. d <= kMaxSpeculationHeadDim, r <= d.
int append_partial_keys(const float* keys, const int32_t* columns, const float* skew,
                        void* partial_keys, Element key_type, int64_t B, int64_t H_kv, int64_t d,
                        int64_t r, int64_t capacity, int64_t position, const int32_t* positions,
                        const int32_t* prefix_begin, const int32_t* prefix_source,
                        int64_t prefix_end, void* stream);

}  // namespace infinigen::kernels::cuda
