// offload: the `full` policy (FlexGen): all KV in the host pool, each layer's whole KV loaded into
// a device staging buffer while the previous layer computes (offload/paged_kv.h has the buffers
// and the ordering).
#pragma once

#include <cstdint>
#include <vector>

#include "core/kv_cache.h"
#include "offload/paged_kv.h"

namespace infinigen {

struct KvPolicy;
const KvPolicy& full_kv_policy();  // its entry (offload/kv_policy.h)

class FullKv : public KvStore {
 public:
  FullKv(const ModelConfig& config, int64_t batch, int64_t capacity, DType kv_dtype, Device device,
         int64_t block_tokens, TransferEngine& engine, OffloadStats& stats);

  bool can_share_prefix() const override { return true; }
  void append(int64_t layer, const Tensor& keys, const Tensor& values) override {
    paged_.append(layer, keys, values);
  }
  View view(int64_t layer) override { return paged_.view(layer); }
  void end_pass(int64_t n_new) override;
  void resume(int64_t length, std::vector<int32_t> first_valid, int64_t num_layers,
              LayerRestorer restore) override;
  std::vector<TokenStream> token_streams(int64_t) const override { return paged_.token_streams(); }
  const void* token_row(int64_t layer, size_t stream, int64_t b, int64_t h,
                        int64_t t) const override {
    return paged_.token_row(layer, stream, b, h, t);
  }
  bool can_drop_sequences() const override { return true; }
  void finish_stores() override { paged_.pipeline().drain_stores(); }
  void allocate_all() override { paged_.pool().reserve(paged_.pool().shape().max_tokens); }

  const KvPool& pool() const { return paged_.pool(); }

 protected:
  // A decode pass loads layer 0 before the embedding, and layer l + 1 while layer l computes.
  void start_pass(int64_t n_new) override;
  void start_layer(int64_t layer) override;
  void keep_sequences(const std::vector<int64_t>& keep,
                      const std::vector<LeaderMove>& moves) override {
    paged_.keep_sequences(keep, moves);
  }

 private:
  PagedKv paged_;
};

}  // namespace infinigen
