// offload: the `h2o` baseline (Heavy-Hitter Oracle, NeurIPS'23): a fixed budget of KV entries per
// (layer, sequence, head), split between the most recent tokens and the "heavy hitters", the
// tokens that accumulated the most attention probability. Evicted tokens are gone for good.
//
// Budget: slots = max(2, floor(budget * capacity)) entries per (layer, sequence, head), of which
// recent = floor(slots / 2) hold the newest tokens and the other ceil(slots / 2) the heavy hitters
// (the paper's even split; the heavy half gets the odd slot, as a recent token needs no score to
// be worth keeping). Scores are accumulated per kept entry: in the prefill, the causal softmax of
// every valid prompt query over the valid prompt keys; in decode, the new query's softmax over
// the kept entries and the new token. Scoring runs on the host from the fp32 queries and an fp32
// copy of the kept keys rounded through the KV dtype, so it sees the keys attention reads.
//
// Layout: each layer's KV stays resident on the device in a compact cache (B, H, slots + 1, d).
// Sequence b keeps count[b] entries (the same for every layer and head: every head keeps the same
// number) in rows [slots - count[b], slots); a decode step's new token goes into row `slots`, and
// attention reads rows [slots - count[b], slots + 1) (the view's own first_valid). After the pass
// (end_pass) the new token moves into row slots - count[b] - 1 while the row has room, or into the
// row of the victim: the lowest-score entry outside the recent window (ties to the oldest token).
// Rows are thus not in token order; each keeps its token index, and "recent" is decided by it.
// Left padding is never kept. Nothing moves between host and device memory.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "core/kv_cache.h"
#include "offload/offload_stats.h"
#include "offload/transfer_engine.h"

namespace infinigen {

// The entry to evict among `scores` (accumulated attention probability per entry) and `tokens`
// (their token indices): the lowest score among entries whose token is older than
// `recent_start`, ties to the smallest token index; -1 when every entry is recent.
int64_t h2o_choose_victim(std::span<const float> scores, std::span<const int32_t> tokens,
                          int32_t recent_start);

class H2oKv : public KvStore {
 public:
  // `budget`: the fraction of `capacity` (prompt + generation) kept per (layer, sequence, head).
  H2oKv(const ModelConfig& config, int64_t batch, int64_t capacity, DType kv_dtype, Device device,
        double budget, TransferEngine& engine, OffloadStats& stats);

  void begin_pass(int64_t n_new) override;
  void observe(int64_t layer, const Tensor& normed, const Tensor& queries,
               const OptLayerWeights& weights) override;
  void append(int64_t layer, const Tensor& keys, const Tensor& values) override;
  View view(int64_t layer) override;
  void end_pass(int64_t n_new) override;

  int64_t slots() const { return slots_; }
  int64_t recent() const { return recent_; }
  // Entries sequence b keeps per head (after the last pass).
  int64_t kept(int64_t b) const { return count_[static_cast<size_t>(b)]; }
  // Token indices kept by (layer, b, h), in row order (after the last pass).
  std::vector<int32_t> kept_tokens(int64_t layer, int64_t b, int64_t h) const;

 private:
  // Index of row `row` of (layer, b, h) in the host arrays (scores, tokens, key copy / d).
  size_t entry(int64_t layer, int64_t b, int64_t h, int64_t row) const {
    return static_cast<size_t>(((layer * batch() + b) * heads_ + h) * (slots_ + 1) + row);
  }
  void prefill(int64_t layer, const Tensor& keys, const Tensor& values);
  void decode(int64_t layer, const Tensor& keys, const Tensor& values);
  // Moves row `from` of (layer, b, h) into row `to` (device K/V, host key copy, score, token).
  void move_row(int64_t layer, int64_t b, int64_t h, int64_t from, int64_t to);
  float round_kv(float value) const;  // `value` as the KV dtype stores it

  int64_t num_layers_;
  int64_t heads_;
  int64_t head_dim_;
  DType kv_dtype_;
  Device device_;
  int64_t slots_;
  int64_t recent_;
  TransferEngine& engine_;
  OffloadStats& stats_;
  std::vector<Tensor> keys_;      // per layer: (B, H, slots + 1, d) on the device
  std::vector<Tensor> values_;    // per layer: (B, H, slots + 1, d) on the device
  std::vector<float> host_keys_;  // (L, B, H, slots + 1, d) fp32, rounded through the KV dtype
  std::vector<float> scores_;     // (L, B, H, slots + 1) accumulated attention probability
  std::vector<int32_t> tokens_;   // (L, B, H, slots + 1) token index of each row
  std::vector<int32_t> count_;    // (B) entries kept per (layer, head) before this pass
  std::vector<int32_t> view_first_valid_;  // (B) slots - count: first row attention reads
  Tensor queries_;                         // this layer's queries (B * n, H * d), from observe
};

}  // namespace infinigen
