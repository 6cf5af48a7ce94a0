// offload: the `h2o` baseline (Heavy-Hitter Oracle, NeurIPS'23) as the InfiniGen paper runs it on
// FlexGen: a fixed budget of KV entries per (layer, sequence, head), split between the most recent
// tokens and the "heavy hitters" (the tokens that accumulated the most attention probability),
// kept in pinned host memory and loaded over the link for every layer at every decode step.
// Evicted tokens are gone for good.
//
// Budget: slots = max(2, floor(budget * capacity)) entries per (layer, sequence, head), of which
// recent = floor(slots / 2) hold the newest tokens and the other ceil(slots / 2) the heavy hitters
// (the paper's even split; the heavy half gets the odd slot, as a recent token needs no score to
// be worth keeping). Scores are accumulated per kept entry: in the prefill, the causal softmax of
// every valid prompt query over the valid prompt keys; in decode, the new query's softmax over
// the kept entries and the new token. Either way the keys are rounded through the KV dtype, so
// scoring sees the keys attention reads.
//
// Where it runs: on the CPU backend scoring, the victim choice and the bookkeeping (scores, token
// indices, an fp32 copy of the kept keys) run on the host. On CUDA they run on the device
// (kernels/cuda/h2o.h, through core/ops.h's h2o ops), tiled and reduced in parallel, with the
// host's scores within fp32 rounding, so both keep the same tokens except at near-ties (two
// scores at a keep boundary within that rounding): the scores and token indices live in device
// memory, decode scores from the staged keys after the layer's load, the choice of each new
// token's row stays on the device, and the store is a kernel on the store stream that writes the
// staged row into the mapped pinned pool at that row (TransferEngine::store_by_kernel). The host
// never reads them in a step: the counts, which the loads need, do not depend on scores and are
// kept on the host (docs/cuda.md, "h2o on the device").
//
// Host pool (pinned, allocated up front): [L][2][B][H][slots] rows of d in the KV dtype, K then V.
// Sequence b keeps count[b] entries (the same for every layer and head: every head keeps the
// same number) in rows [slots - count[b], slots) of each (layer, K/V, b, h), a contiguous run.
// A new token takes row slots - count[b] - 1 while the run has room, else the row of the victim:
// the lowest-score entry outside the recent window (ties to the oldest token). Rows are thus not
// in token order; each keeps its token index, and "recent" is decided by it. Left padding is
// never kept. Only transfers touch the pool: the store stream writes it, the load stream reads it.
//
// Device: the pipeline's staging K and V (B, H, slots + 1, d) by layer parity. Layer l's load
// copies each (b, h)'s count[b] valid rows into the same rows of staging[l % 2]; the new token
// goes into row `slots`, and attention reads rows [slots - count[b], slots + 1) (the view's own
// first_valid). Once the new query has scored the layer, the store stream copies row `slots` of
// every (b, h) into the pool row chosen for it (on CUDA: chosen on the device, copied by a kernel
// that reads the row from the device).
//
// Bytes: a decode step loads 2 * L * sum_b(count[b]) * H * d * kv_bytes and stores
// 2 * L * B * H * d * kv_bytes; the prefill stores its kept rows, 2 * L * sum_b(count[b]) * H * d *
// kv_bytes with the counts after selection.
//
// Ordering, by events through the layer pipeline (offload/layer_pipeline.h; no device-wide
// synchronisation): layer 0's load is issued by begin_pass and layer l + 1's by begin_layer(l), so
// each overlaps the layer before; attention of layer l waits for its load's event only. The load
// of layer l waits for the previous step's store of layer l; the store of layer l waits for this
// step's load of layer l (the victim's old row may be among the rows it reads). A host write into
// a staging buffer waits for the latest store that read a staging buffer of its parity. On CUDA
// the decode's scoring reads the loaded rows too, so the device waits for the layer's load before
// it; the store kernel follows the placement (every transfer follows the compute enqueued before
// it) and reads the rows it chose from device memory; the next step's placement of the layer
// follows the layer's next load, which follows that store, so one array of chosen rows per layer
// is never overwritten before its store has read it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "core/device.h"
#include "core/kv_cache.h"
#include "offload/layer_pipeline.h"
#include "offload/offload_stats.h"
#include "offload/transfer_engine.h"

namespace infinigen {

struct KvPolicy;
const KvPolicy& h2o_kv_policy();  // its entry (offload/kv_policy.h)

// The entry to evict among `scores` (accumulated attention probability per entry) and `tokens`
// (their token indices): the lowest score among entries whose token is older than
// `recent_start`, ties to the smallest token index; -1 when every entry is recent.
int64_t h2o_choose_victim(std::span<const float> scores, std::span<const int32_t> tokens,
                          int32_t recent_start);

// The entries of one (layer, sequence, head)'s candidates (`scores`, `tokens`: any order) that
// H2O keeps within `slots`: all when they fit, else the `recent` newest tokens and the
// highest-scoring others, ties to the newer. Indices into the candidates, in token order. The
// prefill keeps its prompt this way, and an extension its kept entries and new tokens.
std::vector<int64_t> h2o_keep(std::span<const float> scores, std::span<const int32_t> tokens,
                              int64_t slots, int64_t recent);

// Entries each (layer, sequence, head) keeps for a budget share of `capacity` tokens; the planner
// and the store agree through it.
int64_t h2o_slots(double budget, int64_t capacity);

// The decode's scoring of one query head on the host: `scores` (n) += the softmax of the dots of
// `query` (d) with the `n` kept keys (n, d), fp32; `probs` (n) is scratch. Each product is
// rounded on its own and summed in order: the reference that the device's scores
// (kernels/cuda/h2o.cu) match within fp32 rounding.
void h2o_accumulate_scores(const float* query, const float* keys, int64_t n, int64_t d,
                           float* probs, float* scores);

class H2oKv : public KvStore {
 public:
  // `budget`: the fraction of `capacity` (prompt + generation) kept per (layer, sequence, head).
  H2oKv(const ModelConfig& config, int64_t batch, int64_t capacity, DType kv_dtype, Device device,
        double budget, TransferEngine& engine, OffloadStats& stats);

  void observe(int64_t layer, const AttentionInput& input) override;
  void append(int64_t layer, const Tensor& keys, const Tensor& values) override;
  View view(int64_t layer) override;
  void end_pass(int64_t n_new) override;

  // Sessions (offload/session.h): H2O's whole state is its layers' state, which every pass may
  // change (evictions), so a session saves it at the end of each turn: per layer "h2o_keys" and
  // "h2o_values" (B, H_kv, slots, d) in the KV dtype, "h2o_tokens" (B, H_kv, slots) I32 (each
  // row's token as an index into its sequence's conversation, -1 for an empty row) and
  // "h2o_scores" (B, H_kv, slots) F32, the kept entries of (b, h) in its last count[b] rows.
  bool saves_state_each_turn() const override { return true; }
  LayerState layer_state(int64_t layer) const override;
  // Into a store resumed (KvStore::resume) with this turn's budget: each (b, h)'s saved entries
  // with their scores, at most `slots` (the rest as the policy evicts). A sequence with fewer new
  // tokens than the batch's most has its newest history tokens among the pass's rows (which
  // other stores compute again): H2O keeps their saved entries instead, and its extension
  // scores and keeps only the sequence's new tokens, placing the kept rows just before them.
  void restore_layer_state(int64_t layer, const LayerState& state) override;
  void finish_stores() override { pipeline_.drain_stores(); }

  // Sequences leave the batch (KvStore::drop_sequences) with the pool and the bookkeeping
  // compacted in place into the layout of the smaller batch (on the host, or on the device); the
  // pool's memory is kept, as a whole, until the store goes.
  bool can_drop_sequences() const override { return true; }
  int64_t slots() const { return slots_; }
  int64_t recent() const { return recent_; }
  // Entries sequence b keeps per head (after the last pass).
  int64_t kept(int64_t b) const { return count_[static_cast<size_t>(b)]; }
  // Token indices kept by (layer, b, h), in row order (after the last pass), and their
  // accumulated scores. For tests: on CUDA they wait for the compute stream and copy from the
  // device.
  std::vector<int32_t> kept_tokens(int64_t layer, int64_t b, int64_t h) const;
  std::vector<float> kept_scores(int64_t layer, int64_t b, int64_t h) const;

 protected:
  void start_pass(int64_t n_new) override;
  void start_layer(int64_t layer) override;
  void keep_sequences(const std::vector<int64_t>& keep,
                      const std::vector<LeaderMove>& moves) override;

 private:
  // Whether the open pass extends stored entries by several tokens (a resumed conversation's
  // first pass): attention reads the kept rows and the pass's own from a staging of slots + n
  // rows, and the scores and keep choice run on the host (on either backend), as in the prefill
  // with the kept entries as candidates besides the new tokens.
  bool extending() const { return length() > 0 && pass_tokens() > 1; }
  void extend(int64_t layer, const Tensor& keys, const Tensor& values);
  // Layer `layer`'s scores and tokens (B, H, slots + 1), from the host's bookkeeping or the
  // device's (copied back after the compute stream), and back.
  void read_bookkeeping(int64_t layer, std::vector<float>& scores,
                        std::vector<int32_t>& tokens) const;
  void write_bookkeeping(int64_t layer, const std::vector<float>& scores,
                         const std::vector<int32_t>& tokens);
  // Index of row `row` of (layer, b, h) in the host bookkeeping (scores, tokens, key copy / d).
  size_t entry(int64_t layer, int64_t b, int64_t h, int64_t row) const {
    return static_cast<size_t>(((layer * batch() + b) * heads_ + h) * (slots_ + 1) + row);
  }
  // Row `row` of (layer, kind, b, h) in the pool (kind 0 = K, 1 = V).
  char* pool_row(int64_t layer, int64_t kind, int64_t b, int64_t h, int64_t row) const;
  // Row `row` of (b, h) in a staging buffer (B, H, slots + 1, d).
  char* staging_row(Tensor& staging, int64_t b, int64_t h, int64_t row) const;
  // Starts loading layer `layer`'s kept rows into its staging.
  void issue_load(int64_t layer);
  void prefill(int64_t layer, const Tensor& keys, const Tensor& values);
  void decode(int64_t layer, const Tensor& keys, const Tensor& values);
  // The prefill's scores and keep choice on the host, into the layer's staging.
  void prefill_on_host(int64_t layer, const Tensor& keys, const Tensor& values);
  // ... and on the device.
  void prefill_on_device(int64_t layer, const Tensor& keys, const Tensor& values);
  // Stores the kept prompt rows of layer `layer` from its staging into the pool.
  void store_prompt_rows(int64_t layer);
  // The decode's scores on the host: the new token's key copy and bookkeeping, then every
  // query head's probabilities added.
  void score_on_host(int64_t layer, const Tensor& keys);
  // Places every (b, h)'s new token on the host (a free row or the victim's) and stores it.
  void place_on_host(int64_t layer);
  // Scores, places and stores on the device.
  void decode_on_device(int64_t layer);
  // The bookkeeping of the kept rows of (layer, b, h), from the host or the device.
  template <typename T>
  std::vector<T> kept_entries(const std::vector<T>& host, const std::vector<Tensor>& device,
                              int64_t layer, int64_t b, int64_t h) const;
  // A dry run's prefill (core/trace.h): the bookkeeping of keeping each sequence's newest prompt
  // tokens, which is what equal (zero) scores keep.
  void keep_newest_prompt_tokens(int64_t layer, int64_t n);
  // Moves the bookkeeping of row `from` of (layer, b, h) into row `to` (key copy, score, token).
  void move_entry(int64_t layer, int64_t b, int64_t h, int64_t from, int64_t to);
  float round_kv(float value) const;  // `value` as the KV dtype stores it

  int64_t heads_;  // H_kv: the pool's heads (each scored by its group's query heads)
  int64_t group_;  // H / H_kv
  int64_t head_dim_;
  DType kv_dtype_;
  Device device_;
  bool on_device_;  // scores and bookkeeping on the CUDA device (a CUDA run, not a dry one)
  int64_t slots_;
  int64_t recent_;
  size_t row_bytes_;  // d * kv_bytes
  // [L][2][B][H][slots][d], pinned.
  std::unique_ptr<char[], void (*)(void*)> pool_{nullptr, pinned_free};
  // The host's bookkeeping (empty on the device):
  std::vector<float> host_keys_;  // (L, B, H, slots + 1, d) fp32, rounded through the KV dtype
                                  // (empty in a dry run)
  std::vector<float> scores_;     // (L, B, H, slots + 1) accumulated attention probability
  std::vector<int32_t> tokens_;   // (L, B, H, slots + 1) token index of each row
  // The device's, per layer (on_device_ only): scores (B, H, slots + 1) F32, tokens (same) I32,
  // and the row each (b, h)'s new token took in this step, placed (B, H) I32.
  std::vector<Tensor> device_scores_, device_tokens_, placed_;
  Tensor probs_;  // (B, H, slots + 1) F32: the decode's scratch
  // The prefill's scratch, for its pass only: row_stats (2, B, H_q, n) F32, key_scores (B, H, n)
  // F32, keep_flags (B, H, n) I32.
  Tensor row_stats_, key_scores_, keep_flags_;
  std::vector<int32_t> count_;    // (B) entries kept per (layer, head) before this pass
  std::vector<int32_t> extended_count_;  // (B) after an extension (set by its layers)
  // (B) rows of a resumed turn's first pass that are history already kept (not new tokens).
  std::vector<int32_t> history_in_pass_;
  std::vector<int32_t> view_first_valid_;  // (B) slots - count: first row attention reads
  Tensor queries_;                         // this layer's queries (B * n, H * d), from observe
  // Staging K and V (B, H, slots + 1, d) by layer parity. Last: its destructor waits for the
  // transfers that read and write the pool and the device bookkeeping.
  LayerPipeline pipeline_;
};

}  // namespace infinigen
