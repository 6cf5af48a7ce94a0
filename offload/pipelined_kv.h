// offload: the layer pipeline every offloading KV policy shares (FlexGen's schedule). A decode
// pass starts loading layer 0's KV before the embedding; while layer l computes, layer l + 1's
// load fills the other staging buffer; attention waits for its own layer's load (on the compute
// stream: on CUDA the host runs on), and the wait is counted in the step's statistics. The
// prefill ends with the store stream drained, because its stores read staging buffers the first
// decode loads overwrite.
//
// A policy says what a layer's load is (issue_load, which sets loaded_[layer]) and what its view
// returns; its appends and stores set stored_[layer], which the next step's load of that layer
// waits for. Every transfer follows the compute enqueued before it (offload/transfer_engine.h),
// so a load never overwrites staging that attention still reads. Derived destructors must
// synchronise the engine before freeing what transfers read.
#pragma once

#include <cstdint>
#include <vector>

#include "core/kv_cache.h"
#include "offload/offload_stats.h"
#include "offload/transfer_engine.h"

namespace infinigen {

class PipelinedKv : public KvStore {
 public:
  PipelinedKv(int64_t batch, int64_t capacity, int64_t num_layers, TransferEngine& engine,
              OffloadStats& stats);

  void start_pass(int64_t n_new) override;
  void start_layer(int64_t layer) override;
  void end_pass(int64_t n_new) override;

 protected:
  // Starts moving what layer `layer`'s attention reads this decode step; sets loaded_[layer].
  virtual void issue_load(int64_t layer) = 0;
  // Waits for this step's load of `layer`, adding the wait to the step's statistics.
  void wait_for_load(int64_t layer);

  int64_t num_layers_;
  TransferEngine& engine_;
  OffloadStats& stats_;
  std::vector<EventPtr> loaded_;  // per layer: this step's load
  std::vector<EventPtr> stored_;  // per layer: latest store into the pool
};

}  // namespace infinigen
