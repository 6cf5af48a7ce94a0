// offload: the `infinigen` policy: all KV in the host pool, and for every layer past the dense
// ones only the tokens that speculation expects to matter are loaded (InfiniGen, OSDI'24).
//
// It composes the paged pool with its staging and pipeline (offload/paged_kv.h), the partial key
// cache and speculation of each speculated layer (speculate/speculation.h), and under a pool limit
// the capped pool's positions and eviction (offload/capped_pool.h).
//
// A decode step of layer l (decode_layer): layer l + 1's selection is made from layer l's
// attention input, and its selected rows are gathered from the pool into layer l + 1's staging
// while layer l's attention runs; the new token goes after layer l's staged rows and into the
// pool and the partial key cache; attention waits for layer l's own load. With the row cache
// (InfinigenPlacement::row_cache, offload/row_cache.h) the selected rows the layer fetched at the
// step before are copied from it on the device instead of loaded, and once the load is done the
// staged selection becomes the cache. Staged rows are
// compact: for sequence b, rows [n' - take[b], n') hold its selected positions in order and row
// n' the new token; attention reads rows [n' - take[b], n' + 1) (the view's own first_valid).
// Dense layers (and every layer of an extension pass) load their whole KV a layer ahead, as
// `full` does, unless their KV is kept on the device (InfinigenPlacement: PagedKv's resident
// layers, written as they are computed, so a step loads none of it); under a pool limit they load
// every valid position the same compact way. When no layer loads its whole KV in a decode step,
// the staging shrinks after the prompt's passes to the rows a speculated layer stages
// (decode_staging_rows): at long context it is most of what the prompt needed on the device.
//
// On CUDA the partial state of the speculated layers moves to the device once the prompt's passes
// are done (offload/device_speculation.h): the selection is made there and the selected rows are
// gathered from the pool by a kernel that reads the positions where they were chosen; the host
// reads back each sequence's take (docs/cuda.md: the one host wait per speculated layer). The
// partial key cache of the last InfinigenPlacement::partial_key_host_layers speculated layers
// moves to mapped pinned host memory instead, where the speculation kernels read it over the link
// (its bytes count as the layer's loads; a dry run records the read as a transfer the
// speculation waits for).
#pragma once

#include <array>
#include <optional>
#include <vector>

#include "core/kv_cache.h"
#include "offload/capped_pool.h"
#include "offload/device_speculation.h"
#include "offload/offload_options.h"
#include "offload/paged_kv.h"
#include "offload/row_cache.h"
#include "speculate/speculation.h"

namespace infinigen {

struct KvPolicy;
const KvPolicy& infinigen_kv_policy();  // its entry (offload/kv_policy.h)


// Where the store keeps what it may keep on the device or in host memory (the memory plan's
// placements, offload/memory_planner.h).
struct InfinigenPlacement {
  // The first layers whose whole KV stays on the device (PagedKv's resident layers: the dense
  // ones, or none; resident_dense_layers), and how many speculated layers, the last ones, keep
  // their partial keys in host memory.
  int64_t resident_layers = 0;
  int64_t partial_key_host_layers = 0;
  // Whether each speculated layer keeps the rows it fetched at the step before on the device
  // (offload/row_cache.h; OffloadOptions::row_cache as the plan decided it). Not with a capped
  // pool.
  bool row_cache = false;
};

// Rows per (sequence, KV head) of the staging once the prompt's passes are done (of a store of
// `capacity` tokens, `dense_layers` dense ones, `resident_layers` of them kept on the device):
// a speculated layer's staged rows and its new token (fetch_cap + 1) when no layer loads its
// whole KV in a decode step, else `capacity`. A capped pool keeps its staging: its dense layers
// load every position it keeps.
int64_t decode_staging_rows(int64_t capacity, int64_t fetch_cap, int64_t dense_layers,
                            int64_t resident_layers, bool capped);

class InfinigenKv : public KvStore {
 public:
  InfinigenKv(const ModelConfig& config, int64_t batch, int64_t capacity, DType kv_dtype,
              Device device, int64_t block_tokens, TransferEngine& engine, OffloadStats& stats,
              const SpeculationOptions& options, bool check_recall, const KvPoolLimit& limit = {},
              const FetchReplay* replay = nullptr, const InfinigenPlacement& placement = {});

  // A capped pool keeps positions, not tokens: nothing to share there.
  bool can_share_prefix() const override { return !capped_; }
  void observe(int64_t layer, const AttentionInput& input) override;
  void append(int64_t layer, const Tensor& keys, const Tensor& values) override;
  View view(int64_t layer) override;
  void end_pass(int64_t n_new) override;
  void resume(int64_t length, std::vector<int32_t> first_valid, int64_t num_layers,
              LayerRestorer restore) override;
  std::vector<TokenStream> token_streams(int64_t layer) const override;
  const void* token_row(int64_t layer, size_t stream, int64_t b, int64_t h,
                        int64_t t) const override;
  LayerState layer_state(int64_t layer) const override;
  void restore_layer_state(int64_t layer, const LayerState& state) override;
  // A capped pool keeps positions, not tokens: it is saved as its layers' state at every turn's
  // end, as H2O is (KvStore::saves_state_each_turn).
  bool saves_state_each_turn() const override { return capped_.has_value(); }
  // A speculated layer's partial keys of the moved rows, from their rotated keys.
  void rederive_rows(int64_t layer, int64_t b, int64_t from, int64_t count) override;
  // Sequences leave the batch with their pool blocks, partial keys (on the host or the device)
  // and a capped pool's eviction state compacted (KvStore::drop_sequences), except where the
  // survivors' fetches depend on them: under --fetch-rule batch (n' is the mean over every
  // sequence's rows).
  bool can_drop_sequences() const override { return options_.fetch_rule == FetchRule::Sequence; }
  // On CUDA, also copies each speculated layer's partial key cache from the device to the host,
  // where token_row reads it for a session's save.
  void finish_stores() override;
  void allocate_all() override { paged_.pool().reserve(paged_.pool().shape().max_tokens); }

  // Inspection (tests): a speculated layer's partial state, and the token at a pool position
  // of (b, h) (the position itself without a pool limit; -1 when empty).
  const PartialLayer& partial(int64_t layer) const { return partial_[static_cast<size_t>(layer)]; }
  int32_t token_at(int64_t layer, int64_t b, int64_t h, int64_t position) const;
  const KvPool& pool() const { return paged_.pool(); }
  int64_t staging_rows() const { return paged_.pipeline().staging_rows(); }
  bool uses_row_cache() const { return use_row_cache_; }
  // The capped pool's positions and eviction state (null without a pool limit).
  const CappedPool* capped_pool() const { return capped_ ? &*capped_ : nullptr; }

 protected:
  // Who loads what, and when: layer 0 before the embedding and layer l + 1 while layer l
  // computes, for the layers loaded whole; a speculated layer from decode_layer(l - 1), once its
  // selection is known.
  void start_pass(int64_t n_new) override;
  void start_layer(int64_t layer) override;
  void keep_sequences(const std::vector<int64_t>& keep,
                      const std::vector<LeaderMove>& moves) override;

 private:
  bool dense(int64_t layer) const { return layer < options_.dense_layers; }
  // Whether a speculated layer's partial key cache is in host memory (InfinigenPlacement).
  bool partial_keys_on_host(int64_t layer) const {
    return !dense(layer) && layer >= num_layers_ - placement_.partial_key_host_layers;
  }
  // A decode step's read of layer `layer`'s partial keys in host memory over positions [0, used):
  // counted as the layer's loads, and in a dry run recorded as a transfer speculation waits for.
  void read_host_partial_keys(int64_t layer, int64_t used);
  // Whether layer `layer` loads what speculation selects (else it loads every entry).
  bool speculated(int64_t layer) const { return !extending() && !dense(layer); }
  // Compact views are used by speculated layers, and by every layer under a pool limit.
  // An extension (a resumed turn's first pass) loads every layer whole, as a prefill attends
  // to everything: from the pool, or under a pool limit every held position, staged on the host
  // (extend_capped_pool).
  bool compact(int64_t layer) const { return capped_ || (!extending() && !dense(layer)); }
  bool capped_extension() const { return capped_ && extending(); }
  int64_t used_positions() const { return capped_ ? capped_->used(length()) : length(); }

  // A pass of the prompt (of a run that did not resume a conversation): its rows into the pool,
  // and the column rule of each speculated layer; after the prompt's last pass, the layer's
  // partial state.
  void prompt_layer(int64_t layer, const Tensor& keys, const Tensor& values);
  // Every stored token's partial key of layer `layer`, once its columns are chosen: the prompt's
  // earlier passes' from the pool, this pass's from its keys (B * n, H_kv * d).
  void write_prompt_partial_keys(int64_t layer, const Tensor& keys);
  // One decode step of a layer whose view is compact, top to bottom (see the file comment).
  void decode_layer(int64_t layer, const Tensor& keys, const Tensor& values);
  // Starts loading every entry of layer `layer`.
  void load_whole(int64_t layer);
  // Speculates layer `layer` from the previous layer's attention input `x` (B, D), the new
  // tokens at rotary positions `positions` (B), and starts loading what it selects.
  void select_and_load(int64_t layer, const Tensor& x, const std::vector<int32_t>& positions);
  // Starts loading selection_[layer]'s rows into the layer's staging, compact.
  void load_selection(int64_t layer);
  // The tokens selection_[layer] fetches and those the pool holds, into this step's traffic.
  void count_traffic(int64_t layer);
  // How many of the first selected rows of (sequence b, KV head h), which takes `take` rows, a
  // dry run serves from the row cache, which holds `cached` rows of it (FetchReplay::cached).
  int64_t replayed_hits(int64_t layer, int64_t b, int64_t h, int64_t take, int64_t cached) const;
  // Of selection_[layer]'s rows, those `previous` (the layer's selection at the step before)
  // also fetched, into this step's traffic (LayerTraffic::tokens_fetched_again).
  void count_fetched_again(int64_t layer, const PartialLayer::Selection& previous);
  // Under a pool limit, the prompt's kept tokens of every (sequence, head) into the pool.
  void store_prompt_in_capped_pool(int64_t layer, const Tensor& keys, const Tensor& values);
  // Under a pool limit, a resumed conversation's first pass of layer `layer`, on the host: each
  // (sequence, head)'s held positions staged just before the pass's new tokens (over the pass's
  // rows of history the pool holds already), the view over them, and the tokens the pool keeps
  // after the pass (keep_extension_tokens: the pass's attention counts as fetches) into the
  // positions of those it evicts, then the free ones, with their partial keys.
  void extend_capped_pool(int64_t layer, const Tensor& keys, const Tensor& values);
  // A capped pool's layer state (layer_state, restore_layer_state): every held position's K and
  // V rows, token and eviction record (CappedPool::save); the partial keys are derived from the
  // keys again at restore.
  LayerState capped_layer_state(int64_t layer) const;
  void restore_capped_layer(int64_t layer, const LayerState& state);
  // What a dry run's selection of layer `layer` takes per sequence (FetchReplay).
  std::vector<int32_t> replayed_take(int64_t layer) const;
  // Share of the layer's attention weight over the pool that the staged rows carry.
  double measure_recall(int64_t layer);
  // selection_[layer] as prompt tokens, into the statistics (OffloadStats::first_selection).
  void record_first_selection(int64_t layer);

  SpeculationOptions options_;
  InfinigenPlacement placement_;
  OffloadStats& stats_;
  bool check_recall_;
  const FetchReplay* replay_;  // what a dry run fetches (core/trace.h); null otherwise
  int64_t num_layers_;
  int64_t prompt_tokens_ = 0;  // tokens per sequence of the prompt: decode step = length -
                               // prompt_tokens + 1
  std::vector<int64_t> pass_sequences_;  // the open prompt pass's sequences (pass_sequence)
  int64_t head_dim_;
  int64_t heads_;     // H: query heads
  int64_t kv_heads_;  // H_kv: heads of the pool, the selection and the eviction rows
  int64_t slots_;     // pool positions per (layer, sequence, KV head)
  int64_t hidden_;    // D: the width of the attention input speculation projects
  DType weight_dtype_;
  bool rotary_;
  std::vector<PartialLayer> partial_;  // per layer (unused for dense layers)
  std::optional<CappedPool> capped_;   // under a pool limit
  // (B) under a pool limit, in a resumed turn: the row after each sequence's history (the pass's
  // rows before it are history the pool holds already, not new tokens).
  std::vector<int32_t> history_end_;
  // Between observe and append: the layer's attention input (its input, scaled queries, query
  // projection, rotation and skew).
  std::optional<AttentionInput> input_;
  std::vector<PartialLayer::Selection> selection_;  // per layer: this step's selection
  std::vector<int32_t> compact_first_valid_;        // (B): left padding of the staged rows
  // Per layer parity: rows of a shared prefix that several sequences selected, loaded once into
  // the first one's staging row and copied on the device to the others' once the load is done.
  std::array<std::vector<CopyChunk>, 2> shared_row_copies_;
  // The rows each speculated layer fetched at the step before, on the device (uncapped pool,
  // InfinigenPlacement::row_cache; allocated once the prompt's passes are done). Per layer
  // parity: this step's copies of the selected rows it holds into the staging, made once the
  // load is done and before the shared prefix's copies (which may read them).
  bool use_row_cache_ = false;
  RowCache row_cache_;
  std::array<std::vector<CopyChunk>, 2> row_cache_copies_;
  // Speculation, selection and gather on the CUDA device (not in a dry run, whose selections
  // are replayed on the host).
  std::optional<DeviceSpeculation> device_;
  bool uploaded_ = false;  // the speculated layers' partial state is on the device (end_pass)
  // Per layer, once uploaded: the device's partial key cache (B, H_kv, slots, r) as of the last
  // finish_stores, which a session's save reads (the device appends the decode steps' tokens to
  // its own, at positions the save reads only after the next finish_stores). Each copy brings
  // the positions from host_partial_keys_from_ on: the save's writer thread may still read those
  // before it.
  std::vector<std::vector<char>> host_partial_keys_;
  int64_t host_partial_keys_from_ = 0;
  View view_{};        // the open decode step's view of the layer decode_layer prepared
  PagedKv paged_;      // last: transfers read the buffers above until it is destroyed
};

}  // namespace infinigen
