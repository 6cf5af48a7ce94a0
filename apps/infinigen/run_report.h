// apps/infinigen: how `infinigen run` reports what the offloading runtime measured.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>

#include "offload/runtime.h"

namespace infinigen::cli {

// Means over the decode steps (steps[1:]) and totals.
struct TransferSummary {
  int64_t decode_steps = 0;
  double h2d_bytes_per_step = 0;
  double d2h_bytes_per_step = 0;
  double load_busy_per_step = 0;  // seconds the load stream was transferring
  double load_wait_per_step = 0;  // seconds compute waited on loads
  double hidden_fraction = 0;     // share of load time overlapped with compute
  uint64_t prefill_h2d_bytes = 0;
  uint64_t prefill_d2h_bytes = 0;
  uint64_t total_h2d_bytes = 0;
  uint64_t total_d2h_bytes = 0;
  double fetched_fraction = 0;   // KV rows loaded / rows stored, decode steps, all layers
  double mean_recall = -1;       // over measured layers and steps (-1: not measured)
  double min_layer_recall = -1;  // the worst layer's mean recall
};

TransferSummary summarize(const OffloadRun& run);
nlohmann::json transfers_json(const TransferSummary& summary);
nlohmann::json plan_json(const MemoryPlan& plan);
nlohmann::json steps_json(const OffloadStats& stats);
// Lines for the text report; the per-layer table when `per_layer`.
void print_transfers(const TransferSummary& summary, const OffloadRun& run, bool per_layer);

}  // namespace infinigen::cli
