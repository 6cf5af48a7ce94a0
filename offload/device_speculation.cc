// offload: the `infinigen` store's speculation, selection and gather on the CUDA device.
#include "offload/device_speculation.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "core/copy_chunk.h"
#include "core/cuda_stream.h"
#include "core/device.h"
#include "core/error.h"

namespace infinigen {
DeviceSpeculation::DeviceSpeculation(int64_t num_layers, int64_t batch, int64_t kv_heads,
                                     int64_t positions, int64_t fetch_cap, const KvPoolShape& pool,
                                     bool capped, const Shape& staging, DType kv_dtype,
                                     int64_t query_width, bool row_cache)
    : batch_(batch),
      kv_heads_(kv_heads),
      positions_(positions),
      layers_(static_cast<size_t>(num_layers)),
      position_tokens_(static_cast<size_t>(num_layers)),
      logits_(Tensor::empty({batch, kv_heads, positions}, DType::F32, Device::Cuda)) {
  const int64_t blocks = (pool.max_tokens + pool.block_tokens - 1) / pool.block_tokens;
  const int64_t rows = batch * kv_heads;
  for (size_t p = 0; p < 2; ++p) {
    selected_[p] = device_selection(batch, kv_heads, fetch_cap);
    summary_[p] = Tensor::pinned({2 + batch}, DType::I32, "a speculation's summary");
    block_tables_[p] =
        Tensor::pinned({2 * batch * blocks}, DType::I64, "the KV pool's block tables");
    if (row_cache) {
      sources_[p] = Tensor::empty({batch, kv_heads, fetch_cap}, DType::I32, Device::Cuda);
      hits_[p] = Tensor::empty({batch, kv_heads}, DType::I32, Device::Cuda);
      host_hits_[p] = Tensor::pinned({batch, kv_heads}, DType::I32, "the row cache's hits");
    }
    if (capped) {
      tokens_[p] = Tensor::pinned({rows, fetch_cap}, DType::I32, "a speculation's selection");
      placed_[p] = Tensor::pinned({batch, kv_heads}, DType::I32, "a capped pool's placed positions",
                                 Device::Cuda);
      static_assert(sizeof(CopyChunk) % sizeof(int64_t) == 0);
      token_pieces_[p] = Tensor::pinned(
          {rows * static_cast<int64_t>(sizeof(CopyChunk) / sizeof(int64_t))}, DType::I64,
          "a capped pool's token table updates");
      token_value_[p] = Tensor::pinned({1}, DType::I32, "a capped pool's new token");
    }
  }
  if (capped) {
    host_keys_ = Tensor::pinned(staging, kv_dtype, "a dense layer's staged keys");
    host_queries_ = Tensor::pinned({batch, query_width}, DType::F32, "a dense layer's queries");
  }
}

void DeviceSpeculation::upload(int64_t layer, PartialLayer& partial,
                               const std::vector<int32_t>* position_tokens, bool keys_on_host) {
  const size_t l = static_cast<size_t>(layer);
  layers_[l].upload(partial, keys_on_host);
  partial.release_keys();
  if (position_tokens != nullptr) {
    Tensor& tokens = position_tokens_[l];
    tokens = Tensor::empty({batch_, kv_heads_, positions_}, DType::I32, Device::Cuda);
    INFINIGEN_CHECK(position_tokens->size() * sizeof(int32_t) == tokens.nbytes(),
                    "speculation: ", position_tokens->size(), " position tokens for ",
                    tokens.numel(), " positions");
    device_copy(tokens.raw(), Device::Cuda, position_tokens->data(), Device::Cpu, tokens.nbytes());
  }
}

void DeviceSpeculation::build_from_prompt(int64_t layer, const PartialLayer& partial,
                                          const Tensor& keys, int64_t past, const KvPool& pool,
                                          const std::vector<int32_t>& first_valid,
                                          bool keys_on_host) {
  DevicePartialLayer& device = layers_[static_cast<size_t>(layer)];
  device.adopt(partial, keys_on_host);
  ops::PoolKeyBlocks blocks;
  if (past > 0) {
    const KvPoolShape& shape = pool.shape();
    const int64_t per_layer =
        batch_ * ((shape.max_tokens + shape.block_tokens - 1) / shape.block_tokens);
    INFINIGEN_CHECK(pool.num_blocks() * batch_ <= per_layer, "speculation: ", pool.num_blocks(),
                    " blocks per sequence in a pool of ", shape.max_tokens, " tokens");
    if (!prompt_tables_.defined()) {
      prompt_tables_ = Tensor::pinned({std::ssize(layers_) * per_layer}, DType::I64,
                                      "a prompt's key block tables");
    }
    const auto** tables = static_cast<const void**>(prompt_tables_.raw()) + layer * per_layer;
    pool.block_addresses(layer, KvKind::Key, tables);
    blocks = {tables, pool.num_blocks(), pool.shape().block_tokens, pool.shape().dtype};
  }
  device.write_prompt_keys(keys, past, blocks, first_valid);
}

void DeviceSpeculation::copy_keys_to_host(int64_t layer, std::vector<char>& out,
                                          int64_t from) const {
  const DevicePartialLayer& partial = layers_[static_cast<size_t>(layer)];
  const Tensor& keys = partial.keys();  // (B, H_kv, P, r)
  if (out.size() != keys.nbytes()) {
    out.assign(keys.nbytes(), 0);
    from = 0;
  }
  const int64_t runs = keys.dim(0) * keys.dim(1), P = keys.dim(2);
  const size_t row = keys.nbytes() / static_cast<size_t>(runs * P);
  const char* src = static_cast<const char*>(keys.raw());
  for (int64_t i = 0; i < runs; ++i) {
    const size_t at = static_cast<size_t>(i * P + from) * row;
    const size_t bytes = static_cast<size_t>(P - from) * row;
    if (partial.keys_on_host()) {
      std::memcpy(out.data() + at, src + at, bytes);
    } else {
      device_copy(out.data() + at, Device::Cpu, src + at, Device::Cuda, bytes);
    }
  }
}

PartialLayer::Selection DeviceSpeculation::select(int64_t layer, const Tensor& x,
                                                  const std::vector<int32_t>& rope_positions,
                                                  int64_t used,
                                                  const std::vector<int32_t>& first_valid,
                                                  const SpeculationOptions& options,
                                                  Stream& compute, RowCache* cache) {
  const size_t l = static_cast<size_t>(layer), p = l % 2;
  ops::SelectionTensors& selected = selected_[p];
  layers_[l].speculate(x, rope_positions, used, first_valid, position_tokens_[l], options, logits_,
                       selected);
  if (cache != nullptr) {
    INFINIGEN_CHECK(sources_[p].defined(), "speculation: no buffers for a row cache");
    cuda_stream::match_cached_rows(cache_kernel_args(*cache, layer, p), sources_[p].data<int32_t>(),
                                   hits_[p].data<int32_t>(), compute.cuda_handle());
    cuda_stream::copy_async(host_hits_[p].raw(), Device::Cpu, hits_[p].raw(), Device::Cuda,
                            hits_[p].nbytes(), compute.cuda_handle());
  }
  // The layer's one host wait: the compute stream holds nothing after the speculation yet, so
  // the device idles only for the host's turnaround.
  int32_t* summary = summary_[p].data<int32_t>();
  cuda_stream::copy_async(summary, Device::Cpu, selected.summary.raw(), Device::Cuda,
                          selected.summary.nbytes(), compute.cuda_handle());
  const bool with_tokens = tokens_[p].defined();
  if (with_tokens) {
    cuda_stream::copy_async(tokens_[p].raw(), Device::Cpu, selected.tokens.raw(), Device::Cuda,
                            selected.tokens.nbytes(), compute.cuda_handle());
  }
  compute.synchronize();
  cached_rows_ = 0;
  if (cache != nullptr) {
    const int32_t* hits = host_hits_[p].data<int32_t>();
    for (int64_t i = 0; i < batch_ * kv_heads_; ++i) cached_rows_ += hits[i];
  }
  PartialLayer::Selection sel;
  sel.take.assign(summary + 2, summary + 2 + batch_);
  std::memcpy(&sel.mean_count, summary, sizeof(double));
  sel.fetch = std::max<int64_t>(1, *std::max_element(sel.take.begin(), sel.take.end()));
  if (with_tokens) {
    // (B, H_kv, fetch_cap) on the device; (B, H_kv, fetch) on the host.
    const int64_t stride = selected.tokens.dim(2);
    sel.tokens.resize(static_cast<size_t>(batch_ * kv_heads_ * sel.fetch));
    const int32_t* tokens = tokens_[p].data<int32_t>();
    for (int64_t row = 0; row < batch_ * kv_heads_; ++row) {
      std::copy_n(tokens + row * stride, sel.fetch, sel.tokens.begin() + row * sel.fetch);
    }
  }
  return sel;
}

cuda_stream::DeviceSelection DeviceSpeculation::selection_args(size_t parity) const {
  const ops::SelectionTensors& selected = selected_[parity];
  // The summary holds the mean count (a double) and then take[b].
  return {selected.tokens.data<int32_t>(), selected.summary.data<int32_t>() + 2, batch_, kv_heads_,
          selected.tokens.dim(2)};
}

cuda_stream::CachedRows DeviceSpeculation::cache_kernel_args(RowCache& cache, int64_t layer,
                                                             size_t parity) {
  const RowCache::LayerBuffers buffers = cache.layer(layer);
  return {selection_args(parity),        buffers.keys.raw(),
          buffers.values.raw(),          buffers.positions.data<int32_t>(),
          buffers.count.data<int32_t>(), cache.rows()};
}

void DeviceSpeculation::gather(int64_t layer, const PartialLayer::Selection& selection,
                               const KvPool& pool, LayerPipeline& pipeline, RowCache* cache) {
  const size_t p = static_cast<size_t>(layer % 2);
  const int64_t blocks = pool.num_blocks();
  const auto** tables = static_cast<const void**>(block_tables_[p].raw());
  pool.block_addresses(layer, KvKind::Key, tables);
  pool.block_addresses(layer, KvKind::Value, tables + batch_ * blocks);
  Tensor& keys = pipeline.keys(layer);
  const int64_t row_bytes = keys.dim(3) * static_cast<int64_t>(dtype_size(keys.dtype()));
  int64_t rows = 0;
  for (int32_t take : selection.take) rows += 2 * take * kv_heads_;
  cuda_stream::SelectedRows gather{selection_args(p),
                                   tables,
                                   tables + batch_ * blocks,
                                   blocks,
                                   pool.shape().block_tokens,
                                   keys.raw(),
                                   pipeline.values(layer).raw(),
                                   keys.dim(2),
                                   row_bytes};
  if (cache == nullptr) {
    pipeline.load_by_kernel(
        layer,
        [&gather](void* stream) {
          cuda_stream::gather_selected_rows(gather, stream);
          return 0;
        },
        static_cast<uint64_t>(rows * row_bytes), rows);
    return;
  }
  // The rows select() found in the cache are copied from it on the device; the others cross.
  // Then, after the gather on the same stream, the staged selection is the cache's.
  const cuda_stream::CachedRows cached = cache_kernel_args(*cache, layer, p);
  gather.sources = sources_[p].data<int32_t>();
  gather.cached_keys = cached.cached_keys;
  gather.cached_values = cached.cached_values;
  gather.cache_rows = cached.cache_rows;
  const void* staged_values = pipeline.values(layer).raw();
  const int64_t loaded = rows - 2 * cached_rows_;
  pipeline.load_by_kernel(
      layer,
      [&](void* stream) {
        cuda_stream::gather_selected_rows(gather, stream);
        cuda_stream::store_cached_rows(cached, keys.raw(), staged_values, keys.dim(2), row_bytes,
                                       stream);
        return 0;
      },
      static_cast<uint64_t>(loaded * row_bytes), loaded);
  cache->stored(layer, selection.take);
}

void DeviceSpeculation::append(int64_t layer, const Tensor& keys, int64_t position) {
  layers_[static_cast<size_t>(layer)].append(keys, position);
}

void DeviceSpeculation::place(int64_t layer, const Tensor& keys, const std::vector<int32_t>& at,
                              int32_t token, Stream& compute) {
  const size_t l = static_cast<size_t>(layer), p = l % 2;
  INFINIGEN_CHECK(placed_[p].defined() && std::ssize(at) == placed_[p].numel(),
                  "speculation: ", at.size(), " placed positions for a pool of ",
                  placed_[p].numel(), " rows");
  std::copy(at.begin(), at.end(), placed_[p].data<int32_t>());
  layers_[l].append(keys, 0, placed_[p]);
  // The token table on the device: position at[row] of each row now holds `token`.
  *token_value_[p].data<int32_t>() = token;
  auto* pieces = reinterpret_cast<CopyChunk*>(token_pieces_[p].raw());
  auto* table = position_tokens_[l].data<int32_t>();
  for (size_t row = 0; row < at.size(); ++row) {
    pieces[row] = {table + static_cast<int64_t>(row) * positions_ + at[row],
                   token_value_[p].data<int32_t>(), sizeof(int32_t)};
  }
  cuda_stream::copy_pieces(pieces, at.size(), compute.cuda_handle());
}

void DeviceSpeculation::keep_sequences(const std::vector<int64_t>& keep,
                                       const std::vector<KvStore::LeaderMove>& moves,
                                       const SharedPrefixes& shared) {
  const int64_t K = std::ssize(keep);
  for (size_t l = 0; l < layers_.size(); ++l) {
    layers_[l].keep_sequences(keep, moves, shared);
    compact_batch(position_tokens_[l], keep);
  }
  // Scratch and per-step buffers: their first K sequences' part.
  const auto narrow = [](Tensor& t, int64_t rows) {
    if (t.defined()) t = t.slice_rows(0, rows);
  };
  narrow(logits_, K);
  for (size_t p = 0; p < 2; ++p) {
    ops::SelectionTensors& s = selected_[p];
    narrow(s.counts, K);
    narrow(s.valid, K);
    narrow(s.fetch, K);
    narrow(s.summary, 2 + K);  // the mean, then take (B)
    narrow(s.tokens, K);
    narrow(summary_[p], 2 + K);
    narrow(tokens_[p], K * kv_heads_);
    narrow(placed_[p], K);
    narrow(sources_[p], K);
    narrow(hits_[p], K);
    narrow(host_hits_[p], K);
  }
  narrow(host_keys_, K);
  narrow(host_queries_, K);
  batch_ = K;
}

DeviceSpeculation::HostCopies DeviceSpeculation::to_host(const Tensor& staged_keys,
                                                         const Tensor& queries, Stream& compute) {
  INFINIGEN_CHECK(host_keys_.defined() && staged_keys.nbytes() == host_keys_.nbytes() &&
                      queries.nbytes() == host_queries_.nbytes(),
                  "speculation: no host copies of a dense layer's staging of shape ",
                  shape_string(staged_keys.shape()));
  cuda_stream::copy_async(host_keys_.raw(), Device::Cpu, staged_keys.raw(), Device::Cuda,
                          staged_keys.nbytes(), compute.cuda_handle());
  cuda_stream::copy_async(host_queries_.raw(), Device::Cpu, queries.raw(), Device::Cuda,
                          queries.nbytes(), compute.cuda_handle());
  compute.synchronize();
  return {host_keys_, host_queries_};
}

}  // namespace infinigen
