// offload: the runtime's entry point.
#include "offload/runtime.h"

#include <algorithm>
#include <cmath>

#include "core/interrupt.h"
#include "core/ops.h"
#include "offload/h2o_kv.h"
#include "offload/infinigen_kv.h"
#include "offload/int4_kv.h"
#include "offload/offloaded_kv.h"
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
    return e.what();
  }
  return "yet the memory plan fits in that much: the plan undercounts what this run pins";
}

KvPolicy parse_kv_policy(const std::string& name) {
  if (name == "gpu") return KvPolicy::Gpu;
  if (name == "full") return KvPolicy::Full;
  if (name == "infinigen") return KvPolicy::Infinigen;
  if (name == "int4") return KvPolicy::Int4;
  if (name == "h2o") return KvPolicy::H2o;
  fail("--policy: unknown policy '", name, "' (expected infinigen, full, int4, h2o or gpu)");
}

bool policy_runs_on(KvPolicy policy, Device device) {
  if (device == Device::Cpu) return true;
  if (!ops::device_runs_transformer(device)) return false;
  switch (policy) {
    case KvPolicy::Gpu:
    case KvPolicy::Full:
      return true;             // the model's ops and copies only
    case KvPolicy::Int4:       // dequantisation into the staging runs on the host
    case KvPolicy::H2o:        // scores accumulate on the host
    case KvPolicy::Infinigen:  // speculation and the partial key cache live on the host
      return false;
  }
  return false;
}

int64_t kv_pool_positions(double limit, const ModelConfig& config, int64_t batch, int64_t capacity,
                          DType kv_dtype) {
  INFINIGEN_CHECK(limit >= 0 && std::isfinite(limit), "--kv-pool-limit must be >= 0, got ", limit);
  if (limit == 0) return 0;
  const double per_position = 2.0 *
                              static_cast<double>(config.num_layers * batch * config.hidden_size) *
                              static_cast<double>(dtype_size(kv_dtype));
  const double positions = limit <= 1.0 ? std::floor(limit * static_cast<double>(capacity))
                                        : std::floor(limit / per_position);
  INFINIGEN_CHECK(positions >= 2, "--kv-pool-limit ", limit, " leaves ", positions,
                  " tokens per sequence and head in the pool; at least 2 are needed");
  return std::min<int64_t>(static_cast<int64_t>(positions), capacity);
}

MemoryRequest offload_memory_request(const ModelConfig& config, int64_t batch, int64_t prompt_len,
                                     int64_t gen_len, DType kv_dtype,
                                     const OffloadOptions& options) {
  MemoryRequest memory;
  memory.config = config;
  memory.batch = batch;
  memory.prompt_len = prompt_len;
  memory.gen_len = gen_len;
  memory.policy = options.policy;
  memory.weights_gpu_percent = options.weights_gpu_percent;
  memory.kv_dtype = kv_dtype;
  memory.kv_block_tokens = options.kv_block_tokens;
  memory.partial_ratio = options.speculation.partial_ratio;
  memory.partial_key_dtype = options.speculation.partial_key_dtype;
  INFINIGEN_CHECK(options.kv_pool_limit == 0 || options.policy == KvPolicy::Infinigen,
                  "--kv-pool-limit needs --policy infinigen");
  memory.kv_pool_tokens =
      kv_pool_positions(options.kv_pool_limit, config, batch, prompt_len + gen_len, kv_dtype);
  INFINIGEN_CHECK(options.h2o_budget > 0 && options.h2o_budget <= 1, "--h2o-budget must be in ",
                  "(0, 1], got ", options.h2o_budget);
  memory.h2o_budget = options.h2o_budget;
  if (options.policy == KvPolicy::Infinigen) options.speculation.validate();
  return memory;
}

MemoryPlan plan_offloaded_run(MemoryRequest memory, const OffloadOptions& options, Device device) {
  // On the CPU backend device and pinned host memory come out of the same RAM.
  const size_t available = available_host_memory();
  memory.device_capacity = options.device_memory > 0 ? options.device_memory : available;
  memory.host_capacity = available;
  memory.shared_memory = device == Device::Cpu;
  memory.suggestion_margin = kSuggestionMargin;
  return plan_memory(memory);
}

namespace {

// The run of a plan that fits: loads and places the weights, builds the policy's KV store for
// each batch and generates, filling `run`.
void generate_offloaded(const ModelSource& source, const GenerationRequest& request,
                        const OffloadOptions& options, Device device, int64_t pool_positions,
                        const ProgressCallback& progress, OffloadRun& run) {
  const ModelConfig& config = source.config;
  // Weights: load to the host, then place (FlexGen's per-tensor rule).
  ModelWeights weights = with_interrupt_context([&] { return load_weights(source, Device::Cpu); },
                                                [] { return " while loading the weights"; });
  const std::vector<WeightHome> homes = place_weights(config, options.weights_gpu_percent);
  TransferEngine engine(device, options.link);
  std::vector<TensorTable> layers = std::move(weights.layers);
  weights.layers.clear();
  for (auto& [name, tensor] : weights.globals.entries()) {
    if (tensor.device() != device) tensor = tensor.to(device);
  }
  const std::unique_ptr<Model> model =
      make_model(config, std::move(weights), device,
                 std::make_unique<StreamedLayers>(config, std::move(layers), homes, device, engine,
                                                  run.stats));
  const KvStoreFactory make_store = [&](int64_t batch,
                                        int64_t capacity) -> std::unique_ptr<KvStore> {
    if (options.policy == KvPolicy::Gpu) {
      return std::make_unique<ResidentKv>(config, batch, capacity, request.kv_dtype, device, engine,
                                          run.stats);
    }
    if (options.policy == KvPolicy::H2o) {
      return std::make_unique<H2oKv>(config, batch, capacity, request.kv_dtype, device,
                                     options.h2o_budget, engine, run.stats);
    }
    if (options.policy == KvPolicy::Int4) {
      return std::make_unique<Int4Kv>(config, batch, capacity, device, engine, run.stats);
    }
    if (options.policy == KvPolicy::Infinigen) {
      return std::make_unique<InfinigenKv>(config, batch, capacity, request.kv_dtype, device,
                                           options.kv_block_tokens, engine, run.stats,
                                           options.speculation, options.check_recall,
                                           KvPoolLimit{pool_positions, options.eviction});
    }
    return std::make_unique<OffloadedKv>(config, batch, capacity, request.kv_dtype, device,
                                         options.kv_block_tokens, engine, run.stats);
  };
  run.result = generate(*model, request, progress, make_store);
  engine.synchronize();
  run.totals = engine.counters();
}

}  // namespace

OffloadRun run_offloaded(const ModelSource& source, const GenerationRequest& request,
                         const OffloadOptions& options, Device device,
                         const ProgressCallback& progress) {
  const ModelConfig& config = source.config;
  const int64_t longest = check_request(config, request);
  const MemoryRequest memory =
      offload_memory_request(config, static_cast<int64_t>(request.prompts.size()), longest,
                             request.gen_len, request.kv_dtype, options);
  OffloadRun run;
  run.plan = plan_offloaded_run(memory, options, device);

  try {
    generate_offloaded(source, request, options, device, memory.kv_pool_tokens, progress, run);
  } catch (const PinnedAllocationError& e) {
    fail(e.what(), "; ", plan_within_pinned(memory, options, device, e.pinned_before()));
  }
  return run;
}

}  // namespace infinigen
