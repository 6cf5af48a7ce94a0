// offload: what a run's statistics add up to: means over the decode steps and totals, as the
// CLI reports them and the benchmarks record them.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "offload/runtime.h"

namespace infinigen {

// Means over the decode steps (steps[1:]) and totals.
struct TransferSummary {
  int64_t decode_steps = 0;
  double h2d_bytes_per_step = 0;
  double d2h_bytes_per_step = 0;
  // Loads, in seconds per decode step. A load's transfer time runs from its start on the load
  // stream to its end, not counting the time it sat queued behind other loads or waited for its
  // inputs (the speculation that chose its rows, say); compute's wait on loads counts from when
  // compute needed them to when they had arrived, so it holds both a load's transfer and any
  // time before that load began, and it can be longer than all the transfers together.
  //   load_busy = load_hidden + load_exposed: transfer time under compute, and transfer time
  //     compute waited through (per step, at most the step's wait);
  //   load_wait = load_exposed + the rest, compute waiting for loads that had not begun.
  double load_busy_per_step = 0;    // the load stream transferring
  double load_wait_per_step = 0;    // compute waiting for loads
  double load_hidden_per_step = 0;  // transfer time overlapped with compute
  double hidden_fraction = 0;       // load_hidden / load_busy (0 without loads)
  // The parts of a step's transfer and of its wait above.
  double load_exposed_per_step() const { return load_busy_per_step - load_hidden_per_step; }
  double load_wait_before_start_per_step() const {
    return std::max(0.0, load_wait_per_step - load_exposed_per_step());  // no rounding's -0.00
  }
  uint64_t host_kv_bytes = 0;  // the host pool after the last step (`full` pools)
  // Shared prompt prefixes (core/shared_prefixes.h): their tokens, each kept once, how many
  // there are, and the sequences that read them.
  int64_t shared_prefix_tokens = 0;
  int64_t shared_prefix_groups = 0;
  int64_t shared_prefix_sequences = 0;
  uint64_t prefill_h2d_bytes = 0;
  uint64_t prefill_d2h_bytes = 0;
  uint64_t total_h2d_bytes = 0;
  uint64_t total_d2h_bytes = 0;
  double fetched_fraction = 0;   // KV rows loaded / rows stored, decode steps, all layers
  double mean_recall = -1;       // over measured layers and steps (-1: not measured)
  double min_layer_recall = -1;  // the worst layer's mean recall
  // Of the rows speculated layers fetched, the share the same (sequence, KV head) had fetched at
  // the step before (LayerTraffic::tokens_fetched_again; -1: not known).
  double fetched_again_fraction = -1;
  // Of the same rows, the share copied from the device's row cache instead of loaded
  // (LayerTraffic::tokens_from_row_cache; -1: not known, 0: no cache).
  double row_cache_fraction = -1;
  // Per layer, over the decode steps: fetched_again_fraction of that layer (0 where not known).
  std::vector<double> layer_fetched_again_fraction;
  // Per layer, over the decode steps: KV rows loaded / rows stored (1 for full loads).
  std::vector<double> layer_fetched_fraction;
  // Per layer, over the decode steps: mean seconds compute waited for that layer's loads.
  std::vector<double> layer_load_wait;
  double median_step_seconds = 0;  // median wall time of a decode step
  // Device and pinned allocations plus frees made inside the decode steps, all of them together
  // (StepStats::allocations, frees): 0 when the steps run in buffers allocated beforehand.
  uint64_t decode_step_allocations_and_frees = 0;
};

TransferSummary summarize(const OffloadRun& run);

}  // namespace infinigen
