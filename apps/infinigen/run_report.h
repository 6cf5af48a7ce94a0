// apps/infinigen: how `infinigen run` reports what the offloading runtime measured.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>

#include "core/op_profile.h"
#include "offload/run_summary.h"
#include "offload/runtime.h"

namespace infinigen::cli {

// A float option or setting as JSON: its shortest decimal (0.8, not 0.800000011920929).
nlohmann::json json_float(float value);
nlohmann::json transfers_json(const TransferSummary& summary);
nlohmann::json plan_json(const MemoryPlan& plan);
// A capped host pool's cap, bytes and evictions (--kv-pool-limit); null without a cap.
nlohmann::json pool_cap_json(const PoolCapStats& cap);
nlohmann::json steps_json(const OffloadStats& stats);
// Lines for the text report; the per-layer table when `per_layer`.
void print_transfers(const TransferSummary& summary, const OffloadRun& run, bool per_layer);
// --profile-ops: {"prefill": {...}, "decode": {...}}, each {"steps", "seconds", "ops": [{"name",
// "calls", "seconds"}]} (sums over the phase's steps, the largest first).
nlohmann::json op_profile_json(const OpProfile& profile);
// The same as text, per decode step and for the prefill.
void print_op_profile(const OpProfile& profile);

}  // namespace infinigen::cli
