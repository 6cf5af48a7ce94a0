// offload: the `gpu` KV policy.
#include "offload/gpu_kv.h"

#include "core/device.h"
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
      /*resumable=*/true,
      /*session_options=*/{},
      // On CUDA its rows go through a host copy (finish_stores, resume).
      /*host_token_rows=*/true,
      /*shifts_positions=*/true};
  return policy;
}

GpuKv::GpuKv(const ModelConfig& config, int64_t batch, int64_t capacity, DType kv_dtype,
             Device device, TransferEngine& engine, OffloadStats& stats)
    : KvCache(config, batch, capacity, kv_dtype, device),
      num_layers_(config.num_layers),
      kv_heads_(config.kv_heads()),
      head_dim_(config.head_dim()),
      device_(device),
      engine_(engine),
      clock_(config.num_layers, engine, stats) {}

std::vector<char>& GpuKv::host_rows(int64_t layer, size_t stream) const {
  if (host_rows_.empty()) host_rows_.resize(static_cast<size_t>(2 * num_layers_));
  std::vector<char>& rows = host_rows_[static_cast<size_t>(layer) * 2 + stream];
  if (rows.empty()) {
    rows.assign(
        static_cast<size_t>(batch() * kv_heads_ * capacity() * head_dim_) * dtype_size(dtype()), 0);
  }
  return rows;
}

std::vector<KvStore::TokenStream> GpuKv::token_streams(int64_t) const {
  return {{"keys", dtype(), head_dim_}, {"values", dtype(), head_dim_}};
}

const void* GpuKv::token_row(int64_t layer, size_t stream, int64_t b, int64_t h, int64_t t) const {
  if (on_host()) return KvCache::token_row(layer, stream, b, h, t);
  const size_t row = static_cast<size_t>(head_dim_) * dtype_size(dtype());
  return host_rows(layer, stream).data() +
         static_cast<size_t>((b * kv_heads_ + h) * capacity() + t) * row;
}

void GpuKv::resume(int64_t length, std::vector<int32_t> first_valid, int64_t num_layers,
                   LayerRestorer restore) {
  if (on_host()) {
    KvCache::resume(length, std::move(first_valid), num_layers, std::move(restore));
    return;
  }
  // Each layer's history is written into the host copy, then the layer goes to the device
  // whole, before any pass writes it.
  KvCache::resume(length, std::move(first_valid), num_layers,
                  [this, restore = std::move(restore)](int64_t layer, KvStore& store) {
                    restore(layer, store);
                    for (size_t stream = 0; stream < 2; ++stream) {
                      const std::vector<char>& rows = host_rows(layer, stream);
                      device_copy(const_cast<void*>(KvCache::token_row(layer, stream, 0, 0, 0)),
                                  device_, rows.data(), Device::Cpu, rows.size());
                    }
                  });
}

void GpuKv::finish_stores() {
  if (on_host()) return;
  engine_.compute_stream().synchronize();  // the passes' appends so far
  const int64_t runs = batch() * kv_heads_, from = host_rows_from_;
  const size_t row = static_cast<size_t>(head_dim_) * dtype_size(dtype());
  for (int64_t layer = 0; layer < num_layers_; ++layer) {
    for (size_t stream = 0; stream < 2; ++stream) {
      std::vector<char>& rows = host_rows(layer, stream);
      const char* device = static_cast<const char*>(KvCache::token_row(layer, stream, 0, 0, 0));
      for (int64_t i = 0; i < runs; ++i) {
        const size_t at = static_cast<size_t>(i * capacity() + from) * row;
        device_copy(rows.data() + at, Device::Cpu, device + at, device_,
                    static_cast<size_t>(capacity() - from) * row);
      }
    }
  }
  host_rows_from_ = length();
}

void GpuKv::start_pass(int64_t n_new) {
  KvCache::start_pass(n_new);
  clock_.start_pass(*this);  // streamed weights' waits settle into the previous step
}

void GpuKv::end_pass(int64_t n_new) {
  clock_.end_pass(*this);
  KvCache::end_pass(n_new);
}

}  // namespace infinigen
