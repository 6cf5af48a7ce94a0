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

  // Rows (sequence b, KV head h) of layer `layer` holds, and their ascending pool positions.
  int32_t count(int64_t layer, int64_t b) const {
    return count_[static_cast<size_t>(layer)][static_cast<size_t>(b)];
  }
  const int32_t* positions(int64_t layer, int64_t b, int64_t h) const {
    return positions_[static_cast<size_t>(layer)].data() + (b * kv_heads_ + h) * rows_;
  }
  // Row j of (b, h)'s keys or values on the device.
  const char* key_row(int64_t layer, int64_t b, int64_t h, int64_t j) const;
  const char* value_row(int64_t layer, int64_t b, int64_t h, int64_t j) const;
  Device device() const { return device_; }

  // After layer `layer`'s staging (B, H_kv, staging rows, d) holds this step's selected rows,
  // compact (rows [fetch - take[b], fetch) of (b, h), positions tokens[(b * H_kv + h) * fetch +
  // j]): they become the layer's cache. Copies on the device, after the work enqueued on the
  // current stream.
  void store(int64_t layer, const Tensor& staged_keys, const Tensor& staged_values, int64_t fetch,
             const std::vector<int32_t>& take, const std::vector<int32_t>& tokens);

  // Keeps the sequences `keep` (old indices, ascending), renumbered in that order
  // (KvStore::drop_sequences). A leader's move of a shared prefix changes no row's content.
  void keep_sequences(const std::vector<int64_t>& keep);

 private:
  int64_t kv_heads_ = 0, rows_ = 0;
  size_t row_bytes_ = 0;
  Device device_ = Device::Cpu;
  // Per layer (undefined below first_layer): K and V rows (B, H_kv, rows, d) in the KV dtype;
  // on the host their pool positions (B, H_kv, rows), the first count[b] of (b, h) valid and
  // ascending, and count (B).
  std::vector<Tensor> keys_, values_;
  std::vector<std::vector<int32_t>> positions_;
  std::vector<std::vector<int32_t>> count_;
};

}  // namespace infinigen
