// offload: a generation request run by the offloading runtime: the memory plan first, then the
// weights placed between device and host, then the layer pipeline with the chosen KV policy.
#pragma once

#include <cstddef>
#include <string>

#include "core/generation.h"
#include "core/model_loader.h"
#include "core/trace.h"
#include "offload/memory_planner.h"
#include "offload/offload_options.h"
#include "offload/offload_stats.h"
#include "offload/transfer_engine.h"

namespace infinigen {

// Positions per (layer, sequence, head) that `limit` leaves for `capacity` tokens; 0 = no limit.
// A run that keeps a session (`session`) is capped on every turn, even one whose tokens would all
// fit: its state is the pool's positions, which a turn of token rows could not continue; at most
// capacity - 1 positions then, which evict nothing (the last generated token is never stored).
int64_t kv_pool_positions(double limit, const ModelConfig& config, int64_t batch, int64_t capacity,
                          DType kv_dtype, bool session = false);

// Whether every step of `policy` has an implementation on `device`: the dense ops of the model
// (ops::device_runs_transformer) and what the policy adds on the device (int4 dequantisation,
// h2o's scores, InfiniGen's speculation). On the CPU backend every policy runs.
bool policy_runs_on(const std::string& policy, Device device);

struct OffloadRun {
  GenerationResult result;
  SharedPrefixes shared_prefixes;  // the prompts' prefixes computed and kept once per group
  OffloadStats stats;
  MemoryPlan plan;
  TransferCounters totals;
};

// The memory request of a run (sizes only; capacities are filled by plan_offloaded_run), after
// checking the options that shape it (one-line Errors naming the option).
MemoryRequest offload_memory_request(const ModelConfig& config, int64_t batch, int64_t prompt_len,
                                     int64_t gen_len, DType kv_dtype,
                                     const OffloadOptions& options);
// Plans `memory` against what `device` and the host can give now (options.device_memory, when
// set, is the device's size). Throws the planner's one-line Error when it cannot fit.
MemoryPlan plan_offloaded_run(MemoryRequest memory, const OffloadOptions& options, Device device);
// `options` with the placements `plan` decided where they left them to the planner (auto).
OffloadOptions with_plan_placements(OffloadOptions options, const MemoryPlan& plan);
// When a run could pin only `pinned` bytes of host memory: the refusal of the plan with that as
// its pinned capacity, which names a configuration that fits in it (or the resource short).
std::string plan_within_pinned(MemoryRequest memory, const OffloadOptions& options, Device device,
                               size_t pinned);

// The trace (core/trace.h) of `request` on `device` with `options`, run dry: nothing is computed,
// copied or allocated, and no memory plan is checked (the caller plans against the hardware it
// asks about; OffloadOptions::dense_kv auto runs as the device). `replay` says what a policy that selects its loads (kv_policy(...).selects_loads)
// fetches; it is required for one.
// With a `conversation` (a DrySessionTurn, offload/session.h), the turn continues it.
Trace dry_run_trace(const ModelConfig& config, const GenerationRequest& request,
                    const OffloadOptions& options, Device device, const FetchReplay* replay,
                    Conversation* conversation = nullptr);

// Plans memory for `request` (throws a one-line Error with a configuration that would fit when it
// cannot), loads the weights with their placement, and generates.
// With a `conversation`, the run continues it (core/generation.h): request.prompts are what
// follows each sequence's history, and the plan covers history and prompt.
OffloadRun run_offloaded(const ModelSource& source, const GenerationRequest& request,
                         const OffloadOptions& options, Device device,
                         const ProgressCallback& progress = {},
                         Conversation* conversation = nullptr);

}  // namespace infinigen
