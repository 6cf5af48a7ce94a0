// offload: the `gpu` policy: every layer's KV resident on the device (only when it fits), with the
// same per-step statistics as the offloading policies.
#pragma once

#include <cstdint>

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

 protected:
  void start_pass(int64_t n_new) override;

 private:
  StepClock clock_;
};

}  // namespace infinigen
