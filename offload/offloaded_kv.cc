// offload: the `full` KV policy.
#include "offload/offloaded_kv.h"

#include "core/ops.h"
#include "core/saturating.h"
#include "offload/kv_policy.h"
#include "offload/memory_planner.h"

namespace infinigen {

const KvPolicy& full_kv_policy() {
  static const KvPolicy policy{
      "full",
      "all KV in host memory, each layer's whole KV loaded every step: FlexGen",
      {"kv_block_tokens", "share_prefix"},
      /*exact=*/true,
      /*selects_loads=*/false,
      [](Device) { return true; },  // copies and the model's ops only
      [](const MemoryRequest& r) -> KvMemory {
        const int64_t tokens = request_positions(r);
        return {kv_staging_bytes(r, tokens), kv_pool_bytes(r, tokens), kv_pool_shape(r, tokens)};
      },
      [](const KvStoreArgs& a) -> std::unique_ptr<KvStore> {
        return std::make_unique<OffloadedKv>(a.config, a.batch, a.capacity, a.kv_dtype, a.device,
                                             a.options.kv_block_tokens, a.engine, a.stats);
      },
      /*resumable=*/true,
      /*session_options=*/{},
      /*host_token_rows=*/true};
  return policy;
}

const KvPolicy& gpu_kv_policy() {
  static const KvPolicy policy{
      "gpu",
      "every layer's KV resident on the device, when it fits",
      {"share_prefix"},
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
        return std::make_unique<ResidentKv>(a.config, a.batch, a.capacity, a.kv_dtype, a.device,
                                            a.engine, a.stats);
      },
      /*resumable=*/true};
  return policy;
}

OffloadedKv::OffloadedKv(const ModelConfig& config, int64_t batch, int64_t capacity, DType kv_dtype,
                         Device device, int64_t block_tokens, TransferEngine& engine,
                         OffloadStats& stats, int64_t pool_tokens)
    : PipelinedKv(batch, capacity, config.num_layers, engine, stats),
      pool_({config.num_layers, batch, config.kv_heads(), config.head_dim(),
             pool_tokens > 0 ? pool_tokens : capacity, block_tokens, kv_dtype}) {
  const Shape staging = {batch, config.kv_heads(), capacity, config.head_dim()};
  const Shape store = {batch, config.kv_heads(), 1, config.head_dim()};
  // The largest transfer either way: a layer's K and V, one chunk per (sequence, head, block).
  const int64_t blocks = (capacity + block_tokens - 1) / block_tokens;
  engine.reserve_gathers(
      static_cast<size_t>(2 * batch * config.kv_heads() * blocks),
      static_cast<size_t>(2 * batch * config.kv_heads() * capacity * config.head_dim()) *
          dtype_size(kv_dtype));
  for (int p = 0; p < 2; ++p) {
    staging_keys_[p] = Tensor::empty(staging, kv_dtype, device);
    staging_values_[p] = Tensor::empty(staging, kv_dtype, device);
    store_keys_[p] = Tensor::empty(store, kv_dtype, device);
    store_values_[p] = Tensor::empty(store, kv_dtype, device);
  }
}

OffloadedKv::~OffloadedKv() {
  try {
    engine_.synchronize();  // transfers still read our buffers
  } catch (...) {
    // The failure was already reported to the pass that caused it.
  }
}

void OffloadedKv::issue_load(int64_t layer) {
  const size_t p = static_cast<size_t>(layer % 2);
  Tensor& keys = staging_keys_[p];
  Tensor& values = staging_values_[p];
  if (debug_poison()) {  // rows that the load does not bring must never be read
    fill_nan(keys);
    fill_nan(values);
  }
  // A shared prefix's blocks come once, into its group leader's rows, which every member reads.
  std::vector<CopyChunk> chunks;
  pool_.gather_chunks(layer, KvKind::Key, 0, length(), keys.raw(), capacity(), 0, &chunks);
  pool_.gather_chunks(layer, KvKind::Value, 0, length(), values.raw(), capacity(), 0, &chunks);
  const uint64_t bytes = total_bytes(chunks);
  LayerTraffic& traffic = stats_.current().layers[static_cast<size_t>(layer)];
  traffic.kv_h2d_bytes += bytes;
  // Rows each sequence's attention reads (a shared row once per sequence that reads it).
  for (int64_t b = 0; b < batch(); ++b) {
    const int64_t own = length() - first_valid()[static_cast<size_t>(b)];
    traffic.tokens_fetched +=
        static_cast<uint64_t>((shared().prefix_length(b) + own) * keys.dim(1));
  }
  traffic.tokens_stored = traffic.tokens_fetched;
  stats_.current().h2d_bytes += bytes;
  // The pool must hold the previous step's token of this layer before it is read.
  loaded_[static_cast<size_t>(layer)] =
      engine_.load(std::move(chunks), stored_[static_cast<size_t>(layer)], {"kv_load", layer});
}

void OffloadedKv::append(int64_t layer, const Tensor& keys, const Tensor& values) {
  const size_t p = static_cast<size_t>(layer % 2);
  if (length() == 0) {
    // Prefill: attention reads the fresh rows directly; staging[p] only carries them to the pool.
    // It was last read by the store of layer - 2.
    if (layer >= 2) engine_.compute_stream().wait(stored_[static_cast<size_t>(layer - 2)]);
    store_pass_rows(keys, staging_keys_[p]);
    store_pass_rows(values, staging_values_[p]);
    if (sharing_pass()) {
      store_shared_prefixes(layer);
      return;
    }
    issue_store(layer, staging_keys_[p], staging_values_[p], 0, pass_tokens());
    return;
  }
  // Decode: the new rows join this step's staging (attention reads them). One row goes to the
  // pool from the store buffer, which the store of layer - 2 has finished reading; the rows of an
  // extension go from staging[p], and are in the pool before the load of layer + 2 overwrites it.
  ops::cache_store(keys, staging_keys_[p], length());
  ops::cache_store(values, staging_values_[p], length());
  if (pass_tokens() == 1) {
    store_new_token(layer, keys, values);
    return;
  }
  issue_store(layer, staging_keys_[p], staging_values_[p], length(), pass_tokens());
  stored_[static_cast<size_t>(layer)]->wait();
}

void OffloadedKv::resume(int64_t length, std::vector<int32_t> first_valid, int64_t num_layers,
                         LayerRestorer restore) {
  PipelinedKv::resume(length, std::move(first_valid), num_layers, std::move(restore));
  if (!shared().empty()) {
    const int64_t block = pool_.shape().block_tokens;
    for (int64_t prefix : shared().lengths()) {
      INFINIGEN_CHECK(prefix % block == 0, "the conversation shares a ", prefix,
                      "-token prefix, which is not whole blocks of ", option("kv_block_tokens"),
                      " ", block, ": continue it with the block size it was saved with");
    }
    pool_.share(shared());
  }
  pool_.reserve(length);
}

std::vector<KvStore::TokenStream> OffloadedKv::token_streams(int64_t) const {
  const KvPoolShape& s = pool_.shape();
  return {{"keys", s.dtype, s.head_dim}, {"values", s.dtype, s.head_dim}};
}

const void* OffloadedKv::token_row(int64_t layer, size_t stream, int64_t b, int64_t h,
                                   int64_t t) const {
  return pool_.row(layer, stream == 0 ? KvKind::Key : KvKind::Value, b, h, t);
}

void OffloadedKv::store_shared_prefixes(int64_t layer) {
  if (pool_.num_blocks() == 0) pool_.share(shared());
  const size_t p = static_cast<size_t>(layer % 2);
  std::vector<CopyChunk> chunks;
  pool_.scatter_shared_chunks(layer, KvKind::Key, staging_keys_[p].raw(), capacity(), 0,
                              shared_rows(), &chunks);
  pool_.scatter_shared_chunks(layer, KvKind::Value, staging_values_[p].raw(), capacity(), 0,
                              shared_rows(), &chunks);
  submit_store(layer, std::move(chunks));
}

void OffloadedKv::submit_store(int64_t layer, std::vector<CopyChunk> chunks) {
  const uint64_t bytes = total_bytes(chunks);
  stats_.current().layers[static_cast<size_t>(layer)].kv_d2h_bytes += bytes;
  stats_.current().d2h_bytes += bytes;
  stored_[static_cast<size_t>(layer)] =
      engine_.store(std::move(chunks), nullptr, {"kv_store", layer});
}

void OffloadedKv::store_new_token(int64_t layer, const Tensor& keys, const Tensor& values) {
  const size_t p = static_cast<size_t>(layer % 2);
  engine_.compute_stream().wait(store_buffer_read_[p]);
  ops::cache_store(keys, store_keys_[p], 0);
  ops::cache_store(values, store_values_[p], 0);
  issue_store(layer, store_keys_[p], store_values_[p], 0, 1);
  store_buffer_read_[p] = stored_[static_cast<size_t>(layer)];
}

void OffloadedKv::issue_store(int64_t layer, const Tensor& keys, const Tensor& values, int64_t row0,
                              int64_t n) {
  std::vector<CopyChunk> chunks;
  const int64_t src_capacity = keys.dim(2);
  pool_.scatter_chunks(layer, KvKind::Key, keys.raw(), src_capacity, row0, length(), n, &chunks);
  pool_.scatter_chunks(layer, KvKind::Value, values.raw(), src_capacity, row0, length(), n,
                       &chunks);
  submit_store(layer, std::move(chunks));
}

void OffloadedKv::end_pass(int64_t n_new) {
  // Before the first decode step, every block the run can fill is pinned: no step allocates
  // (the pool grows in the prompt's passes only).
  if (!sharing_pass()) pool_.reserve(pool_.shape().max_tokens);
  stats_.current().host_kv_bytes = pool_.allocated_bytes();
  PipelinedKv::end_pass(n_new);
}

KvStore::View OffloadedKv::view(int64_t layer) {
  wait_for_load(layer);
  const size_t p = static_cast<size_t>(layer % 2);
  return {&staging_keys_[p], &staging_values_[p], length() + pass_tokens(), nullptr, &shared()};
}

ResidentKv::ResidentKv(const ModelConfig& config, int64_t batch, int64_t capacity, DType kv_dtype,
                       Device device, TransferEngine& engine, OffloadStats& stats)
    : KvCache(config, batch, capacity, kv_dtype, device),
      num_layers_(config.num_layers),
      engine_(engine),
      stats_(stats) {}

void ResidentKv::start_pass(int64_t n_new) {
  KvCache::start_pass(n_new);
  if (pass_opens_step()) {
    engine_.settle_stalls();  // streamed weights' waits, into the previous step's statistics
    stats_.begin_step(num_layers_, engine_.counters());
  }
}

void ResidentKv::end_pass(int64_t n_new) {
  const bool closes_step = pass_closes_step();
  KvCache::end_pass(n_new);
  if (closes_step) stats_.end_step(engine_.counters());
}

}  // namespace infinigen
