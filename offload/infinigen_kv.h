// offload: the `infinigen` policy: all KV in the host pool, and for every layer past the dense
// ones only the tokens that speculation expects to matter are loaded (InfiniGen, OSDI'24).
//
// Layer l's selection is made while layer l - 1 runs (observe: its attention input is known),
// and the selected K/V rows are gathered from the pool into layer l's staging buffer while layer
// l - 1 finishes, so the load overlaps compute. Staged rows are compact: for sequence b, rows
// [n' - take[b], n') hold its selected positions in order and row n' the new token; attention
// reads rows [n' - take[b], n' + 1) (the view's own first_valid).
//
// With a pool limit of S positions per (layer, sequence, head) (--kv-pool-limit), the pool and
// the partial key cache are indexed by position, not token. A prompt longer than S keeps, per
// (sequence, head), the S tokens its eviction policy chooses from the prompt's attention, with
// the counters (or recencies) that attention gives them (speculate/prompt_keep.h); once a row is
// full each new token overwrites the victim the policy chooses (speculate/eviction.h) in the
// pool and in the partial key cache. Dense layers then load every valid position of their pool
// the same compact way; since they fetch everything, their fetch counts come from their true
// attention instead (the entries within alpha of the top logit).
#pragma once

#include <array>
#include <optional>
#include <vector>

#include "offload/offloaded_kv.h"
#include "speculate/eviction.h"
#include "speculate/speculation.h"

namespace infinigen {

struct KvPolicy;
const KvPolicy& infinigen_kv_policy();  // its entry (offload/kv_policy.h)

struct KvPoolLimit {
  int64_t positions = 0;  // per (layer, sequence, head); 0 = no limit
  EvictionPolicy eviction = EvictionPolicy::Counter;
};

class InfinigenKv : public OffloadedKv {
 public:
  InfinigenKv(const ModelConfig& config, int64_t batch, int64_t capacity, DType kv_dtype,
              Device device, int64_t block_tokens, TransferEngine& engine, OffloadStats& stats,
              const SpeculationOptions& options, bool check_recall, const KvPoolLimit& limit = {},
              const FetchReplay* replay = nullptr);

  // A capped pool keeps positions, not tokens: nothing to share there.
  bool can_share_prefix() const override { return !limited(); }
  void start_layer(int64_t layer) override;
  void observe(int64_t layer, const AttentionInput& input) override;
  void append(int64_t layer, const Tensor& keys, const Tensor& values) override;
  View view(int64_t layer) override;
  void resume(int64_t length, std::vector<int32_t> first_valid, int64_t num_layers,
              LayerRestorer restore) override;
  std::vector<TokenStream> token_streams(int64_t layer) const override;
  const void* token_row(int64_t layer, size_t stream, int64_t b, int64_t h,
                        int64_t t) const override;
  LayerState layer_state(int64_t layer) const override;
  void restore_layer_state(int64_t layer, const LayerState& state) override;

  // Inspection (tests): a speculated layer's partial state, and the token at a pool position
  // of (b, h) (the position itself without a pool limit; -1 when empty).
  const PartialLayer& partial(int64_t layer) const { return partial_[static_cast<size_t>(layer)]; }
  int32_t token_at(int64_t layer, int64_t b, int64_t h, int64_t position) const;

 protected:
  void issue_load(int64_t layer) override;

 private:
  bool dense(int64_t layer) const { return layer < options_.dense_layers; }
  bool limited() const { return slots_ < capacity(); }
  int64_t used_positions() const { return std::min(length(), slots_); }
  // Compact views are used by speculated layers, and by every layer under a pool limit.
  // An extension (a resumed turn's first pass) loads every layer whole, as a prefill attends
  // to everything.
  bool compact(int64_t layer) const { return !extending() && (limited() || !dense(layer)); }
  // Speculates layer `layer` from the previous layer's attention input `x` (B, D), the new
  // tokens at rotary positions `positions` (B), and enqueues the load of what it selects.
  void select_and_load(int64_t layer, const Tensor& x, const std::vector<int32_t>& positions);
  // Every valid position (dense layers under a pool limit).
  PartialLayer::Selection select_all(int64_t layer) const;
  void load_selection(int64_t layer);
  // Prefill under a pool limit: the kept prompt tokens of every (sequence, head) into the pool,
  // their positions and their eviction history.
  void store_prompt_in_capped_pool(int64_t layer, const Tensor& keys, const Tensor& values);
  // Under a pool limit, a dense layer's fetches for the eviction policy: the loaded entries
  // whose true attention logit is within alpha of the row's top.
  void count_dense_fetches(int64_t layer);
  // Pool positions for the new token per (sequence, head): length() until the pool is full,
  // then the eviction victims. Updates the bookkeeping.
  std::vector<int32_t> place_new_token(int64_t layer);
  // Share of the layer's attention weight over the pool that the staged rows carry.
  double measure_recall(int64_t layer) const;

  SpeculationOptions options_;
  bool check_recall_;
  const FetchReplay* replay_;  // what a dry run fetches (core/trace.h); null otherwise
  int64_t prompt_tokens_ = 0;  // tokens per sequence of the prefill: decode step = length -
                               // prompt_tokens + 1
  int64_t head_dim_;
  int64_t heads_;     // H: query heads
  int64_t kv_heads_;  // H_kv: heads of the pool, the selection and the eviction rows
  int64_t group_;     // H / H_kv query heads per KV head
  int64_t slots_;     // pool positions per (layer, sequence, KV head)
  int64_t hidden_;    // D: the width of the attention input speculation projects
  DType weight_dtype_;
  bool rotary_;
  std::vector<PartialLayer> partial_;  // per layer (unused for dense layers)
  // Between observe and append at prefill: the layer's attention input (its scaled queries,
  // query projection, rotation and skew).
  std::optional<AttentionInput> prefill_input_;
  Tensor decode_queries_;  // (B, H * d) of the current layer: recall, dense counters
  std::vector<PartialLayer::Selection> selection_;  // per layer: this step's selection
  std::vector<int32_t> compact_first_valid_;        // (B): left padding of the staged rows
  // Per layer parity: rows of a shared prefix that several sequences selected, loaded once into
  // the first one's staging row and copied on the device to the others' once the load is done.
  std::array<std::vector<CopyChunk>, 2> shared_row_copies_;
  // Under a pool limit: per layer, the token at each position ((B, H_kv, S), -1 empty), and the
  // eviction bookkeeping of the layer's B * H_kv rows.
  std::vector<std::vector<int32_t>> position_tokens_;
  std::vector<EvictionTable> eviction_;
};

}  // namespace infinigen
