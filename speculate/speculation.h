// speculate: InfiniGen's per-layer state and its decode-time speculation (docs/infinigen.md).
//
// At prefill, for each layer and head, the r = floor(ratio * d) "partial" columns with the largest
// sum over the prompt of |Q~| + |K~| (rule qk, the paper's) or |Q~| (rule q, the reference code's)
// are chosen; the partial query weights W_q~[S] (+ bias) and the partial key cache K~[:, S] are
// kept. At decode, layer l's attention is speculated at layer l - 1 from that layer's attention
// input x: pq = x W_q~[S]^T + b_q~[S], s[t] = pq . Kp[t] / sqrt(d) for every stored token t. Per
// (sequence, head) count = |{t : s[t] > max(s) - alpha}|; a fetch size n' = clamp(floor(mean
// count), 1, max_num_kv), the mean taken over each sequence's H rows (FetchRule::Sequence, the
// default) or over all B * H rows of the layer (FetchRule::Batch, the paper's and the reference
// code's rule); each (sequence, head) fetches its top-n' tokens (fewer when the sequence has
// fewer tokens).
//
// Why per sequence by default: with one mean for the batch, a sequence's fetch depends on what
// else is in the batch: a long prompt batched with short ones gets n' below its own count, and
// even alpha = infinity then drops tokens it needs (InfiniGen would not equal full attention).
// Per sequence, every sequence fetches what its own heads ask for, and a batch computes what
// each of its sequences would compute alone.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/dtype.h"
#include "core/kv_cache.h"
#include "core/shared_prefixes.h"
#include "core/tensor.h"

namespace infinigen {

enum class PartialIndexRule { QK, Q };
enum class FetchRule { Sequence, Batch };

struct SpeculationOptions {
  double alpha = 4.0;          // logit threshold below the row maximum
  double partial_ratio = 0.3;  // r = floor(ratio * d), at least 1
  PartialIndexRule index_rule = PartialIndexRule::QK;
  FetchRule fetch_rule = FetchRule::Sequence;  // what n' is the mean count of
  // The partial key cache: F16 (the default, as the reference code keeps it in the KV's type:
  // half the memory; docs/accuracy.md measures no change), or F32.
  DType partial_key_dtype = DType::F16;
  int64_t max_num_kv = 0;        // cap on n' per layer; 0 = max_fetch_share of the capacity
  double max_fetch_share = 0.2;  // the cap's share of the sequence capacity, in (0, 1]
  int64_t dense_layers = 2;  // layers [0, dense_layers) always fetch their whole KV
  void validate() const;     // one-line Error naming the option
  // max_num_kv, or when it is 0 max_fetch_share of a sequence capacity of `capacity` tokens
  // (rounded down, at least 1).
  int64_t fetch_cap(int64_t capacity) const;
};

// What a dry run (core/trace.h) of InfiniGen fetches: nothing is computed there, so nothing can be
// speculated, and each speculated layer fetches what a measured run did.
struct FetchReplay {
  // Per layer of the measured model, the share of the stored tokens a decode step fetched (a
  // run's tokens_fetched / tokens_stored). Resampled by relative depth among the speculated
  // layers when the model replayed has another number of layers.
  std::vector<double> fraction;
  // Optional and exact: per decode step (1, 2, ...) and layer, the (sequence, head, token) rows
  // a run fetched. Overrides `fraction` where given.
  std::vector<std::vector<uint64_t>> rows;
  // Optional: per layer of the measured model, the share of a decode step's fetched rows that the
  // same (sequence, KV head) had fetched at the step before (a run's tokens_fetched_again /
  // tokens_fetched): what a row cache serves (OffloadOptions::row_cache). Resampled as
  // `fraction`; empty: none.
  std::vector<double> again;
  // Optional and exact: per decode step (1, 2, ...) and layer, the (sequence, head, token) rows a
  // run's row cache served (its tokens_from_row_cache). Overrides `again` where given.
  std::vector<std::vector<uint64_t>> again_rows;

  // One-line Error when a share is outside [0, 1], a step of `rows` has not `num_layers`
  // entries, or there is nothing to replay.
  void validate(int64_t num_layers) const;
  // Tokens each sequence fetches per head at decode step `step` of speculated layer `layer` (of
  // `num_layers`, the first `dense_layers` dense), with `stored` tokens per sequence and
  // valid[b] of them valid in sequence b, at most `cap`: the measured share of `stored` (at
  // least 1), or the measured rows spread evenly over the sequences.
  std::vector<int32_t> take(int64_t step, int64_t layer, int64_t num_layers, int64_t dense_layers,
                            int64_t heads, int64_t stored, const std::vector<int64_t>& valid,
                            int64_t cap) const;
  // Rows a row cache serves to (sequence b, KV head h) of `batch` x `heads` at decode step `step`
  // of speculated layer `layer`, which takes `take` rows: the measured rows spread evenly over the
  // (sequence, head) pairs, the remainder to the first, or the share `again` of `take` (0 when
  // neither is given); at most `take`.
  int64_t cached(int64_t step, int64_t layer, int64_t num_layers, int64_t dense_layers, int64_t b,
                 int64_t h, int64_t batch, int64_t heads, int64_t take) const;
};

// The number of partial key columns per head, r = max(1, floor(ratio * head_dim)).
int64_t partial_columns(double ratio, int64_t head_dim);

// What a layer's speculation state is built from at prefill: the layer's attention input
// (core/kv_cache.h) and its new keys.
struct PartialSource {
  const Tensor& queries;        // (B * n, H * d) fp32, as attention uses them (rotated, scaled)
  const Tensor& keys;           // (B * n, H_kv * d) fp32 (rotated)
  const Tensor& q_weight;       // (H * d, D), HF layout, any float dtype
  const Tensor& q_bias;         // (H * d), or undefined
  const Tensor& rope_inv_freq;  // (d / 2) fp32: the model's rotary frequencies; undefined: none
  // (H_kv, d, d) fp32: per KV head, the orthogonal skew A (columns by singular value) applied
  // after the rotation, Q~ = Q A, K~ = K A (speculate/skew.h); undefined: none, or folded into
  // the weights (OPT).
  const Tensor& skew;
};

// One layer's speculation state, on the CPU backend. Per KV head g (shared by the H / H_kv query
// heads of its group): r partial columns S_g of the skewed space, chosen from the group's queries
// and its keys; the partial key cache K~[:, S_g] (B, H_kv, capacity, r) in fp32 or fp16
// (SpeculationOptions::partial_key_dtype; fp16 halves its memory, as the reference code keeps it
// in the KV's type, at the cost of rounding the estimated logits); and the partial query weights:
// the rows of W_q that the partial query of each head needs, in W_q's dtype (lossless): the rows
// S_g (no rotation, no skew: OPT), S_g and their rotary pairs (rotary, no skew), or all d rows
// (skewed: every output of a head feeds every skewed column).
//
// Speculation of a query head h from the previous layer's attention input x: its needed rows of
// x W_q^T + b, rotated at the new token's position, skewed, the columns S_g, scaled by 1/sqrt(d),
// dotted with every stored partial key of its KV head. The group's query heads are combined by
// the maximum of their estimated logits: a token that one head of the group would attend to is
// fetched for the group (its K and V rows are shared). In a trace its host work records itself as
// partial_build {B, H_kv, tokens, r, D}, speculate {B, H_kv, positions, r, H} (the partial key
// dtype) and partial_append {B, H_kv, r}.
class PartialLayer {
 public:
  PartialLayer() = default;

  // Columns, partial weights and the partial keys of a cache of `capacity` positions: position p
  // of (b, g) holds token p (n <= capacity), or token position_tokens[(b * H_kv + g) * capacity
  // + p] when given (-1: empty; a capped pool).
  void build(const PartialSource& source, const std::vector<int32_t>& first_valid,
             int64_t num_heads, int64_t num_kv_heads, int64_t capacity, int64_t r,
             PartialIndexRule rule, const std::vector<int32_t>* position_tokens = nullptr,
             DType key_dtype = DType::F32);
  // build() in steps, for a prompt computed in several passes (chunks, or a shared prefix's
  // pass and the sequences' own tokens after it), with the columns chosen from all of it:
  // begin_prompt, accumulate per pass, choose_columns after the last, then write_partial_key for
  // every stored token. begin_prompt takes the rotation and skew of `source` (its queries and
  // keys give the widths) for a batch of `batch`.
  void begin_prompt(const PartialSource& source, int64_t batch, int64_t num_heads,
                    int64_t num_kv_heads, int64_t r, PartialIndexRule rule, DType key_dtype);
  // Adds the column rule's sums over a pass's rows, queries (P * n, H * d) and keys (P * n,
  // H_kv * d), to each sequence's own: row j of the pass's sequence i is token first_row + j of
  // sequence sequences[i], and counts from first_valid[i]. A prompt in several passes thus sums
  // each sequence's tokens in the order one pass would.
  void accumulate(const Tensor& queries, const Tensor& keys, const std::vector<int64_t>& sequences,
                  const std::vector<int32_t>& first_valid, int64_t first_row);
  // With the pass's rows on the CUDA device (begin_prompt's source there), the sums are kept and
  // added up there (ops::partial_column_scores, the same order of additions), and only
  // choose_columns reads them back: (B, H_kv * d) doubles.
  // After the sharing pass (the groups' leaders): each member's sums start from its leader's.
  void continue_from_prefixes(const SharedPrefixes& shared);
  // The columns from every sequence's sums, the partial query weights from W_q (H * d, D) and
  // its bias (or undefined), and an empty partial key cache of `capacity` positions. With W_q on
  // the CUDA device its needed rows are gathered there (the weights stay on the device);
  // `device_keys`: a DevicePartialLayer (speculate/device_partial.h) keeps the partial key cache,
  // and none is made here.
  void choose_columns(const Tensor& q_weight, const Tensor& q_bias, int64_t capacity,
                      bool device_keys = false);
  // Inspection (tests): each sequence's column sums so far (B, H_kv * d), between begin_prompt
  // and choose_columns; copied from the device when kept there.
  std::vector<double> column_scores() const;
  // The partial key of a key row (d fp32, rotated) of KV head g, at `position` of (b, g).
  void write_partial_key(int64_t b, int64_t g, int64_t position, const float* key);
  // After a build from the prompt prefixes that groups of a batch share (`from_leaders`: the
  // sharing pass, a batch of the groups' leaders, whose slots become the leaders'), or a restore
  // for the batch: each sequence's prefix positions [shared.begin(b), shared.rows()) read its
  // leader's partial keys, kept once, and count as tokens whatever first_valid says; later
  // appends write each sequence's own.
  void share_prefixes(const SharedPrefixes& shared, bool from_leaders);
  // Keeps the sequences `keep` (old indices, ascending) of a built layer, renumbered in that
  // order (KvStore::drop_sequences), with `shared`, the kept sequences' prefixes: each move's
  // prefix positions [row0, row1) of its partial keys go from its old leader's slot to the new
  // leader's first (where the keys are on the host).
  void keep_sequences(const std::vector<int64_t>& keep,
                      const std::vector<KvStore::LeaderMove>& moves, const SharedPrefixes& shared);
  // Writes the partial keys of one new token per sequence, keys (B, H_kv * d) (rotated), at
  // `position` of every (sequence, KV head), or at positions[b * H_kv + g] when given (a pool
  // with a memory limit overwrites a different victim in each row).
  void append(const Tensor& keys, int64_t position,
              const std::vector<int32_t>* positions = nullptr);

  struct Selection {
    int64_t fetch = 0;            // rows per (sequence, KV head) of the staging: max over take
    std::vector<int32_t> take;    // (B): tokens taken per sequence, min(its n', valid tokens)
    std::vector<int32_t> tokens;  // (B, H_kv, fetch): the first take[b] ascending, rest unused
    double mean_count = 0.0;      // mean over all B * H_kv rows of the alpha count
  };
  // Speculates attention over positions [0, used) from x (B, D), the attention input of the
  // previous layer, with the new token of sequence b at rotary position rope_positions[b]
  // (unused without rotation), options.alpha, options.max_num_kv (> 0: the resolved cap) and
  // options.fetch_rule. Position p of (b, g) holds token p, or position_tokens[(b * H_kv + g) *
  // capacity + p] when given (-1: empty); it counts when that token is not padding
  // (>= first_valid[b]). Selected positions are returned in ascending order. In a dry run
  // (core/trace.h) nothing is estimated: each sequence b takes its first replay_take[b] valid
  // positions (FetchReplay).
  Selection speculate(const Tensor& x, const std::vector<int32_t>& rope_positions, int64_t used,
                      const std::vector<int32_t>& first_valid, const SpeculationOptions& options,
                      const std::vector<int32_t>* position_tokens = nullptr,
                      const std::vector<int32_t>* replay_take = nullptr) const;
  // speculate()'s two halves. The estimated attention logits (B, H_kv, used) of positions
  // [0, used), scaled by 1/sqrt(d), the maximum over each group's query heads; -inf where a
  // position holds padding or nothing (empty in a dry run).
  std::vector<float> estimate_logits(const Tensor& x, const std::vector<int32_t>& rope_positions,
                                     int64_t used, const std::vector<int32_t>& first_valid,
                                     const std::vector<int32_t>* position_tokens = nullptr) const;
  // The alpha counts, n' and the top-n' positions of each row of `logits` (B, H_kv, used).
  Selection select(const std::vector<float>& logits, int64_t used,
                   const SpeculationOptions& options) const;

  int64_t r() const { return r_; }
  // The r partial key columns stored at `position` of (b, g), widened to fp32.
  std::vector<float> partial_key(int64_t b, int64_t g, int64_t position) const;
  // (H_kv, r): the partial columns of each KV head, ascending (in the skewed space when skewed).
  const std::vector<int32_t>& columns() const { return columns_; }
  // The partial key of a full key row (d) of KV head g: its skewed partial columns.
  void partial_of(const float* key, int64_t g, float* out) const;

  // What a session keeps of the layer besides its partial keys: "partial_columns" (H_kv, r) i32,
  // "partial_weight" (rows, D), "partial_bias" (rows) fp32, and "partial_skew" (H_kv, d, d) and
  // "partial_inv_freq" (d / 2) fp32 when the layer has them.
  std::vector<std::pair<std::string, Tensor>> state() const;
  // The layer as state() described it, for a batch of `batch` with `capacity` positions, its
  // partial keys still to be written (key_row). One-line Error when the state does not fit the
  // shapes given.
  void restore(const std::vector<std::pair<std::string, Tensor>>& state, int64_t batch,
               int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t capacity,
               DType key_dtype);
  // A dry run's restore (core/trace.h): the shapes of a layer of `hidden`-wide inputs and r
  // columns per KV head (the first r, with their rotary pairs when `rotary`), nothing stored.
  void restore_shapes(int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                      int64_t capacity, int64_t r, bool rotary, int64_t hidden, DType weight_dtype,
                      DType key_dtype);
  // The r partial key elements (in the key dtype) at `position` of (b, g).
  const void* key_row(int64_t b, int64_t g, int64_t position) const {
    return keys_.data() + key_offset(b, g, position);
  }
  DType key_dtype() const { return key_dtype_; }
  // What a device speculation (kernels/cuda/speculation.h) is given besides state(): the query
  // dimensions the partial queries of KV head g need (ascending; its heads' rows of
  // partial_weight, in that order), per query head h the offset of its rows in partial_weight
  // (H + 1 entries), and the partial key cache's bytes (B, H_kv, capacity, r) in key_dtype().
  const std::vector<int32_t>& needed_rows(int64_t g) const {
    return needed_[static_cast<size_t>(g)];
  }
  const std::vector<int64_t>& head_rows() const { return head_rows_; }
  // The partial query weights (head_rows()[H], D) in W_q's dtype, on the device where W_q was
  // (choose_columns), and their bias (head_rows()[H]) fp32 on the host.
  const Tensor& weight() const { return weight_; }
  const Tensor& bias() const { return bias_; }
  const std::vector<char>& key_bytes() const { return keys_; }
  int64_t batch() const { return batch_; }
  int64_t capacity() const { return capacity_; }
  int64_t num_heads() const { return heads_; }
  int64_t head_dim() const { return head_dim_; }
  const SharedPrefixes& shared() const { return shared_; }  // set by share_prefixes
  // Frees the partial key cache once a device copy has taken over (speculate/device_partial.h):
  // what reads or writes it afterwards fails.
  void release_keys() { keys_ = {}; }

 private:
  int64_t batch_ = 0, heads_ = 0, kv_heads_ = 0, group_ = 1, head_dim_ = 0, capacity_ = 0, r_ = 0;
  SharedPrefixes shared_;         // positions read from a group leader's slot (share_prefixes)
  std::vector<int32_t> columns_;  // (H_kv, r), ascending within a KV head
  std::vector<float> skew_;       // (H_kv, d, d) row-major A per KV head; empty: no skew
  std::vector<float> inv_freq_;   // (d / 2) rotary frequencies; empty: no rotation
  // Per KV head, the query dimensions its heads' partial queries need (ascending), and the
  // offset of head h's rows in weight_ (H + 1 entries).
  std::vector<std::vector<int32_t>> needed_;
  std::vector<int64_t> head_rows_;
  Tensor weight_;  // (head_rows_[H], D) in W_q's dtype: the needed rows, head by head
  Tensor bias_;    // (head_rows_[H]) fp32
  // estimate_logits' partial queries before rotation: (B, head_rows_[H]) fp32 on the CPU, the
  // needed rows of every head, allocated with the layer's shapes so that a decode step's
  // speculation allocates nothing (allocate_query_rows).
  mutable Tensor query_rows_;
  DType key_dtype_ = DType::F32;
  std::vector<char> keys_;  // (B, H_kv, capacity, r) in key_dtype_
  // Between begin_prompt and choose_columns: the rule, each sequence's column sums (B, H_kv * d)
  // and the prompt's rows so far.
  PartialIndexRule rule_ = PartialIndexRule::QK;
  std::vector<double> column_scores_;
  int64_t prompt_rows_ = 0;
  // The same sums on the CUDA device while the prompt's rows are there: (B, H_kv * d) I64 storage
  // of doubles, and the skew there (H_kv, d, d) fp32 (undefined: none).
  Tensor device_scores_, device_skew_;

  // Offset in keys_ of position p of (b, g) (its group leader's for a shared position).
  size_t key_offset(int64_t b, int64_t g, int64_t p) const {
    const int64_t sequence = shared_.in_prefix(b, p) ? shared_.source(b) : b;
    return static_cast<size_t>(((sequence * kv_heads_ + g) * capacity_ + p) * r_) *
           dtype_size(key_dtype_);
  }
  // Whether `token` (a position's, -1 when empty) is one sequence b attends to.
  bool holds_token(int64_t token, const std::vector<int32_t>& first_valid, int64_t b) const {
    return token >= first_valid[static_cast<size_t>(b)] ||
           (token >= 0 && shared_.in_prefix(b, token));
  }
  void write_key(size_t offset, const float* values);
  // query_rows_ for the layer's batch and needed rows.
  void allocate_query_rows();
  // needed_ and head_rows_ from the columns: every query dimension under a skew, else the
  // columns with their rotary pairs when rotated.
  void derive_needed_rows(bool rotary, bool skewed);
  // The sizes of a restored layer (restore, restore_shapes).
  void set_shape(int64_t batch, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                 int64_t capacity, int64_t r, DType key_dtype);
  // Positions [begin, end) of (b, g) scored against the group's scaled partial queries
  // (group_, r): logits[p] (the row's, indexed by position) = max over the heads of q . key(p),
  // left as they are where the position holds no token of sequence b.
  void score_positions(const float* queries, int64_t b, int64_t g, int64_t begin, int64_t end,
                       const std::vector<int32_t>& first_valid,
                       const std::vector<int32_t>* position_tokens, float* logits) const;
  // The partial query (r, scaled) of head h of sequence b from its needed rows `rows`.
  void partial_query(const float* rows, int64_t h, int32_t rope_position, float* out) const;
  // A dry run's selection: sequence b takes its first take[b] valid positions.
  Selection replayed(const std::vector<int32_t>& take, int64_t used,
                     const std::vector<int32_t>& first_valid,
                     const std::vector<int32_t>* position_tokens) const;
};

}  // namespace infinigen
