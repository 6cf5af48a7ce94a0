// offload: the `gpu` policy: every layer's KV resident on the device (only when it fits), with the
// same per-step statistics as the offloading policies.
//
// Sessions (offload/session.h) read and write a store's rows in host memory. On CUDA the store
// keeps, for them only, a host copy of every layer's K and V (B, H_kv, capacity, d): a save reads
// it, filled from the device by finish_stores (every row after the first pass, then the rows from
// there on, which the save's writer thread does not read); a resume writes each layer's history
// there and copies the layer to the device before the pass needs it.
#pragma once

#include <cstdint>
#include <vector>

#include "core/kv_cache.h"
#include "offload/layer_pipeline.h"

namespace infinigen {

struct KvPolicy;
const KvPolicy& gpu_kv_policy();  // its entry (offload/kv_policy.h)

class GpuKv : public KvCache {
 public:
  GpuKv(const ModelConfig& config, int64_t batch, int64_t capacity, DType kv_dtype, Device device,
        TransferEngine& engine, OffloadStats& stats);
  void end_pass(int64_t n_new) override;

  void resume(int64_t length, std::vector<int32_t> first_valid, int64_t num_layers,
              LayerRestorer restore) override;
  // "keys" and "values" on either device (KvCache lists them in host memory only).
  std::vector<TokenStream> token_streams(int64_t layer) const override;
  const void* token_row(int64_t layer, size_t stream, int64_t b, int64_t h,
                        int64_t t) const override;
  void finish_stores() override;

 protected:
  void start_pass(int64_t n_new) override;

 private:
  bool on_host() const { return device_ == Device::Cpu; }
  // The host copy of `layer`'s K (stream 0) or V (1), allocated when first asked for.
  std::vector<char>& host_rows(int64_t layer, size_t stream) const;

  int64_t num_layers_, kv_heads_, head_dim_;
  Device device_;
  TransferEngine& engine_;
  StepClock clock_;
  mutable std::vector<std::vector<char>> host_rows_;  // per layer and K/V: (B, H_kv, capacity, d)
  int64_t host_rows_from_ = 0;  // rows per (sequence, head) finish_stores copied before
};

}  // namespace infinigen
