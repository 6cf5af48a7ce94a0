// offload: the `full` KV policy.
#include "offload/full_kv.h"

#include "offload/kv_policy.h"
#include "offload/memory_planner.h"

namespace infinigen {

const KvPolicy& full_kv_policy() {
  static const KvPolicy policy{
      "full",
      "all KV in host memory, each layer's whole KV loaded every step: FlexGen",
      {"kv_block_tokens", "share_prefix", "prefill_chunk"},
      /*exact=*/true,
      /*selects_loads=*/false,
      [](Device) { return true; },  // copies and the model's ops only
      [](const MemoryRequest& r) -> KvMemory {
        const int64_t tokens = request_positions(r);
        return {kv_staging_bytes(r, tokens), kv_pool_bytes(r, tokens), kv_pool_shape(r, tokens)};
      },
      [](const KvStoreArgs& a) -> std::unique_ptr<KvStore> {
        return std::make_unique<FullKv>(a.config, a.batch, a.capacity, a.kv_dtype, a.device,
                                             a.options.kv_block_tokens, a.engine, a.stats);
      },
      /*resumable=*/true,
      /*session_options=*/{},
      /*host_token_rows=*/true,
      /*shifts_positions=*/true};
  return policy;
}

FullKv::FullKv(const ModelConfig& config, int64_t batch, int64_t capacity, DType kv_dtype,
               Device device, int64_t block_tokens, TransferEngine& engine, OffloadStats& stats)
    : KvStore(batch, capacity),
      paged_(*this, config, kv_dtype, device, block_tokens, engine, stats) {}

void FullKv::start_pass(int64_t n_new) {
  KvStore::start_pass(n_new);
  paged_.start_pass();
  if (length() > 0) paged_.load_layer(0);
}

void FullKv::start_layer(int64_t layer) {
  // While this layer computes, the next layer's KV moves into the other staging buffer (which
  // layer - 1 has finished reading: compute runs in order).
  if (length() > 0 && layer + 1 < paged_.pipeline().num_layers()) paged_.load_layer(layer + 1);
}

void FullKv::end_pass(int64_t n_new) {
  paged_.end_pass();
  KvStore::end_pass(n_new);
}

void FullKv::resume(int64_t length, std::vector<int32_t> first_valid, int64_t num_layers,
                    LayerRestorer restore) {
  KvStore::resume(length, std::move(first_valid), num_layers, std::move(restore));
  paged_.resume(length);
}

}  // namespace infinigen
