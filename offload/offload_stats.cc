// offload: statistics helpers.
#include "offload/offload_stats.h"

#include <algorithm>
#include <cstdio>

#include "core/error.h"

namespace infinigen {

std::string PoolCapStats::describe() const {
  char mib[32];
  std::snprintf(mib, sizeof(mib), "%.2f", static_cast<double>(bytes) / (1024.0 * 1024.0));
  return cat(positions, " positions per sequence and head (", mib, " MiB); ", evictions,
             " evictions, ", prompt_not_kept,
             " prompt tokens not kept (rows of every layer, "
             "sequence and head)");
}

double StepStats::hidden_load_seconds() const {
  return std::max(0.0, load_busy_seconds - load_wait_seconds);
}

void OffloadStats::begin_step(int64_t num_layers, const TransferCounters& counters) {
  settle_transfers(counters);
  steps_.emplace_back();
  steps_.back().layers.resize(static_cast<size_t>(num_layers));
  counters_at_start_ = counters;
  start_ = std::chrono::steady_clock::now();
  // Last: the step's own bookkeeping above (its per-layer entries) is not the step's work.
  allocations_at_start_ = allocation_counts();
}

void OffloadStats::end_step(const TransferCounters& counters) {
  const AllocationCounts made = allocation_counts().since(allocations_at_start_);
  StepStats& step = steps_.back();
  step.allocations = made.allocs();
  step.frees = made.frees();
  step.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  settle_transfers(counters);
}

void OffloadStats::settle_transfers(const TransferCounters& counters) {
  if (steps_.empty()) return;
  StepStats& step = steps_.back();
  step.load_busy_seconds = counters.h2d_busy_seconds - counters_at_start_.h2d_busy_seconds;
  step.store_busy_seconds = counters.d2h_busy_seconds - counters_at_start_.d2h_busy_seconds;
}

bool FirstSelection::selected(int64_t b, int32_t j) const {
  for (int64_t g = 0; g < kv_heads; ++g) {
    const std::vector<int32_t>& row = tokens[static_cast<size_t>(b * kv_heads + g)];
    if (std::binary_search(row.begin(), row.end(), j)) return true;
  }
  return false;
}

}  // namespace infinigen
