// offload: the paged host pool with its staging and pipeline.
#include "offload/paged_kv.h"

#include "core/ops.h"
#include "offload/kv_policy.h"

namespace infinigen {

PagedKv::PagedKv(const KvStore& store, const ModelConfig& config, DType kv_dtype, Device device,
                 int64_t block_tokens, TransferEngine& engine, OffloadStats& stats,
                 int64_t pool_tokens, int64_t resident_layers)
    : store_(store),
      pool_({config.num_layers, store.batch(), config.kv_heads(), config.head_dim(),
             pool_tokens > 0 ? pool_tokens : store.capacity(),
             pool_tokens > 0 ? capped_block_tokens(block_tokens, pool_tokens) : block_tokens,
             kv_dtype}),
      pipeline_(config.num_layers, engine, stats,
                {store.batch(), config.kv_heads(), store.capacity(), config.head_dim()}, kv_dtype,
                device) {
  const int64_t batch = store.batch(), capacity = store.capacity();
  const Shape token = {batch, config.kv_heads(), 1, config.head_dim()};
  for (size_t p = 0; p < 2; ++p) {
    token_keys_[p] = Tensor::empty(token, kv_dtype, device);
    token_values_[p] = Tensor::empty(token, kv_dtype, device);
  }
  INFINIGEN_CHECK(resident_layers >= 0 && resident_layers <= config.num_layers &&
                      (resident_layers == 0 || pool_tokens == 0),
                  "a paged KV store keeps ", resident_layers, " of ", config.num_layers,
                  " layers resident", pool_tokens > 0 ? " in a capped pool" : "");
  const Shape whole = {batch, config.kv_heads(), capacity, config.head_dim()};
  for (int64_t l = 0; l < resident_layers; ++l) {
    resident_keys_.push_back(Tensor::empty(whole, kv_dtype, device));
    resident_values_.push_back(Tensor::empty(whole, kv_dtype, device));
  }
  resident_rows_.assign(static_cast<size_t>(resident_layers), 0);
  // The largest transfer either way: a layer's K and V, one chunk per (sequence, head, block).
  const int64_t blocks = (capacity + block_tokens - 1) / block_tokens;
  engine.reserve_gathers(
      static_cast<size_t>(2 * batch * config.kv_heads() * blocks),
      static_cast<size_t>(2 * batch * config.kv_heads() * capacity * config.head_dim()) *
          dtype_size(kv_dtype));
}

Tensor& PagedKv::keys_of(int64_t layer) {
  return resident(layer) ? resident_keys_[static_cast<size_t>(layer)] : pipeline_.keys(layer);
}

Tensor& PagedKv::values_of(int64_t layer) {
  return resident(layer) ? resident_values_[static_cast<size_t>(layer)] : pipeline_.values(layer);
}

void PagedKv::load_layer(int64_t layer) {
  Tensor& keys = keys_of(layer);
  Tensor& values = values_of(layer);
  const int64_t length = store_.length();
  // A resident layer that holds every stored row loads nothing (and waits for no store).
  const bool loads = !resident(layer) || resident_rows_[static_cast<size_t>(layer)] < length;
  if (loads) {
    if (!resident(layer)) expect_whole_staging(layer);
    if (!resident(layer)) pipeline_.poison(layer);
    std::vector<CopyChunk> chunks;
    pool_.gather_chunks(layer, KvKind::Key, 0, length, keys.raw(), store_.capacity(), 0, &chunks);
    pool_.gather_chunks(layer, KvKind::Value, 0, length, values.raw(), store_.capacity(), 0,
                        &chunks);
    pipeline_.load(layer, std::move(chunks));
    if (resident(layer)) resident_rows_[static_cast<size_t>(layer)] = length;
  }
  // Rows each sequence's attention reads (a shared row once per sequence that reads it), loaded
  // or resident.
  LayerTraffic& traffic = pipeline_.traffic(layer);
  for (int64_t b = 0; b < store_.batch(); ++b) {
    const int64_t own = length - store_.first_valid()[static_cast<size_t>(b)];
    traffic.tokens_fetched +=
        static_cast<uint64_t>((store_.shared().prefix_length(b) + own) * keys.dim(1));
  }
  traffic.tokens_stored = traffic.tokens_fetched;
}

void PagedKv::append(int64_t layer, const Tensor& keys, const Tensor& values) {
  Tensor& staged_keys = keys_of(layer);
  Tensor& staged_values = values_of(layer);
  // A resident layer's rows are written once, after every row a store of it still reads: it
  // awaits no store.
  const bool own = resident(layer);
  if (own) resident_rows_[static_cast<size_t>(layer)] = store_.length() + store_.pass_tokens();
  if (store_.length() == 0) {
    // Prefill: attention reads the fresh rows directly; the staging only carries them to the
    // pool, once the store that last read it is done (a resident layer keeps them).
    if (!own) pipeline_.await_store_reads(layer);
    store_.store_pass_rows(keys, staged_keys);
    store_.store_pass_rows(values, staged_values);
    if (store_.sharing_pass()) {
      store_shared_prefixes(layer);
      return;
    }
    store_rows(layer, staged_keys, staged_values, 0, store_.pass_tokens());
    return;
  }
  // Decode: the new rows join this step's staging (attention reads them). One row goes to the
  // pool from the token buffer; the rows of an extension go from the staging, on the store stream
  // while the next layers compute: the next write of those rows, layer + 2's, waits for that
  // store, and the loads into the staging write only the rows before them.
  // A resident layer stores its new rows from where they stay.
  if (!own) expect_whole_staging(layer);
  if (store_.pass_tokens() > 1 && !own) pipeline_.await_store_reads(layer);
  ops::cache_store(keys, staged_keys, store_.length());
  ops::cache_store(values, staged_values, store_.length());
  if (store_.pass_tokens() == 1 && !own) {
    store_token(layer, keys, values);
    return;
  }
  store_rows(layer, staged_keys, staged_values, store_.length(), store_.pass_tokens());
}

void PagedKv::expect_whole_staging(int64_t layer) const {
  INFINIGEN_CHECK(pipeline_.staging_rows() >= store_.capacity(), "layer ", layer,
                  " needs its whole KV staged, but the staging was shrunk to ",
                  pipeline_.staging_rows(), " rows of ", store_.capacity(),
                  " after the prompt (a pass that reads every row after decode steps began)");
}

void PagedKv::store_token(int64_t layer, const Tensor& keys, const Tensor& values) {
  const size_t p = static_cast<size_t>(layer % 2);
  pipeline_.await_store_reads(layer);
  ops::cache_store(keys, token_keys_[p], 0);
  ops::cache_store(values, token_values_[p], 0);
  store_rows(layer, token_keys_[p], token_values_[p], 0, 1);
}

void PagedKv::store_token_at(int64_t layer, const Tensor& keys, const Tensor& values,
                             const std::vector<int32_t>& at, EventPtr after) {
  const size_t p = static_cast<size_t>(layer % 2);
  pipeline_.await_store_reads(layer);
  ops::cache_store(keys, token_keys_[p], 0);
  ops::cache_store(values, token_values_[p], 0);
  const int64_t heads = token_keys_[p].dim(1);
  std::vector<PoolRowMove> moves;
  moves.reserve(at.size());
  for (int64_t b = 0; b < store_.batch(); ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      moves.push_back({b, h, 0, at[static_cast<size_t>(b * heads + h)]});
    }
  }
  pipeline_.store(layer, row_chunks(layer, token_keys_[p], token_values_[p], moves),
                  std::move(after), TransferContent::KvRows);
}

void PagedKv::store_staged_rows(int64_t layer, std::span<const PoolRowMove> moves) {
  pipeline_.store(layer, row_chunks(layer, pipeline_.keys(layer), pipeline_.values(layer), moves),
                  nullptr, TransferContent::KvRows);
}

std::vector<CopyChunk> PagedKv::row_chunks(int64_t layer, const Tensor& keys, const Tensor& values,
                                           std::span<const PoolRowMove> moves) {
  const int64_t heads = keys.dim(1), rows = keys.dim(2);
  const size_t row_bytes = static_cast<size_t>(keys.dim(3)) * dtype_size(keys.dtype());
  std::vector<CopyChunk> chunks;
  chunks.reserve(2 * moves.size());
  for (const PoolRowMove& m : moves) {
    const size_t src = static_cast<size_t>((m.b * heads + m.h) * rows + m.from) * row_bytes;
    chunks.push_back({pool_.row(layer, KvKind::Key, m.b, m.h, m.to),
                      static_cast<const char*>(keys.raw()) + src, row_bytes});
    chunks.push_back({pool_.row(layer, KvKind::Value, m.b, m.h, m.to),
                      static_cast<const char*>(values.raw()) + src, row_bytes});
  }
  return chunks;
}

void PagedKv::store_rows(int64_t layer, const Tensor& keys, const Tensor& values, int64_t row0,
                         int64_t n) {
  std::vector<CopyChunk> chunks;
  const int64_t src_capacity = keys.dim(2);
  pool_.scatter_chunks(layer, KvKind::Key, keys.raw(), src_capacity, row0, store_.length(), n,
                       &chunks);
  pool_.scatter_chunks(layer, KvKind::Value, values.raw(), src_capacity, row0, store_.length(), n,
                       &chunks);
  pipeline_.store(layer, std::move(chunks));
}

void PagedKv::store_shared_prefixes(int64_t layer) {
  if (pool_.num_blocks() == 0) pool_.share(store_.shared());
  std::vector<CopyChunk> chunks;
  const int64_t rows = store_.shared_rows();
  pool_.scatter_shared_chunks(layer, KvKind::Key, keys_of(layer).raw(), store_.capacity(), 0, rows,
                              &chunks);
  pool_.scatter_shared_chunks(layer, KvKind::Value, values_of(layer).raw(), store_.capacity(), 0,
                              rows, &chunks);
  pipeline_.store(layer, std::move(chunks));
}

KvStore::View PagedKv::view(int64_t layer) {
  pipeline_.wait_for_load(layer);
  return {&keys_of(layer), &values_of(layer),
          store_.length() + store_.pass_tokens(), nullptr, &store_.shared()};
}

void PagedKv::end_pass() {
  if (!store_.sharing_pass()) pool_.reserve(pool_.shape().max_tokens);
  pipeline_.step().host_kv_bytes = pool_.allocated_bytes();
  pipeline_.end_pass(store_);
}

void PagedKv::keep_sequences(const std::vector<int64_t>& keep,
                             const std::vector<KvStore::LeaderMove>& moves) {
  pipeline_.keep_batch(std::ssize(keep));  // after every transfer in flight
  pool_.keep_sequences(keep);
  for (size_t p = 0; p < 2; ++p) {
    token_keys_[p] = token_keys_[p].slice_rows(0, std::ssize(keep));
    token_values_[p] = token_values_[p].slice_rows(0, std::ssize(keep));
  }
  for (size_t l = 0; l < resident_keys_.size(); ++l) {
    compact_batch(resident_keys_[l], keep, moves);
    compact_batch(resident_values_[l], keep, moves);
  }
}

void PagedKv::resume(int64_t length) {
  const SharedPrefixes& shared = store_.shared();
  if (!shared.empty()) {
    const int64_t block = pool_.shape().block_tokens;
    for (int64_t prefix : shared.lengths()) {
      INFINIGEN_CHECK(prefix % block == 0, "the conversation shares a ", prefix,
                      "-token prefix, which is not whole blocks of ", option("kv_block_tokens"),
                      " ", block, ": continue it with the block size it was saved with");
    }
    pool_.share(shared);
  }
  pool_.reserve(length);
}

std::vector<KvStore::TokenStream> PagedKv::token_streams() const {
  const KvPoolShape& s = pool_.shape();
  return {{"keys", s.dtype, s.head_dim}, {"values", s.dtype, s.head_dim}};
}

const void* PagedKv::token_row(int64_t layer, size_t stream, int64_t b, int64_t h,
                               int64_t t) const {
  return pool_.row(layer, stream == 0 ? KvKind::Key : KvKind::Value, b, h, t);
}

}  // namespace infinigen
