// offload: the bookkeeping of InfiniGen's capped KV pool (--kv-pool-limit): which token each pool
// position holds, and the eviction tables that choose which position a new token overwrites.
//
// With a limit of S positions per (layer, sequence, KV head), the pool and the partial key cache
// are indexed by position, not token. A prompt longer than S keeps, per (sequence, head), the S
// tokens the eviction policy chooses from the prompt's attention, with the counters (or
// recencies) that attention gives them (speculate/prompt_keep.h); once a row is full each new
// token overwrites the victim the policy chooses (speculate/eviction.h). Every fetched entry
// counts for the policy: the speculated layers' selections, and for dense layers (which load
// every valid position) the entries within alpha of the top of their true attention.
//
// Rows are numbered b * H_kv + h within a layer. The bookkeeping lives on the host: it is a few
// bytes per position, and each decode step touches one position per row.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "offload/offload_stats.h"
#include "speculate/eviction.h"
#include "speculate/prompt_keep.h"
#include "speculate/speculation.h"

namespace infinigen {

struct KvPoolLimit {
  int64_t positions = 0;  // per (layer, sequence, head); 0 = no limit
  EvictionPolicy eviction = EvictionPolicy::Counter;
};

class CappedPool {
 public:
  // `stats`, when given, records the cap (S and `pool_bytes`, the pinned pool that holds it) and
  // counts the tokens dropped: prompt tokens not kept, and decode evictions.
  CappedPool(int64_t num_layers, int64_t batch, int64_t kv_heads, int64_t slots,
             EvictionPolicy eviction, OffloadStats* stats = nullptr, size_t pool_bytes = 0);

  int64_t slots() const { return slots_; }  // S
  EvictionPolicy eviction_policy() const { return eviction_.front().policy(); }
  // Positions in use once `length` tokens per sequence have been stored.
  int64_t used(int64_t length) const { return std::min(length, slots_); }
  // The token at position `position` of (b, h) in layer `layer` (-1: empty).
  int32_t token_at(int64_t layer, int64_t b, int64_t h, int64_t position) const {
    return tokens_[static_cast<size_t>(layer)]
                  [static_cast<size_t>((b * kv_heads_ + h) * slots_ + position)];
  }
  // Layer `layer`'s tokens per position, (B, H_kv, S), for the partial key cache.
  std::vector<int32_t>& position_tokens(int64_t layer) {
    return tokens_[static_cast<size_t>(layer)];
  }

  // The prefill of layer `layer`: from the prompt's scaled queries (B * n, H * d) and keys
  // (B * n, H_kv * d), fp32 (a device's are copied to the host), the tokens each (b, h) keeps, in
  // the order of the positions they take ((B * H_kv) lists; position j of a row holds its j-th
  // token), with the history the eviction policy starts decoding with.
  std::vector<std::vector<int32_t>> keep_prompt(int64_t layer, const Tensor& queries,
                                                const Tensor& keys,
                                                const std::vector<int32_t>& first_valid,
                                                int64_t head_dim, double alpha);
  // keep_prompt for a dry run, which has no data to rank a prompt of n positions by: each row
  // keeps as many tokens as keep_prompt would, its newest, with no fetch history (what the run
  // then costs depends on how many, not on which).
  std::vector<std::vector<int32_t>> keep_prompt_newest(int64_t layer,
                                                       const std::vector<int32_t>& first_valid,
                                                       int64_t n);
  // Decode: the position each (b, h) gives the new token `token` ((B * H_kv)): the next free one
  // until the row is full, then the victim's.
  std::vector<int32_t> place_token(int64_t layer, int64_t token);
  // Every valid position of each (b, h) after `length` tokens (a dense layer's load): take[b] is
  // the least count over the sequence's heads.
  PartialLayer::Selection select_all(int64_t layer, const std::vector<int32_t>& first_valid,
                                     int64_t length) const;
  // Valid entries of sequence b (those of its head 0; every head keeps as many).
  int64_t valid_entries(int64_t layer, int64_t b, int32_t first_valid, int64_t length) const;

  // A resumed conversation's turn (its first pass extends what the pool holds).
  // What row `row` (b * H_kv + h) of layer `layer` holds, in age (token) order, with the eviction
  // state of each (HeldEntries without keys) and the position it is at.
  struct Held {
    HeldEntries entries;
    std::vector<int32_t> positions;
  };
  Held held(int64_t layer, int64_t row) const;
  // After the pass: row `row`, which held `before` (held() of it), keeps keep.tokens, with the
  // history keep gives them. Held tokens stay at their positions; the pass's kept tokens (those
  // >= first_new) take the positions of the evicted ones, then the free ones, and are returned as
  // (token, position) pairs. Adds the held tokens evicted to `evicted`.
  std::vector<std::pair<int32_t, int32_t>> refill_row(int64_t layer, int64_t row,
                                                      const Held& before, const PromptKeep& keep,
                                                      int64_t first_new, int64_t& evicted);
  // Into the statistics: held tokens an extension evicted, and its tokens it did not keep.
  void count_extension_drops(int64_t evicted, int64_t not_kept);
  // What a session saves of a layer: per (b, h, position) the token, relative to the sequence's
  // first_valid (-1: empty), and the eviction record (the counter, or the recency relative to
  // first_valid; 0 for fifo), each (B, H_kv, S).
  void save(int64_t layer, const std::vector<int32_t>& first_valid, int32_t* tokens,
            int32_t* records) const;
  // Row `row` of layer `layer` holds `tokens` at positions 0, 1, ... (absolute tokens, in any
  // order) with `records` as save() gives them (absolute); at most S.
  void restore_row(int64_t layer, int64_t row, const std::vector<int32_t>& tokens,
                   const std::vector<int64_t>& records);
  // A record as HeldEntries and seeding take it: the counter as fetches, the recency as the last
  // fetch.
  void record_as_history(int64_t record, int64_t& fetches, int64_t& last_fetch) const;

  // Keeps the rows of sequences `keep` (old indices, ascending), renumbered in that order
  // (KvStore::drop_sequences): their tokens per position and eviction state.
  void keep_sequences(const std::vector<int64_t>& keep);

  // Each entry `selection` takes counts as fetched at step `step`.
  void count_fetches(int64_t layer, const PartialLayer::Selection& selection, int64_t step);
  // A dense layer's fetches, on the host: of the staged rows of `selection` (staged_keys (B,
  // H_kv, rows, d) in host memory: (b, h)'s rows [fetch - take[b], fetch) hold its positions,
  // row fetch the new token), those that one query head of the group (queries (B, H * d) in
  // host memory, scaled) attends to within alpha of its own top.
  void count_dense_fetches(int64_t layer, const PartialLayer::Selection& selection,
                           const Tensor& staged_keys, const Tensor& queries, double alpha,
                           int64_t step);

 private:
  int64_t batch_;
  int64_t kv_heads_;
  int64_t slots_;
  PoolCapStats* stats_ = nullptr;
  std::vector<std::vector<int32_t>> tokens_;  // per layer: (B, H_kv, S), -1 empty
  std::vector<EvictionTable> eviction_;       // per layer: B * H_kv rows of S slots
  // The prefill's keep (one per row, consumed) into layer `layer`'s positions and eviction state.
  std::vector<std::vector<int32_t>> apply_prompt_keep(int64_t layer, std::vector<PromptKeep>& keep,
                                                      const std::vector<int32_t>& first_valid,
                                                      int64_t n);
  // The eviction record of (row, position): the counter, the recency, or 0 (fifo).
  int64_t record(int64_t layer, int64_t row, int64_t position) const;
  // Row `row` holds tokens[j] at position j, seeded with fetches[j] and last_fetch[j].
  void fill_row(int64_t layer, int64_t row, const std::vector<int32_t>& tokens,
                const std::vector<int64_t>& fetches, const std::vector<int64_t>& last_fetch);
};

}  // namespace infinigen
