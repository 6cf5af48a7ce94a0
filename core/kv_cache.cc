// core: the resident KV cache.
#include "core/kv_cache.h"

#include "core/ops.h"

namespace infinigen {

KvStore::KvStore(int64_t batch, int64_t capacity)
    : batch_(batch), capacity_(capacity), first_valid_(static_cast<size_t>(batch), 0) {
  INFINIGEN_CHECK(batch > 0 && capacity > 0, "KV store needs a positive batch and capacity");
}

void KvStore::set_first_valid(std::vector<int32_t> first_valid) {
  INFINIGEN_CHECK(static_cast<int64_t>(first_valid.size()) == batch_, "first_valid has ",
                  first_valid.size(), " entries for a batch of ", batch_);
  first_valid_ = std::move(first_valid);
}

void KvStore::begin_pass(int64_t n_new) {
  INFINIGEN_CHECK(length_ + n_new <= capacity_, "KV cache full: ", length_ + n_new,
                  " tokens, capacity ", capacity_);
  pass_tokens_ = n_new;
}

void KvStore::end_pass(int64_t n_new) {
  length_ += n_new;
  pass_tokens_ = 0;
}

KvCache::KvCache(const ModelConfig& config, int64_t batch, int64_t capacity, DType dtype,
                 Device device)
    : KvStore(batch, capacity), dtype_(dtype) {
  const Shape shape = {batch, config.kv_heads(), capacity, config.head_dim()};
  for (int64_t l = 0; l < config.num_layers; ++l) {
    keys_.push_back(Tensor::empty(shape, dtype, device));
    values_.push_back(Tensor::empty(shape, dtype, device));
  }
}

void KvCache::append(int64_t layer, const Tensor& keys, const Tensor& values) {
  ops::cache_store(keys, keys_[static_cast<size_t>(layer)], length());
  ops::cache_store(values, values_[static_cast<size_t>(layer)], length());
}

KvStore::View KvCache::view(int64_t layer) {
  // The pass's own rows were appended already; attention reads them too.
  return {&keys_[static_cast<size_t>(layer)], &values_[static_cast<size_t>(layer)],
          length() + pass_tokens()};
}

}  // namespace infinigen
