// offload: the `infinigen` KV policy.
#include "offload/infinigen_kv.h"

#include <chrono>
#include <cmath>

#include "core/ops.h"
#include "core/opt_weights.h"

namespace infinigen {

InfinigenKv::InfinigenKv(const ModelConfig& config, int64_t batch, int64_t capacity, DType kv_dtype,
                         Device device, int64_t block_tokens, TransferEngine& engine,
                         OffloadStats& stats, const SpeculationOptions& options, bool check_recall)
    : OffloadedKv(config, batch, capacity, kv_dtype, device, block_tokens, engine, stats),
      options_(options),
      check_recall_(check_recall),
      head_dim_(config.head_dim()),
      partial_(static_cast<size_t>(config.num_layers)),
      selection_(static_cast<size_t>(config.num_layers)) {
  options_.validate();
  if (options_.max_num_kv == 0) {
    options_.max_num_kv = std::max<int64_t>(1, capacity / 5);  // 20% of prompt + generation
  }
  INFINIGEN_CHECK(device == Device::Cpu, "--policy infinigen runs on the CPU backend for now");
}

void InfinigenKv::begin_layer(int64_t layer) {
  // Dense layers load everything, as `full` does; sparse ones are loaded from observe().
  if (dense(layer + 1)) OffloadedKv::begin_layer(layer);
}

void InfinigenKv::observe(int64_t layer, const Tensor& normed, const Tensor& queries,
                          const OptLayerWeights& weights) {
  if (length() == 0) {
    prefill_queries_ = &queries;
    prefill_weights_ = &weights;
    return;
  }
  if (check_recall_) decode_queries_ = queries;
  // Speculate the next layer's attention from this layer's input, and start its load.
  if (layer + 1 < static_cast<int64_t>(partial_.size()) && !dense(layer + 1)) {
    select_and_load(layer + 1, normed);
  }
}

void InfinigenKv::append(int64_t layer, const Tensor& keys, const Tensor& values) {
  const size_t l = static_cast<size_t>(layer);
  if (length() == 0) {
    OffloadedKv::append(layer, keys, values);
    if (dense(layer)) return;
    // The partial columns come from the real queries, before the 1/sqrt(d) scaling.
    Tensor queries = prefill_queries_->clone();
    ops::scale_inplace(queries, std::sqrt(static_cast<float>(head_dim_)));
    const int64_t r = std::max<int64_t>(
        1,
        static_cast<int64_t>(std::floor(options_.partial_ratio * static_cast<double>(head_dim_))));
    partial_[l].build(queries, keys, prefill_weights_->q_weight, prefill_weights_->q_bias,
                      first_valid(), keys.dim(1) / head_dim_, capacity(), r, options_.index_rule);
    return;
  }
  if (dense(layer)) {
    OffloadedKv::append(layer, keys, values);
    return;
  }
  // The new token goes after the selected rows (row n'), and to the pool and partial key cache.
  const size_t p = l % 2;
  ops::cache_store(keys, staging_keys_[p], selection_[l].fetch);
  ops::cache_store(values, staging_values_[p], selection_[l].fetch);
  store_new_token(layer, keys, values);
  partial_[l].append(keys, length());
}

void InfinigenKv::select_and_load(int64_t layer, const Tensor& normed) {
  const size_t l = static_cast<size_t>(layer), p = l % 2;
  PartialLayer::Selection& sel = selection_[l];
  sel = partial_[l].speculate(normed, length(), first_valid(), options_.alpha, options_.max_num_kv);
  Tensor& keys = staging_keys_[p];
  Tensor& values = staging_values_[p];
  if (debug_poison()) {
    fill_nan(keys);
    fill_nan(values);
  }
  const int64_t B = batch(), H = keys.dim(1), d = keys.dim(3), cap = keys.dim(2);
  const size_t row_bytes = static_cast<size_t>(d) * dtype_size(keys.dtype());
  std::vector<CopyChunk> chunks;
  chunks.reserve(static_cast<size_t>(2 * B * H * sel.fetch));
  LayerTraffic& traffic = stats_.current().layers[l];
  for (int64_t b = 0; b < B; ++b) {
    const int64_t take = sel.take[static_cast<size_t>(b)];
    for (int64_t h = 0; h < H; ++h) {
      const int32_t* tokens = sel.tokens.data() + (b * H + h) * sel.fetch;
      for (int64_t j = 0; j < take; ++j) {
        const size_t dst_row = static_cast<size_t>((b * H + h) * cap + sel.fetch - take + j);
        chunks.push_back({static_cast<char*>(keys.raw()) + dst_row * row_bytes,
                          pool_.row(layer, KvKind::Key, b, h, tokens[j]), row_bytes});
        chunks.push_back({static_cast<char*>(values.raw()) + dst_row * row_bytes,
                          pool_.row(layer, KvKind::Value, b, h, tokens[j]), row_bytes});
      }
    }
    traffic.tokens_fetched += static_cast<uint64_t>(take * H);
    traffic.tokens_stored += static_cast<uint64_t>((length() - first_valid()[b]) * H);
  }
  const uint64_t bytes = static_cast<uint64_t>(chunks.size() * row_bytes);
  traffic.kv_h2d_bytes += bytes;
  stats_.current().h2d_bytes += bytes;
  loaded_[l] = engine_.load(std::move(chunks), stored_[l]);
}

KvStore::View InfinigenKv::view(int64_t layer) {
  if (dense(layer)) return OffloadedKv::view(layer);
  const size_t l = static_cast<size_t>(layer), p = l % 2;
  const auto start = std::chrono::steady_clock::now();
  loaded_[l]->wait();
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  LayerTraffic& traffic = stats_.current().layers[l];
  traffic.load_wait_seconds += waited;
  stats_.current().load_wait_seconds += waited;
  const PartialLayer::Selection& sel = selection_[l];
  compact_first_valid_.resize(static_cast<size_t>(batch()));
  for (int64_t b = 0; b < batch(); ++b) {
    compact_first_valid_[static_cast<size_t>(b)] =
        static_cast<int32_t>(sel.fetch - sel.take[static_cast<size_t>(b)]);
  }
  if (check_recall_) traffic.recall = measure_recall(layer);
  return {&staging_keys_[p], &staging_values_[p], sel.fetch + 1, &compact_first_valid_};
}

double InfinigenKv::measure_recall(int64_t layer) const {
  const size_t l = static_cast<size_t>(layer), p = l % 2;
  stored_[l]->wait();  // the pool holds every earlier token of this layer
  const PartialLayer::Selection& sel = selection_[l];
  const Tensor& staged = staging_keys_[p];
  const int64_t B = batch(), H = staged.dim(1), d = staged.dim(3), cap = staged.dim(2);
  const float* q = decode_queries_.data<float>();  // (B, H * d), scaled
  std::vector<float> key(static_cast<size_t>(d));
  double total_recall = 0.0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t start = first_valid()[static_cast<size_t>(b)];
    const int64_t take = sel.take[static_cast<size_t>(b)];
    for (int64_t h = 0; h < H; ++h) {
      const float* query = q + (b * H + h) * d;
      const auto logit = [&](const void* row) {
        convert_to_f32(row, staged.dtype(), key.data(), key.size());
        double dot = 0.0;
        for (int64_t c = 0; c < d; ++c) dot += static_cast<double>(query[c]) * key[c];
        return dot;
      };
      // The current token (row n' of the staging buffer) is always attended.
      const size_t current_row = static_cast<size_t>((b * H + h) * cap + sel.fetch);
      std::vector<double> logits;
      for (int64_t t = start; t < length(); ++t) {
        logits.push_back(logit(pool_.row(layer, KvKind::Key, b, h, t)));
      }
      const double current = logit(static_cast<const char*>(staged.raw()) +
                                   current_row * d * dtype_size(staged.dtype()));
      double top = current;
      for (double v : logits) top = std::max(top, v);
      double all = std::exp(current - top), kept = all;
      for (double v : logits) all += std::exp(v - top);
      const int32_t* tokens = sel.tokens.data() + (b * H + h) * sel.fetch;
      for (int64_t j = 0; j < take; ++j) kept += std::exp(logits[tokens[j] - start] - top);
      total_recall += kept / all;
    }
  }
  return total_recall / static_cast<double>(B * H);
}

}  // namespace infinigen
