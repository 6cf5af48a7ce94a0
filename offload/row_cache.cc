// offload: the row cache of the `infinigen` store.
#include "offload/row_cache.h"

#include "core/compact_batch.h"
#include "core/device.h"
#include "core/kv_cache.h"
#include "core/saturating.h"
#include "core/trace.h"

namespace infinigen {

size_t RowCache::bytes(int64_t layers, int64_t batch, int64_t kv_heads, int64_t rows, int64_t width,
                       DType dtype) {
  return saturating_product(
      {layers, 2, batch, kv_heads, rows, width, static_cast<int64_t>(dtype_size(dtype))});
}

void RowCache::allocate(int64_t num_layers, int64_t first_layer, int64_t batch, int64_t kv_heads,
                        int64_t rows, int64_t width, DType dtype, Device device) {
  kv_heads_ = kv_heads;
  rows_ = rows;
  row_bytes_ = static_cast<size_t>(width) * dtype_size(dtype);
  device_ = device;
  const size_t L = static_cast<size_t>(num_layers);
  keys_.assign(L, Tensor{});
  values_.assign(L, Tensor{});
  positions_.assign(L, Tensor{});
  count_.assign(L, Tensor{});
  held_.assign(L, {});
  filled_.assign(L, 0);
  for (int64_t l = first_layer; l < num_layers; ++l) {
    const size_t i = static_cast<size_t>(l);
    keys_[i] = Tensor::empty({batch, kv_heads, rows, width}, dtype, device);
    values_[i] = Tensor::empty({batch, kv_heads, rows, width}, dtype, device);
    positions_[i] = Tensor::empty({batch, kv_heads, rows}, DType::I32, device);
    count_[i] = Tensor::empty({batch}, DType::I32, device);
    held_[i].assign(static_cast<size_t>(batch), 0);
  }
  clear();
}

void RowCache::clear() {
  for (size_t l = 0; l < keys_.size(); ++l) {
    std::fill(held_[l].begin(), held_[l].end(), 0);
    filled_[l] = 0;
    if (!keys_[l].defined() || keys_[l].dry()) continue;
    const std::vector<int32_t> none(static_cast<size_t>(count_[l].numel()), 0);
    device_copy(count_[l].raw(), device_, none.data(), Device::Cpu, count_[l].nbytes());
    if (debug_poison()) {
      fill_nan(keys_[l]);
      fill_nan(values_[l]);
    }
  }
}

const char* RowCache::key_row(int64_t layer, int64_t b, int64_t h, int64_t j) const {
  return static_cast<const char*>(keys_[static_cast<size_t>(layer)].raw()) +
         static_cast<size_t>((b * kv_heads_ + h) * rows_ + j) * row_bytes_;
}

const char* RowCache::value_row(int64_t layer, int64_t b, int64_t h, int64_t j) const {
  return static_cast<const char*>(values_[static_cast<size_t>(layer)].raw()) +
         static_cast<size_t>((b * kv_heads_ + h) * rows_ + j) * row_bytes_;
}

void RowCache::store(int64_t layer, const Tensor& staged_keys, const Tensor& staged_values,
                     int64_t fetch, const std::vector<int32_t>& take,
                     const std::vector<int32_t>& tokens) {
  const size_t l = static_cast<size_t>(layer);
  Tensor& keys = keys_[l];
  Tensor& values = values_[l];
  const int64_t B = keys.dim(0), staging_rows = staged_keys.dim(2);
  stored(layer, take);
  if (dry_run()) return;  // shapes without memory
  for (int64_t b = 0; b < B; ++b) {
    const int32_t n = take[static_cast<size_t>(b)];
    count_[l].data<int32_t>()[b] = n;
    for (int64_t h = 0; h < kv_heads_; ++h) {
      const size_t at = static_cast<size_t>((b * kv_heads_ + h) * rows_) * row_bytes_;
      const size_t from =
          static_cast<size_t>((b * kv_heads_ + h) * staging_rows + fetch - n) * row_bytes_;
      const size_t bytes = static_cast<size_t>(n) * row_bytes_;
      device_copy(static_cast<char*>(keys.raw()) + at, device_,
                  static_cast<const char*>(staged_keys.raw()) + from, staged_keys.device(), bytes);
      device_copy(static_cast<char*>(values.raw()) + at, device_,
                  static_cast<const char*>(staged_values.raw()) + from, staged_values.device(),
                  bytes);
      std::copy_n(tokens.data() + (b * kv_heads_ + h) * fetch, n,
                  positions_[l].data<int32_t>() + (b * kv_heads_ + h) * rows_);
    }
  }
}

void RowCache::keep_sequences(const std::vector<int64_t>& keep) {
  for (size_t l = 0; l < keys_.size(); ++l) {
    if (!keys_[l].defined()) continue;
    compact_batch(keys_[l], keep);
    compact_batch(values_[l], keep);
    compact_batch(positions_[l], keep);
    compact_batch(count_[l], keep);
    compact_batch(held_[l], keep, 1);
  }
}

}  // namespace infinigen
