// offload: what the runtime measured, per decode step and per layer.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "core/device.h"
#include "offload/transfer_engine.h"

namespace infinigen {

struct LayerTraffic {
  uint64_t kv_h2d_bytes = 0;      // KV loaded for this layer
  uint64_t kv_d2h_bytes = 0;      // new KV stored from this layer
  uint64_t weight_h2d_bytes = 0;  // streamed weights of this layer
  double load_wait_seconds = 0;   // compute stalled waiting for this layer's loads
  // (sequence, head, token) rows attention read from the device, padding excluded: loaded this
  // step, or resident there (a layer whose KV stays on the device, offload/paged_kv.h).
  uint64_t tokens_fetched = 0;
  uint64_t tokens_stored = 0;  // rows the pool held for this layer, padding excluded
  // Of tokens_fetched, the rows the same (sequence, KV head) also fetched at the previous step:
  // what a device cache of the last step's rows would not move again. -1: not known (a layer
  // that does not select, the first decode step, selections kept on the device).
  int64_t tokens_fetched_again = -1;
  // Of tokens_fetched, the rows copied from the device's row cache instead of loaded
  // (OffloadOptions::row_cache): kv_h2d_bytes leaves out their K and V.
  uint64_t tokens_from_row_cache = 0;
  double recall = -1.0;        // share of full attention weight on the fetched rows (-1: n/a)
};

struct StepStats {
  double seconds = 0.0;  // wall time of the step (prefill: the prompt pass)
  uint64_t h2d_bytes = 0;
  uint64_t d2h_bytes = 0;
  double load_busy_seconds = 0.0;  // time the load stream spent transferring
  double store_busy_seconds = 0.0;
  double load_wait_seconds = 0.0;  // compute stalled on loads: transfer that was not hidden
  uint64_t host_kv_bytes = 0;      // KV bytes the host pool holds after the step (`full` pools)
  // Device and pinned allocations, and frees, made between begin_step and end_step by any thread
  // (core/device.h's allocation_counts): a decode step should make none.
  uint64_t allocations = 0;
  uint64_t frees = 0;
  std::vector<LayerTraffic> layers;
  // Transfer time that overlapped compute (never negative).
  double hidden_load_seconds() const;
};

// A capped host KV pool (--kv-pool-limit, offload/capped_pool.h): its size, and the tokens its
// rows dropped, each (layer, sequence, KV head) row counted on its own.
struct PoolCapStats {
  int64_t positions = 0;         // per (layer, sequence, KV head); 0: the pool is not capped
  uint64_t bytes = 0;            // the pinned pool holding them (K and V, every layer)
  uint64_t evictions = 0;        // decode tokens stored over a kept token (the policy's victim)
  uint64_t prompt_not_kept = 0;  // valid prompt tokens a row did not keep
  // One line for a report: the cap, its bytes and the evictions.
  std::string describe() const;
};

// The tokens a speculated layer selected at the first decode step (a diagnostic of runs that
// check recall, OffloadOptions::check_recall: `eval --task passkey` asks whether the needle was
// among them). Tokens are indexed in each sequence's prompt: its shared prefix first, then its
// own tokens, padding not counted.
struct FirstSelection {
  int64_t kv_heads = 0;
  // (B * H_kv): row b * H_kv + g, the tokens KV head g of sequence b selected, ascending.
  std::vector<std::vector<int32_t>> tokens;
  // Whether some KV head of sequence b selected prompt token j.
  bool selected(int64_t b, int32_t j) const;
};

// Everything a run measured: steps[0] is the prefill, then one entry per decode step.
class OffloadStats {
 public:
  // Opens a step; `counters` are the transfer engine's totals now. The previous step's stream
  // busy time is settled first (settle_transfers).
  void begin_step(int64_t num_layers, const TransferCounters& counters);
  // Closes it: wall time, allocations and frees since begin_step, and the stream busy time of
  // the transfers that have completed by now.
  void end_step(const TransferCounters& counters);
  // Gives the last step the busy time of every transfer that completed since it began. The host
  // closes a step once it has enqueued the step's work, on CUDA well before the device has run
  // it: the transfers that complete after end_step belong to the step all the same. Called when
  // the next step opens and once at the end of the run (after the transfers have completed).
  void settle_transfers(const TransferCounters& counters);
  StepStats& current() { return steps_.back(); }
  const std::vector<StepStats>& steps() const { return steps_; }
  // The capped pool's, written by the capped pool (every batch of a run adds its evictions).
  PoolCapStats& pool_cap() { return pool_cap_; }
  const PoolCapStats& pool_cap() const { return pool_cap_; }
  // Per layer: its first decode step's selection (FirstSelection); empty for layers that
  // selected nothing then (dense layers, runs that do not check recall).
  std::vector<FirstSelection>& first_selection() { return first_selection_; }
  const std::vector<FirstSelection>& first_selection() const { return first_selection_; }

 private:
  std::vector<FirstSelection> first_selection_;
  std::vector<StepStats> steps_;
  PoolCapStats pool_cap_;
  TransferCounters counters_at_start_;
  AllocationCounts allocations_at_start_;
  std::chrono::steady_clock::time_point start_;
};

}  // namespace infinigen
