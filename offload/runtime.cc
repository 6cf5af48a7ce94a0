// offload: the runtime's entry point.
#include "offload/runtime.h"

#include <algorithm>
#include <cmath>
#include <optional>

#include "core/interrupt.h"
#include "core/model.h"
#include "core/ops.h"
#include "core/model_loader.h"
#include "core/pin_ahead.h"
#include "core/sampler.h"
#include "offload/kv_policy.h"
#include "offload/streamed_weights.h"
#include "offload/weight_placement.h"

namespace infinigen {
namespace {

// Share of the measured capacities that a suggested configuration leaves free: MemAvailable
// moves by tens of MiB between one run and the next.
constexpr double kSuggestionMargin = 0.02;

}  // namespace

std::string plan_within_pinned(MemoryRequest memory, const OffloadOptions& options, Device device,
                               size_t pinned) {
  memory.pinned_capacity = pinned;
  try {
    plan_offloaded_run(memory, options, device);
  } catch (const Error& e) {
    return e.message();
  }
  return "yet the memory plan fits in that much: the plan undercounts what this run pins";
}

OffloadOptions with_plan_placements(OffloadOptions options, const MemoryPlan& plan) {
  if (plan.dense_kv) options.dense_kv = *plan.dense_kv;
  if (plan.partial_key_host_layers) options.partial_key_host_layers = *plan.partial_key_host_layers;
  if (plan.row_cache) options.row_cache = *plan.row_cache ? RowCacheUse::On : RowCacheUse::Off;
  return options;
}

bool policy_runs_on(const std::string& policy, Device device) {
  if (device == Device::Cpu) return true;
  return ops::device_runs_transformer(device) && kv_policy(policy).runs_on(device);
}

int64_t kv_pool_positions(double limit, const ModelConfig& config, int64_t batch, int64_t capacity,
                          DType kv_dtype, bool session) {
  INFINIGEN_CHECK(limit >= 0 && std::isfinite(limit), option("kv_pool_limit"),
                  " must be >= 0, got ", limit);
  if (limit == 0) return 0;
  const double per_position = 2.0 *
                              static_cast<double>(config.num_layers * batch * config.kv_dim()) *
                              static_cast<double>(dtype_size(kv_dtype));
  const double positions = limit <= 1.0 ? std::floor(limit * static_cast<double>(capacity))
                                        : std::floor(limit / per_position);
  INFINIGEN_CHECK(positions >= 2, option("kv_pool_limit"), " ", limit, " leaves ", positions,
                  " tokens per sequence and head in the pool; at least 2 are needed");
  const int64_t most = session ? std::max<int64_t>(2, capacity - 1) : capacity;
  return std::min<int64_t>(static_cast<int64_t>(positions), most);
}

MemoryRequest offload_memory_request(const ModelConfig& config, int64_t batch, int64_t prompt_len,
                                     int64_t gen_len, DType kv_dtype,
                                     const OffloadOptions& options) {
  options.validate();
  MemoryRequest memory;
  memory.config = config;
  memory.batch = batch;
  memory.prompt_len = prompt_len;
  memory.gen_len = gen_len;
  memory.kv_dtype = kv_dtype;
  memory.options = options;
  memory.kv_pool_tokens =
      kv_pool_positions(options.kv_pool_limit, config, batch, prompt_len + gen_len, kv_dtype);
  return memory;
}

MemoryPlan plan_offloaded_run(MemoryRequest memory, const OffloadOptions& options, Device device) {
  // On the CPU backend device and pinned host memory come out of the same RAM.
  const size_t available = available_host_memory();
  memory.device_capacity = options.device_memory > 0 ? options.device_memory : available;
  memory.host_capacity = available;
  memory.shared_memory = device == Device::Cpu;
  memory.gemm_scratch = device == Device::Cuda;
  memory.suggestion_margin = kSuggestionMargin;
  return plan_memory(memory);
}

namespace {

// `request` with the prefixes groups of its prompts share in whole KV blocks, when the policy can
// keep them once and the options ask for it (a capped pool keeps positions, not tokens). A
// conversation's later turns share what its first turn shared (Conversation::shared_prefixes).
GenerationRequest with_shared_prefix(const GenerationRequest& request,
                                     const OffloadOptions& options,
                                     const Conversation* conversation) {
  GenerationRequest shared = request;
  const bool continued = conversation && !conversation->history().empty();
  if (options.share_prefix && !continued && options.kv_pool_limit == 0 &&
      policy_reads_option(options.policy, "share_prefix")) {
    shared.shared_prefixes = find_shared_prefixes(request.prompts, options.kv_block_tokens);
  }
  return shared;
}

// The run of a plan that fits: loads and places the weights, builds the policy's KV store for
// each batch and generates, filling `run`.
void generate_offloaded(const ModelSource& source, const GenerationRequest& request,
                        const OffloadOptions& options, Device device, int64_t pool_positions,
                        const FetchReplay* replay, const ProgressCallback& progress,
                        OffloadRun& run, Conversation* conversation = nullptr) {
  const ModelConfig& config = source.config;
  // Weights: load to the host, then place (FlexGen's per-tensor rule).
  ModelWeights weights = with_interrupt_context([&] { return load_weights(source, Device::Cpu); },
                                                [] { return " while loading the weights"; });
  const std::vector<WeightHome> homes = place_weights(config, options.weights_gpu_percent);
  TransferEngine engine(device, options.link, options.gather);
  // Every op of the run (weight uploads included) goes to the pipeline's compute stream, whose
  // scratch is sized for the prompt's pass now (the passes after it fit in it).
  const CudaStreamScope compute(engine.compute_stream().cuda_handle());
  if (device == Device::Cuda && !dry_run()) {
    int64_t longest = 1;
    for (const std::vector<int32_t>& prompt : request.prompts) {
      longest = std::max<int64_t>(longest, static_cast<int64_t>(prompt.size()));
    }
    const int64_t rows = static_cast<int64_t>(request.prompts.size()) *
                         largest_prompt_pass(longest, options.prefill_chunk);
    const int64_t widest = std::max({config.hidden_size, config.embed_dim(), config.ffn_dim,
                                     config.num_heads * config.head_dim()});
    ops::reserve_cuda_scratch(static_cast<size_t>(8 * rows),
                              ops::cuda_linear_scratch_bytes(rows, widest, config.dtype));
  }
  std::vector<TensorTable> layers = std::move(weights.layers);
  weights.layers.clear();
  for (auto& [name, tensor] : weights.globals.entries()) {
    if (tensor.device() != device) tensor = tensor.to(device);
  }
  const std::unique_ptr<Model> model =
      make_model(config, std::move(weights), device,
                 std::make_unique<StreamedLayers>(config, std::move(layers), homes, device, engine,
                                                  run.stats));
  const KvPolicy& policy = kv_policy(options.policy);
  const KvStoreFactory make_store = [&](int64_t batch, int64_t capacity) {
    return policy.make_store({config, batch, capacity, request.kv_dtype, device, options,
                              pool_positions, engine, run.stats, replay});
  };
  GenerationRequest shared = with_shared_prefix(request, options, conversation);
  shared.prefill_chunk = options.prefill_chunk;
  run.shared_prefixes = conversation && !conversation->history().empty()
                            ? conversation->shared_prefixes()
                            : shared.shared_prefixes;
  run.result = generate(*model, shared, progress, make_store, conversation);
  engine.synchronize();
  engine.settle_stalls();
  run.totals = engine.counters();
  run.stats.settle_transfers(run.totals);
}

// The memory request of `request` (checked against the model first): its rows per sequence are
// the longest prompt, or more in a conversation's turn after prefixes of different lengths.
MemoryRequest planned_memory(const ModelConfig& config, const GenerationRequest& request,
                             const OffloadOptions& options, const Conversation* conversation) {
  const auto* history =
      conversation && !conversation->history().empty() ? &conversation->history() : nullptr;
  const int64_t longest = check_request(config, request, history);
  const int64_t rows =
      history ? first_pass_rows(request.prompts, history, conversation->shared_prefixes())
              : longest;
  MemoryRequest memory =
      offload_memory_request(config, static_cast<int64_t>(request.prompts.size()),
                             std::max(longest, rows), request.gen_len, request.kv_dtype, options);
  memory.resumed = history != nullptr;
  if (conversation) {
    memory.kv_pool_tokens =
        kv_pool_positions(options.kv_pool_limit, config, memory.batch,
                          memory.prompt_len + memory.gen_len, request.kv_dtype, /*session=*/true);
  }
  return memory;
}

}  // namespace

Trace dry_run_trace(const ModelConfig& config, const GenerationRequest& request,
                    const OffloadOptions& options, Device device, const FetchReplay* replay,
                    Conversation* conversation) {
  const MemoryRequest memory = planned_memory(config, request, options, conversation);
  Trace trace(/*dry=*/true);
  {
    TraceScope scope(trace);
    ModelSource source;
    source.config = config;
    source.synthetic = true;
    source.description = config.name + " (dry run)";
    OffloadRun run;
    generate_offloaded(source, request, options, device, memory.kv_pool_tokens, replay, {}, run,
                       conversation);
    if (!run.stats.steps().empty()) trace.set_host_kv_bytes(run.stats.steps().back().host_kv_bytes);
  }
  return trace;
}

OffloadRun run_offloaded(const ModelSource& source, const GenerationRequest& request,
                         const OffloadOptions& options, Device device,
                         const ProgressCallback& progress, Conversation* conversation) {
  const ModelConfig& config = source.config;
  const MemoryRequest memory = planned_memory(config, request, options, conversation);
  OffloadRun run;
  run.plan = plan_offloaded_run(memory, options, device);
  const OffloadOptions placed = with_plan_placements(options, run.plan);
  // On CUDA the host pool is pinned while the weights load rather than inside the prompt's pass.
  std::optional<PinAhead> pool_pinned_ahead;
  if (device == Device::Cuda) {
    if (const std::optional<KvPoolShape> pool =
            kv_policy(options.policy).memory(memory).host_pool) {
      pool_pinned_ahead.emplace(KvPool::allocation_count(*pool), KvPool::allocation_bytes(*pool));
    }
  }

  try {
    generate_offloaded(source, request, placed, device, memory.kv_pool_tokens, nullptr, progress,
                       run, conversation);
  } catch (const PinnedAllocationError& e) {
    fail(e.message(), "; ", plan_within_pinned(memory, options, device, e.pinned_before()));
  } catch (const NonFiniteLogit&) {
    // The weights themselves, rather than the forward pass, when the checkpoint holds one.
    const std::string culprit =
        source.directory.empty() ? "" : find_non_finite_tensor(source.directory);
    if (!culprit.empty()) fail(culprit, ": the checkpoint's weights are not finite");
    throw;
  }
  return run;
}

}  // namespace infinigen
