// offload: the KV policies, one entry each: what a policy is called and does, the options it
// reads, the memory it needs, whether its steps run on a device, and how its KvStore is made.
// The runtime, the memory planner, the CLI and eval look policies up here and never name one.
//
// Adding a policy: its store (a KvStore that owns a LayerPipeline, layer_pipeline.h) and its
// entry in its own file, and one line in kv_policy.cc's registration list (docs/architecture.md).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/device.h"
#include "core/kv_cache.h"
#include "core/model_config.h"
#include "offload/kv_pool.h"
#include "offload/offload_options.h"
#include "offload/offload_stats.h"
#include "offload/transfer_engine.h"
#include "speculate/speculation.h"

namespace infinigen {

struct MemoryRequest;

// The KV memory of a plan: on the device (staging, or the whole cache) and in the pinned host
// pool.
struct KvMemory {
  size_t device = 0;
  size_t host = 0;
  // The pinned host pool (offload/kv_pool.h) among `host`, where the store keeps one: on CUDA the
  // run pins it ahead while the weights load (core/pin_ahead.h).
  std::optional<KvPoolShape> host_pool = std::nullopt;
  // Bytes a decode step reads from host memory because of the request's placements: what the
  // policy keeps in host memory that it could keep on the device (InfiniGen's dense layers' KV,
  // loaded whole, and its partial keys in host memory). The planner's placement search takes the
  // placement that fits with the fewest.
  size_t placement_reads = 0;
  // Rows per (sequence, KV head) the device's staging keeps once the prompt's passes are done,
  // where fewer than the prompt's (InfiniGen: decode_staging_rows).
  std::optional<int64_t> decode_staging_rows = std::nullopt;
};

// What a policy's store is built from, per batch the generation loop runs.
struct KvStoreArgs {
  const ModelConfig& config;
  int64_t batch = 1;
  int64_t capacity = 1;  // tokens per sequence, padding included (prompt + generation)
  DType kv_dtype = DType::F16;
  Device device = Device::Cpu;
  const OffloadOptions& options;
  int64_t pool_positions = 0;  // positions per (layer, sequence, head) of a capped pool; 0 = all
  TransferEngine& engine;
  OffloadStats& stats;
  const FetchReplay* replay = nullptr;  // a dry run's fetches (core/trace.h); null otherwise
};

struct KvPolicy {
  std::string name;  // as options name it (policy: infinigen)
  std::string help;  // one line
  // Keys of the options it reads beyond those every run reads (offload/offload_options.h).
  std::vector<std::string> options;
  // Whether it computes attention over every stored token, as the full cache does (gpu, full):
  // a plan that does not fit may be offered such a policy without changing what the run computes.
  bool exact = false;
  // Whether each step loads only the tokens it selects from the data (infinigen): its bytes depend
  // on the attention of the model that runs, so a prediction must be told the share it fetches.
  bool selects_loads = false;
  // Whether each of its steps has an implementation on `device` beyond the model's dense ops
  // (ops::device_runs_transformer), e.g. dequantisation or speculation kernels.
  bool (*runs_on)(Device device) = nullptr;
  // KV bytes of a planned request (sizes saturate: a request's sizes come from the user).
  KvMemory (*memory)(const MemoryRequest& request) = nullptr;
  std::unique_ptr<KvStore> (*make_store)(const KvStoreArgs& args) = nullptr;
  // Whether its store can be saved in a session and resumed (offload/session.h), and the keys of
  // the options a session's turns must keep (what its saved state depends on).
  bool resumable = false;
  std::vector<std::string> session_options = {};
  // Whether the rows its store's token_row gives are in host memory on every device (a pool in
  // pinned memory, or a host copy the store keeps for sessions), so a session reads and writes
  // them with the host's copies on CUDA too.
  bool host_token_rows = false;
  // Whether a session's kept rows can move to earlier positions when a conversation overflows a
  // rotary model's context (docs/sessions.md, "Overflow"): its token streams are "keys", which the
  // session rotates back, "values", and streams the store derives from the keys again
  // (KvStore::rederive_rows). int4's codes would have to be requantised: not.
  bool shifts_positions = false;
};

// Every registered policy, in the order help texts list them.
const std::vector<const KvPolicy*>& kv_policies();
// The policy named `name`; an Error naming the option `policy` when there is none.
const KvPolicy& kv_policy(std::string_view name);

}  // namespace infinigen
