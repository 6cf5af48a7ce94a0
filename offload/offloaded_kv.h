// offload: the `full` policy (FlexGen): all KV in the host pool, each layer's whole KV loaded into
// a device staging buffer while the previous layer computes.
//
// Device buffers: staging K and V (B, H, capacity, d) in the KV dtype, double-buffered by layer
// parity: layer l's attention reads staging[l % 2] while layer l + 1's load fills the other.
// The new token's K and V go into the staging row `length` (for this step's attention) and into
// a small store buffer (B, H, 1, d), from which the store stream copies them to the pool.
// Ordering, all by events (no device-wide synchronisation): the load of layer l waits for the
// previous step's store of layer l; reusing a buffer waits for the transfer that last read it.
#pragma once

#include <array>
#include <vector>

#include "core/kv_cache.h"
#include "offload/kv_pool.h"
#include "offload/offload_stats.h"
#include "offload/pipelined_kv.h"
#include "offload/transfer_engine.h"

namespace infinigen {

struct KvPolicy;
// The entries of `full` and `gpu` (offload/kv_policy.h).
const KvPolicy& full_kv_policy();
const KvPolicy& gpu_kv_policy();

class OffloadedKv : public PipelinedKv {
 public:
  // `pool_tokens`: positions per (layer, sequence, head) in the host pool; 0 = capacity.
  OffloadedKv(const ModelConfig& config, int64_t batch, int64_t capacity, DType kv_dtype,
              Device device, int64_t block_tokens, TransferEngine& engine, OffloadStats& stats,
              int64_t pool_tokens = 0);
  ~OffloadedKv() override;

  bool can_share_prefix() const override { return true; }
  void append(int64_t layer, const Tensor& keys, const Tensor& values) override;
  View view(int64_t layer) override;
  void end_pass(int64_t n_new) override;
  void resume(int64_t length, std::vector<int32_t> first_valid, int64_t num_layers,
              LayerRestorer restore) override;
  std::vector<TokenStream> token_streams(int64_t layer) const override;
  const void* token_row(int64_t layer, size_t stream, int64_t b, int64_t h,
                        int64_t t) const override;
  void finish_stores() override { engine_.synchronize_stores(); }
  void allocate_all() override { pool_.reserve(pool_.shape().max_tokens); }

  const KvPool& pool() const { return pool_; }

 protected:
  // Starts loading what layer `layer`'s attention reads this step (the whole layer here).
  void issue_load(int64_t layer) override;
  // Decode: copies the new token's rows (B, H * d) into the layer's store buffer and enqueues
  // their store into the pool at token length().
  void store_new_token(int64_t layer, const Tensor& keys, const Tensor& values);
  // The sharing pass: the groups' prefixes, in their leaders' rows of staging[layer % 2], into
  // the pool's shared blocks.
  void store_shared_prefixes(int64_t layer);
  // Enqueues a store of `chunks` into the pool as layer `layer`'s latest (stored_), counted in
  // the step's device->host bytes.
  void submit_store(int64_t layer, std::vector<CopyChunk> chunks);
  // Stores rows [row0, row0 + n) of src K/V buffers (B, H, src_capacity, d) into the pool at
  // tokens [length(), length() + n).
  void issue_store(int64_t layer, const Tensor& keys, const Tensor& values, int64_t row0,
                   int64_t n);

  KvPool pool_;
  std::array<Tensor, 2> staging_keys_, staging_values_;  // (B, H, capacity, d) by layer parity
  std::array<Tensor, 2> store_keys_, store_values_;      // (B, H, 1, d) by layer parity
  // Per store buffer: the store that last read it (of this step or, for the first layers, of
  // the previous step's last layers). Writing the buffer waits for it.
  std::array<EventPtr, 2> store_buffer_read_ = {completed_event(), completed_event()};
};

// The `gpu` policy: every layer's KV resident on the device (only when it fits), with the same
// per-step statistics as the offloading policies.
class ResidentKv : public KvCache {
 public:
  ResidentKv(const ModelConfig& config, int64_t batch, int64_t capacity, DType kv_dtype,
             Device device, TransferEngine& engine, OffloadStats& stats);
  void start_pass(int64_t n_new) override;
  void end_pass(int64_t n_new) override;

 private:
  int64_t num_layers_;
  TransferEngine& engine_;
  OffloadStats& stats_;
};

}  // namespace infinigen
