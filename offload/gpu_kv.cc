// offload: the `gpu` KV policy.
#include "offload/gpu_kv.h"

#include "core/saturating.h"
#include "offload/kv_policy.h"
#include "offload/memory_planner.h"

namespace infinigen {

const KvPolicy& gpu_kv_policy() {
  static const KvPolicy policy{
      "gpu",
      "every layer's KV resident on the device, when it fits",
      {"share_prefix", "prefill_chunk"},
      /*exact=*/true,
      /*selects_loads=*/false,
      [](Device) { return true; },
      [](const MemoryRequest& r) -> KvMemory {
        const ModelConfig& c = r.config;
        return {saturating_product({2, c.num_layers, r.batch, request_positions(r), c.kv_dim(),
                                    static_cast<int64_t>(dtype_size(r.kv_dtype))}),
                0};
      },
      [](const KvStoreArgs& a) -> std::unique_ptr<KvStore> {
        return std::make_unique<GpuKv>(a.config, a.batch, a.capacity, a.kv_dtype, a.device,
                                       a.engine, a.stats);
      },
      /*resumable=*/true};
  return policy;
}

GpuKv::GpuKv(const ModelConfig& config, int64_t batch, int64_t capacity, DType kv_dtype,
             Device device, TransferEngine& engine, OffloadStats& stats)
    : KvCache(config, batch, capacity, kv_dtype, device), clock_(config.num_layers, engine, stats) {}

void GpuKv::start_pass(int64_t n_new) {
  KvCache::start_pass(n_new);
  clock_.start_pass(*this);  // streamed weights' waits settle into the previous step
}

void GpuKv::end_pass(int64_t n_new) {
  clock_.end_pass(*this);
  KvCache::end_pass(n_new);
}

}  // namespace infinigen
