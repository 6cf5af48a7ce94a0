// offload: the paged host pool with its device staging and layer pipeline: the whole of `full`
// (FlexGen), and where `infinigen` keeps its KV (its dense layers load and its prompt is stored
// the same way).
//
// Host: the pool (offload/kv_pool.h), pinned, in blocks. Device: the pipeline's staging K and V
// (B, H, capacity, d) in the KV dtype by layer parity (offload/layer_pipeline.h), and a token
// buffer K and V (B, H, 1, d) by parity, from which the store stream copies a decode step's new
// rows into the pool while attention runs.
//
// A whole layer's load is one chunk per (K/V, sequence, head, run of blocks); a shared prefix's
// blocks come once, into its group leader's rows, which every member reads. Stores: the prompt's
// rows from staging (its attention read the fresh rows; staging only carries them), a decode
// step's token from the token buffer, an extension's rows from staging.
//
// Resident layers (the first `resident_layers`; InfiniGen's dense layers when their KV is placed
// on the device) keep their whole K and V (B, H, capacity, d) on the device for the store's life,
// in the staging's layout: every pass writes its rows there (a shared prefix's into its group
// leader's rows) and stores them to the pool from there, as the pool is what sessions save and
// read. A load of a resident layer brings only rows it does not hold yet (all of them once after
// a conversation is resumed into the pool, none afterwards).
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <vector>

#include "core/kv_cache.h"
#include "core/model_config.h"
#include "offload/kv_pool.h"
#include "offload/layer_pipeline.h"
#include "offload/offload_stats.h"
#include "offload/transfer_engine.h"

namespace infinigen {

// A row of a device buffer (B, H, rows, d) stored at a pool position: row `from` of (b, h) to
// position `to` of (b, h).
struct PoolRowMove {
  int64_t b = 0;
  int64_t h = 0;
  int64_t from = 0;
  int64_t to = 0;
};

class PagedKv {
 public:
  // `store`: the KvStore that owns this (its length, padding and shared prefixes are read).
  // `pool_tokens`: positions per (layer, sequence, head) in the pool; 0 = capacity.
  // `resident_layers`: layers [0, resident_layers) kept on the device (needs pool_tokens 0).
  PagedKv(const KvStore& store, const ModelConfig& config, DType kv_dtype, Device device,
          int64_t block_tokens, TransferEngine& engine, OffloadStats& stats,
          int64_t pool_tokens = 0, int64_t resident_layers = 0);

  KvPool& pool() { return pool_; }
  const KvPool& pool() const { return pool_; }
  LayerPipeline& pipeline() { return pipeline_; }
  const LayerPipeline& pipeline() const { return pipeline_; }
  bool resident(int64_t layer) const { return layer < resident_layers(); }
  int64_t resident_layers() const { return std::ssize(resident_keys_); }
  // Where layer `layer`'s attention reads its KV, (B, H, capacity, d): its resident buffers, or
  // the staging of its parity.
  Tensor& keys_of(int64_t layer);
  Tensor& values_of(int64_t layer);

  // Starts loading every stored row of layer `layer` into its staging, at the rows of their
  // tokens (a resident layer: the rows it does not hold yet).
  void load_layer(int64_t layer);
  // The pass's new rows of `layer`, (pass_batch() * n, H * d) fp32: the prompt's into the pool;
  // a decode step's or an extension's into the layer's staging at row length() (attention reads
  // them there) and into the pool.
  void append(int64_t layer, const Tensor& keys, const Tensor& values);
  // Decode: the new token's rows (B, H * d) into the token buffer and from there into the pool at
  // token length().
  void store_token(int64_t layer, const Tensor& keys, const Tensor& values);
  // Decode: the new token's rows (B, H * d) through the token buffer into the pool at position
  // at[b * H + h] of each (b, h), after `after` (the old rows there may be among a load's).
  void store_token_at(int64_t layer, const Tensor& keys, const Tensor& values,
                      const std::vector<int32_t>& at, EventPtr after);
  // Rows of layer `layer`'s staging into pool positions, one move each.
  void store_staged_rows(int64_t layer, std::span<const PoolRowMove> moves);
  // Layer `layer`'s staging with its whole KV (load_layer's), once its load has landed.
  KvStore::View view(int64_t layer);

  void start_pass() { pipeline_.start_pass(store_); }
  // Before KvStore::end_pass: every block the run can fill is pinned before the first decode
  // step (no step allocates), and the step closes.
  void end_pass();
  // The store's drop_sequences (KvStore::keep_sequences): the stores in flight landed, the pool's
  // tables, the staging and token buffers narrowed, the resident layers compacted (a dropped
  // group leader's prefix rows moved to its new leader).
  void keep_sequences(const std::vector<int64_t>& keep,
                      const std::vector<KvStore::LeaderMove>& moves);
  // A resumed conversation of `length` tokens: its shared prefixes' blocks and its rows.
  void resume(int64_t length);
  std::vector<KvStore::TokenStream> token_streams() const;
  const void* token_row(int64_t layer, size_t stream, int64_t b, int64_t h, int64_t t) const;

 private:
  // Stores rows [row0, row0 + n) of the device K/V buffers (B, H, src_capacity, d) into the
  // pool at tokens [length(), length() + n).
  void store_rows(int64_t layer, const Tensor& keys, const Tensor& values, int64_t row0,
                  int64_t n);
  // Checks that layer `layer`'s staging holds every row (it was not shrunk after the prompt,
  // LayerPipeline::resize_staging).
  void expect_whole_staging(int64_t layer) const;
  // The sharing pass: the groups' prefixes, in their leaders' rows of the layer's staging, into
  // the pool's shared blocks.
  void store_shared_prefixes(int64_t layer);
  // Rows `from` of (b, h) of device buffers (B, H, rows, d) to pool positions `to`.
  std::vector<CopyChunk> row_chunks(int64_t layer, const Tensor& keys, const Tensor& values,
                                    std::span<const PoolRowMove> moves);

  const KvStore& store_;
  KvPool pool_;
  std::array<Tensor, 2> token_keys_, token_values_;  // (B, H, 1, d) by layer parity
  // Per resident layer: its K and V (B, H, capacity, d), and the rows [0, n) they hold.
  std::vector<Tensor> resident_keys_, resident_values_;
  std::vector<int64_t> resident_rows_;
  LayerPipeline pipeline_;  // last: its destructor waits for transfers reading the buffers above
};

}  // namespace infinigen
