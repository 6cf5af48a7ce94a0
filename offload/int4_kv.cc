// offload: the `int4` KV policy.
#include "offload/int4_kv.h"

#include <vector>

#include "core/compact_batch.h"
#include "core/error.h"
#include "core/saturating.h"
#include "core/trace.h"
#include "offload/kv_policy.h"
#include "offload/memory_planner.h"

namespace infinigen {

const KvPolicy& int4_kv_policy() {
  static const KvPolicy policy{
      "int4",
      "all KV in host memory in 4 bits (groups of 64), loaded every step: FlexGen's compression",
      {"prefill_chunk"},
      /*exact=*/false,
      /*selects_loads=*/false,
      [](Device) { return true; },  // the codec's ops have CPU and CUDA kernels
      [](const MemoryRequest& r) -> KvMemory {
        // Packed codes plus an fp16 min and scale per group of 64, on the host and in the
        // device's code staging (two layers), dequantised into an fp16 staging as full's.
        const ModelConfig& c = r.config;
        const int64_t tokens = request_positions(r);
        const auto row = static_cast<int64_t>(ops::int4_row_bytes(c.head_dim()));
        // The store buffers carry a decode step's token, or a prompt's chunk after the first.
        const int64_t store_rows = int4_store_rows(r.options.prefill_chunk, tokens);
        return {saturating_sum({kv_staging_bytes(r, tokens),
                                saturating_product({2, 2, r.batch, c.kv_heads(), tokens, row}),
                                saturating_product({2, 2, r.batch, c.kv_heads(), store_rows, row})}),
                saturating_product({2, c.num_layers, r.batch, c.kv_heads(), tokens, row})};
      },
      [](const KvStoreArgs& a) -> std::unique_ptr<KvStore> {
        return std::make_unique<Int4Kv>(a.config, a.batch, a.capacity, a.device, a.engine, a.stats,
                                        a.options.prefill_chunk);
      },
      /*resumable=*/true,
      /*session_options=*/{},
      /*host_token_rows=*/true};
  return policy;
}

namespace {

// Fills a meta buffer of `bytes` on `device` with fp16 NaN, so that rows no transfer filled
// decode to NaN (debug_poison only: on CUDA a synchronous copy, ordered after the compute stream).
void poison(uint8_t* meta, size_t bytes, Device device) {
  Tensor halves =
      Tensor::view(meta, {static_cast<int64_t>(bytes / sizeof(f16))}, DType::F16, device, nullptr);
  fill_nan(halves);
}

}  // namespace

int64_t int4_store_rows(int64_t prefill_chunk, int64_t capacity) {
  return std::max<int64_t>(1, std::min(prefill_chunk, capacity));
}

Int4Kv::Int4Kv(const ModelConfig& config, int64_t batch, int64_t capacity, Device device,
               TransferEngine& engine, OffloadStats& stats, int64_t prefill_chunk)
    : KvStore(batch, capacity),
      store_rows_(int4_store_rows(prefill_chunk, capacity)),
      num_heads_(config.kv_heads()),
      head_dim_(config.head_dim()),
      code_bytes_(ops::int4_code_bytes(config.head_dim())),
      meta_bytes_(ops::int4_meta_bytes(config.head_dim())),
      device_(device),
      pipeline_(config.num_layers, engine, stats, {batch, num_heads_, capacity, head_dim_},
                DType::F16, device) {
  const size_t layer_rows = static_cast<size_t>(2 * batch * num_heads_ * capacity);
  host_ = pinned_buffer(static_cast<size_t>(config.num_layers) * layer_rows);
  const size_t store_rows = static_cast<size_t>(2 * batch * num_heads_ * store_rows_);
  for (size_t p = 0; p < 2; ++p) {
    loaded_packed_[p] = device_buffer(layer_rows);
    store_packed_[p] = device_buffer(store_rows);
  }
  // The largest transfer either way, a layer's load or its prefill's store: codes and meta, a
  // chunk each per (K/V, sequence, head). On CUDA the gathers' buffers are then never grown in a
  // decode step.
  engine.reserve_gathers(static_cast<size_t>(2 * 2 * batch * num_heads_), layer_rows * row_bytes());
}

Int4Kv::PackedBuffer Int4Kv::pinned_buffer(size_t rows) const {
  const Free deleter{.device = Device::Cpu, .pinned = true};
  return {{static_cast<uint8_t*>(pinned_alloc(rows * code_bytes_, "the int4 KV codes")), deleter},
          {static_cast<uint8_t*>(pinned_alloc(rows * meta_bytes_, "the int4 KV scales")), deleter}};
}

Int4Kv::PackedBuffer Int4Kv::device_buffer(size_t rows) const {
  const Free deleter{.device = device_, .pinned = false};
  return {{static_cast<uint8_t*>(device_alloc(device_, rows * code_bytes_)), deleter},
          {static_cast<uint8_t*>(device_alloc(device_, rows * meta_bytes_)), deleter}};
}

size_t Int4Kv::row_index(int64_t kind, int64_t b, int64_t h, int64_t t, int64_t rows) const {
  return static_cast<size_t>(((kind * batch() + b) * num_heads_ + h) * rows + t);
}

Int4Kv::Packed Int4Kv::host_layer(int64_t layer) const {
  const size_t rows = static_cast<size_t>(layer * 2 * batch() * num_heads_ * capacity());
  return {host_.codes.get() + rows * code_bytes_, host_.meta.get() + rows * meta_bytes_};
}

ops::Int4Rows Int4Kv::device_rows(Packed packed, int64_t rows) const {
  return {.codes = packed.codes,
          .meta = packed.meta,
          .device = device_,
          .batch = batch(),
          .heads = num_heads_,
          .rows = rows,
          .head_dim = head_dim_};
}

void Int4Kv::keep_sequences(const std::vector<int64_t>& keep, const std::vector<LeaderMove>&) {
  pipeline_.keep_batch(std::ssize(keep));  // after every transfer in flight
  if (dry_run()) return;                   // a dry run has no pool behind it
  // [L][2][B][H][capacity] rows -> [L][2][K][H][capacity].
  const size_t run = static_cast<size_t>(num_heads_ * capacity());
  const int64_t blocks = 2 * pipeline_.num_layers();
  compact_batch_bytes(host_.codes.get(), blocks, batch(), keep, run * code_bytes_);
  compact_batch_bytes(host_.meta.get(), blocks, batch(), keep, run * meta_bytes_);
}

void Int4Kv::start_pass(int64_t n_new) {
  KvStore::start_pass(n_new);
  pipeline_.start_pass(*this);
  if (length() > 0) issue_load(0);  // decode: layer 0's KV starts moving before the embedding
}

void Int4Kv::start_layer(int64_t layer) {
  // While this layer computes, the next layer's KV moves into the other staging buffer (which
  // layer - 1 has finished reading: compute runs in order).
  if (length() > 0 && layer + 1 < pipeline_.num_layers()) issue_load(layer + 1);
}

void Int4Kv::issue_load(int64_t layer) {
  const Packed dst = loaded_packed_[static_cast<size_t>(layer % 2)].get();
  if (debug_poison() && !dry_run()) {  // rows that the load does not bring must never be read
    // The whole buffer, which the store of layer - 2 may still read in a resumed turn's first
    // pass (append); a load writes only rows [0, length()), which that store does not read.
    pipeline_.await_store_reads(layer);
    const size_t layer_rows = row_index(2, 0, 0, 0, capacity());
    poison(dst.meta, layer_rows * meta_bytes_, device_);
    pipeline_.poison(layer);
  }
  const Packed src = host_layer(layer);
  std::vector<CopyChunk> chunks;
  for (int64_t kind = 0; kind < 2; ++kind) {
    for (int64_t b = 0; b < batch(); ++b) {
      for (int64_t h = 0; h < num_heads_; ++h) {
        const size_t row = row_index(kind, b, h, 0, capacity());
        const size_t n = static_cast<size_t>(length());
        chunks.push_back(
            {dst.codes + row * code_bytes_, src.codes + row * code_bytes_, n * code_bytes_});
        chunks.push_back(
            {dst.meta + row * meta_bytes_, src.meta + row * meta_bytes_, n * meta_bytes_});
      }
    }
  }
  LayerTraffic& traffic = pipeline_.traffic(layer);
  for (int32_t start : first_valid()) {
    traffic.tokens_fetched += static_cast<uint64_t>((length() - start) * num_heads_);
  }
  traffic.tokens_stored = traffic.tokens_fetched;
  pipeline_.load(layer, std::move(chunks));
}

void Int4Kv::issue_store(int64_t layer, Packed src, int64_t src_rows, int64_t n) {
  const Packed dst = host_layer(layer);
  std::vector<CopyChunk> chunks;
  for (int64_t kind = 0; kind < 2; ++kind) {
    for (int64_t b = 0; b < batch(); ++b) {
      for (int64_t h = 0; h < num_heads_; ++h) {
        const size_t from = row_index(kind, b, h, 0, src_rows);
        const size_t to = row_index(kind, b, h, length(), capacity());
        const size_t rows = static_cast<size_t>(n);
        chunks.push_back(
            {dst.codes + to * code_bytes_, src.codes + from * code_bytes_, rows * code_bytes_});
        chunks.push_back(
            {dst.meta + to * meta_bytes_, src.meta + from * meta_bytes_, rows * meta_bytes_});
      }
    }
  }
  pipeline_.store(layer, std::move(chunks));
}

void Int4Kv::dequantize_into_staging(int64_t layer, Packed src, int64_t src_rows, int64_t t0,
                                     int64_t t1, int64_t row0) {
  // Left padding is never read by attention, so it is not decoded (NaN in poison mode).
  ops::int4_dequantize(device_rows(src, src_rows), t0, t1, first_valid(), row0,
                       pipeline_.keys(layer), pipeline_.values(layer));
}

void Int4Kv::append(int64_t layer, const Tensor& keys, const Tensor& values) {
  const int64_t n = pass_tokens();
  const Shape rows = {batch() * n, num_heads_ * head_dim_};
  INFINIGEN_CHECK(keys.shape() == rows && values.shape() == rows && keys.dtype() == DType::F32 &&
                      values.dtype() == DType::F32,
                  "int4 KV append: expected fp32 rows ", shape_string(rows), ", got ",
                  shape_string(keys.shape()));
  const size_t p = static_cast<size_t>(layer % 2);
  // Quantising writes this parity's buffers, which the store of layer - 2 (or of the previous
  // step's last layers) may still read.
  pipeline_.await_store_reads(layer);
  if (length() == 0) {
    // Prefill: attention reads the fresh rows; the codes go to the pool from this parity's load
    // buffers (no load runs during the prefill).
    ops::int4_quantize(keys, values, device_rows(loaded_packed_[p].get(), capacity()));
    issue_store(layer, loaded_packed_[p].get(), capacity(), n);
    return;
  }
  INFINIGEN_CHECK(n <= store_rows_ || resumed(), "int4 KV: a pass of ", n,
                  " tokens after the prompt's first (", store_rows_,
                  " expected: ", option("prefill_chunk"), ")");
  // Decode (or a prompt's chunk after its first): the new rows go to the pool from this parity's
  // store buffer. A resumed turn's prompt, longer, goes from this parity's load buffer, at the
  // rows after the history's (the load fills [0, length()) of each (K/V, sequence, head)).
  Packed fresh = store_packed_[p].get();
  int64_t fresh_rows = store_rows_;
  if (n > store_rows_) {
    const Packed loaded = loaded_packed_[p].get();
    const size_t skip = static_cast<size_t>(length());
    fresh = {loaded.codes + skip * code_bytes_, loaded.meta + skip * meta_bytes_};
    fresh_rows = capacity();
  }
  ops::int4_quantize(keys, values, device_rows(fresh, fresh_rows));
  issue_store(layer, fresh, fresh_rows, n);
  // This pass's attention reads its rows as later passes will: dequantised from their codes.
  dequantize_into_staging(layer, fresh, fresh_rows, 0, n, length());
}

KvStore::View Int4Kv::view(int64_t layer) {
  // Layer l + 1's load (start_layer(l)) refills layer l - 1's load buffers, which that layer's
  // view has already dequantised: on the compute stream, which the load follows.
  pipeline_.wait_for_load(layer);
  const Packed loaded = loaded_packed_[static_cast<size_t>(layer % 2)].get();
  dequantize_into_staging(layer, loaded, capacity(), 0, length(), 0);
  return {&pipeline_.keys(layer), &pipeline_.values(layer), length() + pass_tokens()};
}

void Int4Kv::end_pass(int64_t n_new) {
  pipeline_.end_pass(*this);  // reads the pass's state before KvStore::end_pass moves it
  KvStore::end_pass(n_new);
}

std::vector<KvStore::TokenStream> Int4Kv::token_streams(int64_t) const {
  INFINIGEN_CHECK(code_bytes_ % sizeof(int32_t) == 0, option("policy"),
                  " int4 keeps a session only for a head_dim that is a multiple of 8, not ",
                  head_dim_);
  const int64_t codes = static_cast<int64_t>(code_bytes_ / sizeof(int32_t));
  const int64_t meta = static_cast<int64_t>(meta_bytes_ / sizeof(f16));
  return {{"key_codes", DType::I32, codes},
          {"key_scales", DType::F16, meta},
          {"value_codes", DType::I32, codes},
          {"value_scales", DType::F16, meta}};
}

const void* Int4Kv::token_row(int64_t layer, size_t stream, int64_t b, int64_t h, int64_t t) const {
  const Packed pool = host_layer(layer);
  const size_t row = row_index(static_cast<int64_t>(stream / 2), b, h, t, capacity());
  return stream % 2 == 0 ? pool.codes + row * code_bytes_ : pool.meta + row * meta_bytes_;
}

}  // namespace infinigen
