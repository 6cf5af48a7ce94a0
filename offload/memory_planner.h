// offload: the memory plan of a request, computed before anything is allocated.
//
// Device: resident weights, staging for streamed weights (two layers), KV (the whole cache for
// the `gpu` policy; for offloading policies a double-buffered staging of K and V for one layer,
// plus for `infinigen` every speculated layer's partial key cache (fp16 by default; those placed
// in host memory count there) and partial query weights, and the dense layers' whole KV where it
// is placed on the device; for `h2o` the staging
// holds only the kept entries and the new token), and activations (the model's buffers of
// core/activations.h sized for the prompt's largest pass, the whole prompt or its chunk, and one
// prefill attention score block per worker of the CPU kernel), and on the CUDA backend the GEMMs'
// scratch (the 16-bit copy of the largest input, cuBLAS's workspace).
// Host (pinned): host-resident weights and the KV pool (for `h2o`, only the kept entries).
// If the plan does not fit, `plan_memory` throws one line with the numbers and a configuration
// that the planner itself accepts (a smaller batch, a capped InfiniGen pool, fewer weights on the
// device, an offloading policy, fewer generated tokens), or, when none does, which resource is
// short and by how much. Sizes saturate, so an absurd request is refused, never wrapped round.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "core/error.h"
#include "core/model_config.h"
#include "offload/kv_pool.h"
#include "offload/offload_options.h"

namespace infinigen {

struct MemoryRequest {
  ModelConfig config;
  int64_t batch = 1;
  int64_t prompt_len = 1;  // padded
  // A conversation's resumed turn: its first pass (prompt_len rows) extends stored tokens.
  bool resumed = false;
  int64_t gen_len = 1;
  DType kv_dtype = DType::F16;
  OffloadOptions options;      // the policy and its options, weights_gpu_percent, kv_block_tokens
  int64_t kv_pool_tokens = 0;  // positions per (layer, sequence, head) in the pool; 0 = all
  size_t device_capacity = 0;  // bytes usable on the device
  size_t host_capacity = 0;    // bytes of pinned host memory available
  // Device and host memory are one RAM (the CPU backend): the device part counts against
  // host_capacity too.
  bool shared_memory = false;
  // The CUDA backend's scratch: cuBLAS multiplies 16-bit weights by a 16-bit copy of the fp32
  // input (the compute stream's persistent GEMM scratch, ops::cuda_linear_scratch_bytes of the
  // widest prefill input), plus the cuBLAS workspace; and the host gather's buffers.
  bool gemm_scratch = false;
  // Bytes of host memory that can be pinned: the plan's host part (weights streamed from the host,
  // the KV pool) must fit in it as well. Unlimited unless a run could pin less than its plan
  // (another process, a driver limit) and is planned again with what it got.
  size_t pinned_capacity = std::numeric_limits<size_t>::max();
  // Share of each capacity that a suggested configuration leaves free. Capacities measured now
  // (the host's MemAvailable) move between runs: a suggestion planned to the last byte could be
  // refused when it is run.
  double suggestion_margin = 0.0;
};

struct MemoryPlan {
  size_t device_weights = 0;
  size_t device_weight_staging = 0;
  size_t device_kv = 0;
  size_t device_activations = 0;
  size_t device_scratch = 0;  // the CUDA backend's GEMM scratch (MemoryRequest::gemm_scratch)
  // The CUDA host gather's buffers (--gather host): a device landing and a pinned staging as large
  // as the largest transfer each way (offload/transfer_engine.h).
  size_t device_gather = 0;
  size_t host_gather = 0;
  size_t host_weights = 0;
  size_t host_kv_pool = 0;
  // Where the dense layers' KV lives, for a policy that reads OffloadOptions::dense_kv: as asked,
  // or for `auto` the device when the plan fits there, else the host (never auto).
  std::optional<KvPlacement> dense_kv;
  // How many speculated layers keep their partial key cache in pinned host memory, for a policy
  // that reads OffloadOptions::partial_key_host_layers: as asked, or for -1 the fewest with which
  // the plan fits (all of them when nothing does).
  std::optional<int64_t> partial_key_host_layers;
  // Whether InfiniGen keeps the rows fetched at the step before on the device, for a policy that
  // reads OffloadOptions::row_cache: as asked, or for auto when the plan fits it once the other
  // placements are decided (off under a pool limit).
  std::optional<bool> row_cache;
  // Bytes a decode step reads from host memory because of these placements (KvMemory).
  size_t placement_reads = 0;
  // Rows per (sequence, KV head) of the KV staging after the prompt, where it shrinks (KvMemory).
  std::optional<int64_t> decode_staging_rows;
  size_t device_total() const;
  size_t host_total() const;
  std::string describe() const;  // multi-line breakdown (--stats, --dry-run)
  // The breakdown, then what `checked`'s capacities allow and a line for each one the plan does
  // not fit in (the device, the memory that can be pinned, the host).
  std::string describe(const MemoryRequest& checked) const;
};

// plan_memory's refusal (one line, as every Error), with the plan it refused described against
// the capacities (MemoryPlan::describe(request)): what `--dry-run` shows above the refusal.
class PlanRefused : public Error {
 public:
  PlanRefused(const std::string& message, std::string marked_plan)
      : Error(message), marked_plan_(std::make_shared<const std::string>(std::move(marked_plan))) {}
  const std::string& marked_plan() const { return *marked_plan_; }

 private:
  std::shared_ptr<const std::string> marked_plan_;  // shared: copying must not throw
};

// Positions per sequence, prompt and generated (saturating: both lengths come from the user).
int64_t request_positions(const MemoryRequest& request);
// Building blocks of the policies' KV memory (offload/kv_policy.h), saturating:
// K and V of `rows` positions per (sequence, KV head) of one layer, double-buffered by layer
// parity, in the KV dtype (a device staging).
size_t kv_staging_bytes(const MemoryRequest& request, int64_t rows);
// The host pool of every layer, `positions` per (sequence, KV head) in blocks of kv_block_tokens
// (a capped pool's, fewer positions than the request's, no longer than its positions:
// capped_block_tokens): its shape, and its bytes.
KvPoolShape kv_pool_shape(const MemoryRequest& request, int64_t positions);
size_t kv_pool_bytes(const MemoryRequest& request, int64_t positions);

// `request` with every placement it leaves to the planner decided, the faster first: the dense
// layers' KV (OffloadOptions::dense_kv auto) and every partial key (partial_key_host_layers -1)
// on the device when they fit; else, of the dense layers' KV on the device or in the host pool,
// each with as few layers' partial keys in host memory as then fit, the one whose steps read the
// fewest bytes from host memory; when nothing fits, everything in host memory.
MemoryRequest with_placements(const MemoryRequest& request);
// Sizes of the plan of with_placements(request), without checking capacities.
MemoryPlan compute_memory_plan(const MemoryRequest& request);
// compute_memory_plan, then checks both capacities; throws PlanRefused (one line) if it cannot
// fit.
MemoryPlan plan_memory(const MemoryRequest& request);

}  // namespace infinigen
