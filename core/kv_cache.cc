// core: the resident KV cache.
#include "core/kv_cache.h"

#include <algorithm>

#include "core/device.h"
#include "core/error.h"
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

void KvStore::share_prefixes(SharedPrefixes shared, std::vector<int32_t> first_valid) {
  INFINIGEN_CHECK(can_share_prefix(), "this KV policy's store cannot share a prompt prefix");
  INFINIGEN_CHECK(length_ == 0 && passes_ == 0, "prefixes are shared before the first pass");
  INFINIGEN_CHECK(shared.batch() == batch_, "shared prefixes of ", shared.batch(),
                  " sequences for a batch of ", batch_);
  INFINIGEN_CHECK(shared.rows() > 0 && shared.rows() < capacity_, "shared prefixes of ",
                  shared.rows(), " rows in a KV store of ", capacity_);
  for (int32_t start : first_valid) {
    INFINIGEN_CHECK(start >= shared.rows() && start < capacity_,
                    "a sequence's own tokens start at row ", start, ", inside the ", shared.rows(),
                    " rows of shared prefixes or past the capacity");
  }
  set_first_valid(std::move(first_valid));
  shared_ = std::move(shared);
}

void KvStore::drop_sequences(const std::vector<int64_t>& keep) {
  INFINIGEN_CHECK(can_drop_sequences(), "this KV policy's store cannot drop sequences");
  INFINIGEN_CHECK(length_ > 0 && !prompt_open_ && pass_tokens_ == 0,
                  "sequences are dropped between passes, after the prompt's");
  INFINIGEN_CHECK(!keep.empty() && std::ssize(keep) <= batch_, "keeping ", keep.size(),
                  " sequences of a batch of ", batch_);
  for (size_t i = 0; i < keep.size(); ++i) {
    INFINIGEN_CHECK(keep[i] >= 0 && keep[i] < batch_ && (i == 0 || keep[i] > keep[i - 1]),
                    "sequences to keep must be ascending indices of the batch of ", batch_);
  }
  const SharedPrefixes kept = shared_.kept(keep);
  std::vector<LeaderMove> moves;
  for (int64_t g = 0; g < kept.num_groups(); ++g) {
    const int64_t to = keep[static_cast<size_t>(kept.leaders()[static_cast<size_t>(g)])];
    const int64_t from = shared_.source(to);
    if (from != to) moves.push_back({from, to, shared_.begin(to), shared_.rows()});
  }
  keep_sequences(keep, moves);
  compact_batch(first_valid_, keep, 1);
  shared_ = kept;
  batch_ = std::ssize(keep);
}

void compact_batch(Tensor& t, const std::vector<int64_t>& keep,
                   const std::vector<KvStore::LeaderMove>& moves) {
  if (!t.defined()) return;
  const int64_t B = t.dim(0);
  const size_t slab = t.nbytes() / static_cast<size_t>(B);
  char* data = static_cast<char*>(t.raw());
  if (!moves.empty()) {
    INFINIGEN_CHECK(t.rank() >= 3, "moving prefix rows needs (B, ..., rows, width), got ",
                    shape_string(t.shape()));
    const int64_t rows = t.dim(t.rank() - 2);
    const size_t row = static_cast<size_t>(t.dim(t.rank() - 1)) * dtype_size(t.dtype());
    const int64_t runs = static_cast<int64_t>(slab / (row * static_cast<size_t>(rows)));
    for (const KvStore::LeaderMove& m : moves) {
      for (int64_t r = 0; r < runs; ++r) {
        const size_t at = static_cast<size_t>(r * rows + m.row0) * row;
        device_copy(data + static_cast<size_t>(m.to) * slab + at, t.device(),
                    data + static_cast<size_t>(m.from) * slab + at, t.device(),
                    static_cast<size_t>(m.row1 - m.row0) * row);
      }
    }
  }
  for (size_t i = 0; i < keep.size(); ++i) {
    const size_t from = static_cast<size_t>(keep[i]);
    if (from == i) continue;
    device_copy(data + i * slab, t.device(), data + from * slab, t.device(), slab);
  }
  t = t.slice_rows(0, std::ssize(keep));
}

void KvStore::store_pass_rows(const Tensor& rows, Tensor& cache) const {
  if (!sharing_pass()) {
    ops::cache_store(rows, cache, length());
    return;
  }
  const int64_t n = pass_tokens();
  for (int64_t i = 0; i < pass_batch(); ++i) {
    const int64_t leader = pass_sequence(i);
    Tensor leader_cache = cache.slice_rows(leader, leader + 1);
    ops::cache_store(rows.slice_rows(i * n, (i + 1) * n), leader_cache, 0);
  }
}

void KvStore::begin_pass(int64_t n_new) {
  restore_through(0);
  start_pass(n_new);
}

void KvStore::begin_layer(int64_t layer) {
  restore_through(layer + 1);
  start_layer(layer);
}

void KvStore::restore_through(int64_t layer) {
  if (!restore_) return;
  const int64_t last = std::min<int64_t>(layer, num_restored_layers_ - 1);
  for (; restored_ <= last; ++restored_) restore_(restored_, *this);
  if (restored_ >= num_restored_layers_) restore_ = nullptr;
}

void KvStore::resume(int64_t length, std::vector<int32_t> first_valid, int64_t num_layers,
                     LayerRestorer restore) {
  INFINIGEN_CHECK(length_ == 0, "a conversation can only be resumed into an empty KV store");
  INFINIGEN_CHECK(length > 0 && length < capacity_, "resuming ", length,
                  " stored tokens into a KV store of ", capacity_);
  set_first_valid(std::move(first_valid));
  length_ = length;
  restore_ = std::move(restore);
  restored_ = 0;
  num_restored_layers_ = num_layers;
}

const void* KvStore::token_row(int64_t, size_t, int64_t, int64_t, int64_t) const {
  fail("this KV policy's store cannot be saved in a session");
}

void KvStore::restore_layer_state(int64_t layer, const LayerState& state) {
  INFINIGEN_CHECK(state.empty(), "layer ", layer, ": this KV policy keeps no state to restore");
}

void KvStore::start_pass(int64_t n_new) {
  INFINIGEN_CHECK(length_ + n_new <= capacity_, "KV cache full: ", length_ + n_new,
                  " tokens, capacity ", capacity_);
  pass_tokens_ = n_new;
}

void KvStore::expect_prompt(int64_t end) {
  INFINIGEN_CHECK(end > length_ && end <= capacity_, "a prompt ending at row ", end,
                  " in a KV store holding ", length_, " of ", capacity_);
  prompt_end_ = end;
}

void KvStore::end_pass(int64_t n_new) {
  prompt_open_ = !pass_closes_step();
  length_ += n_new;
  pass_tokens_ = 0;
  ++passes_;
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
  // The shared prefixes go into their leaders' rows only.
  store_pass_rows(keys, keys_[static_cast<size_t>(layer)]);
  store_pass_rows(values, values_[static_cast<size_t>(layer)]);
}

void KvCache::keep_sequences(const std::vector<int64_t>& keep,
                             const std::vector<LeaderMove>& moves) {
  for (size_t l = 0; l < keys_.size(); ++l) {
    compact_batch(keys_[l], keep, moves);
    compact_batch(values_[l], keep, moves);
  }
}

KvStore::View KvCache::view(int64_t layer) {
  // The pass's own rows were appended already; attention reads them too.
  return {&keys_[static_cast<size_t>(layer)], &values_[static_cast<size_t>(layer)],
          length() + pass_tokens(), nullptr, &shared()};
}

}  // namespace infinigen

namespace infinigen {

std::vector<KvStore::TokenStream> KvCache::token_streams(int64_t) const {
  if (keys_.empty() || keys_[0].device() != Device::Cpu) return {};
  return {{"keys", dtype_, keys_[0].dim(3)}, {"values", dtype_, keys_[0].dim(3)}};
}

const void* KvCache::token_row(int64_t layer, size_t stream, int64_t b, int64_t h,
                               int64_t t) const {
  const Tensor& cache = (stream == 0 ? keys_ : values_)[static_cast<size_t>(layer)];
  const int64_t offset = ((b * cache.dim(1) + h) * cache.dim(2) + t) * cache.dim(3);
  return static_cast<const char*>(cache.raw()) + static_cast<size_t>(offset) * dtype_size(dtype_);
}

}  // namespace infinigen
