// offload: the row cache of the `infinigen` store: per speculated layer, the K and V rows each
// (sequence, KV head) fetched at the step before, kept on the device with their pool positions, so
// that the rows a step selects again are copied there instead of crossing the link again.
//
// Exact: a pool row never changes once stored (the cache is not used with a capped pool, whose
// eviction writes new tokens over old positions), so a cached row is the row the pool would send.
// It starts empty (a new prompt, a resumed conversation's extension: every layer is then loaded
// whole) and after each speculated step holds that step's selection, which is at most the layer's
// fetch cap (OffloadOptions::row_cache, offload/infinigen_kv.h).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/tensor.h"

namespace infinigen {

class RowCache {
 public:
  // Device bytes of the cache of `layers` layers, `batch` sequences, `kv_heads` KV heads, `rows`
  // rows each of `width` elements of `dtype` (K and V).
  static size_t bytes(int64_t layers, int64_t batch, int64_t kv_heads, int64_t rows, int64_t width,
                      DType dtype);

  // Allocates the cache of layers [first_layer, num_layers), empty. Its rows are NaN while
  // debug_poison() is on, until a step writes them.
  void allocate(int64_t num_layers, int64_t first_layer, int64_t batch, int64_t kv_heads,
                int64_t rows, int64_t width, DType dtype, Device device);
  bool allocated() const { return !keys_.empty(); }
  // Empties every layer (nothing is a hit until a step fills it again); poisons it in debug.
  void clear();

  // The CPU backend, whose device memory the host reads: the rows (sequence b, KV head h) of
  // layer `layer` holds, their ascending pool positions, and row j's keys or values.
  int32_t count(int64_t layer, int64_t b) const {
    return held_[static_cast<size_t>(layer)][static_cast<size_t>(b)];
  }
  // Whether layer `layer` holds a step's selection (a step stored it since the last clear()).
  bool filled(int64_t layer) const { return filled_[static_cast<size_t>(layer)] != 0; }
  const int32_t* positions(int64_t layer, int64_t b, int64_t h) const {
    return positions_[static_cast<size_t>(layer)].data<int32_t>() + (b * kv_heads_ + h) * rows_;
  }
  const char* key_row(int64_t layer, int64_t b, int64_t h, int64_t j) const;
  const char* value_row(int64_t layer, int64_t b, int64_t h, int64_t j) const;
  Device device() const { return device_; }
  int64_t rows() const { return rows_; }

  // The CPU backend: after layer `layer`'s staging (B, H_kv, staging rows, d) holds this step's
  // selected rows, compact (rows [fetch - take[b], fetch) of (b, h), positions
  // tokens[(b * H_kv + h) * fetch + j]), they become the layer's cache. (CUDA stores them with a
  // kernel, offload/device_speculation.h.)
  void store(int64_t layer, const Tensor& staged_keys, const Tensor& staged_values, int64_t fetch,
             const std::vector<int32_t>& take, const std::vector<int32_t>& tokens);

  // CUDA: the store kernel made layer `layer`'s count take[b] (what count() tells the host).
  void stored(int64_t layer, const std::vector<int32_t>& take) {
    held_[static_cast<size_t>(layer)] = take;
    filled_[static_cast<size_t>(layer)] = 1;
  }
  // Layer `layer`'s buffers, for the CUDA kernels that match and store rows.
  struct LayerBuffers {
    Tensor& keys;       // (B, H_kv, rows, d)
    Tensor& values;     // (B, H_kv, rows, d)
    Tensor& positions;  // (B, H_kv, rows) I32
    Tensor& count;      // (B) I32
  };
  LayerBuffers layer(int64_t layer) {
    const size_t l = static_cast<size_t>(layer);
    return {keys_[l], values_[l], positions_[l], count_[l]};
  }

  // Keeps the sequences `keep` (old indices, ascending), renumbered in that order
  // (KvStore::drop_sequences). A leader's move of a shared prefix changes no row's content.
  void keep_sequences(const std::vector<int64_t>& keep);

 private:
  int64_t kv_heads_ = 0, rows_ = 0;
  size_t row_bytes_ = 0;
  Device device_ = Device::Cpu;
  // Per layer (undefined below first_layer), on the device: K and V rows (B, H_kv, rows, d) in
  // the KV dtype, their pool positions (B, H_kv, rows) I32, the first count[b] of (b, h) valid
  // and ascending, and count (B) I32.
  std::vector<Tensor> keys_, values_, positions_, count_;
  // Per layer, count (B) as the host knows it (a dry run's too, whose tensors have no memory).
  std::vector<std::vector<int32_t>> held_;
  std::vector<char> filled_;  // per layer: filled()
};

}  // namespace infinigen
