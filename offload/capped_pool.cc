// offload: the capped KV pool's positions and eviction.
#include "offload/capped_pool.h"

#include <algorithm>

#include "core/compact_batch.h"
#include "core/device.h"
#include "core/error.h"
#include "speculate/prompt_keep.h"

namespace infinigen {

CappedPool::CappedPool(int64_t num_layers, int64_t batch, int64_t kv_heads, int64_t slots,
                       EvictionPolicy eviction, OffloadStats* stats, size_t pool_bytes)
    : batch_(batch),
      kv_heads_(kv_heads),
      slots_(slots),
      stats_(stats ? &stats->pool_cap() : nullptr),
      tokens_(static_cast<size_t>(num_layers),
              std::vector<int32_t>(static_cast<size_t>(batch * kv_heads * slots), -1)) {
  for (int64_t l = 0; l < num_layers; ++l)
    eviction_.emplace_back(eviction, batch * kv_heads, slots);
  if (stats_) {
    stats_->positions = slots;
    stats_->bytes = pool_bytes;
  }
}

std::vector<std::vector<int32_t>> CappedPool::keep_prompt(int64_t layer, const Tensor& queries,
                                                          const Tensor& keys,
                                                          const std::vector<int32_t>& first_valid,
                                                          int64_t head_dim, double alpha) {
  const size_t l = static_cast<size_t>(layer);
  const int64_t B = batch_, H = kv_heads_, d = head_dim, n = keys.dim(0) / B;
  const int64_t Q = queries.dim(1), KV = keys.dim(1), group = Q / d / H;
  // Which tokens each (sequence, head) keeps: the eviction policy's choice from the prompt's
  // attention (the query heads of a KV head's group together).
  // The prompt's attention is read on the host (once per prompt): a device's rows are copied.
  const Tensor host_queries = queries.device() == Device::Cpu ? queries : queries.to(Device::Cpu);
  const Tensor host_keys = keys.device() == Device::Cpu ? keys : keys.to(Device::Cpu);
  const float* q = host_queries.data<float>();  // (B * n, H * d), scaled
  const float* k = host_keys.data<float>();     // (B * n, H_kv * d)
  std::vector<PromptKeep> keep(static_cast<size_t>(B * H));
#pragma omp parallel for schedule(dynamic)
  for (int64_t row = 0; row < B * H; ++row) {
    const int64_t b = row / H, g = row % H;
    keep[static_cast<size_t>(row)] = keep_prompt_tokens(
        q + b * n * Q + g * group * d, Q, group, k + b * n * KV + g * d, KV,
        first_valid[static_cast<size_t>(b)], n, d, slots_, alpha, eviction_[l].policy());
  }
  std::vector<std::vector<int32_t>> kept(static_cast<size_t>(B * H));
  for (int64_t row = 0; row < B * H; ++row) {
    PromptKeep& chosen = keep[static_cast<size_t>(row)];
    for (size_t j = 0; j < chosen.tokens.size(); ++j) {
      tokens_[l][static_cast<size_t>(row * slots_) + j] = chosen.tokens[j];
      eviction_[l].on_insert(row, static_cast<int64_t>(j), chosen.tokens[j]);
    }
    eviction_[l].seed_row(row, chosen.fetches, chosen.last_fetch);
    if (stats_) {
      const int64_t valid = n - first_valid[static_cast<size_t>(row / H)];
      stats_->prompt_not_kept +=
          static_cast<uint64_t>(std::max<int64_t>(0, valid - std::ssize(chosen.tokens)));
    }
    kept[static_cast<size_t>(row)] = std::move(chosen.tokens);
  }
  return kept;
}

std::vector<int32_t> CappedPool::place_token(int64_t layer, int64_t token) {
  const size_t l = static_cast<size_t>(layer);
  std::vector<int32_t> positions(static_cast<size_t>(batch_ * kv_heads_));
  for (int64_t row = 0; row < batch_ * kv_heads_; ++row) {
    const bool full = eviction_[l].full(row);
    const int64_t at = full ? eviction_[l].victim(row, token) : eviction_[l].size(row);
    if (full && stats_) ++stats_->evictions;
    positions[static_cast<size_t>(row)] = static_cast<int32_t>(at);
    tokens_[l][static_cast<size_t>(row * slots_ + at)] = static_cast<int32_t>(token);
    eviction_[l].on_insert(row, at, token);
  }
  return positions;
}

PartialLayer::Selection CappedPool::select_all(int64_t layer,
                                               const std::vector<int32_t>& first_valid,
                                               int64_t length) const {
  PartialLayer::Selection sel;
  const int64_t positions = used(length), B = batch_, H = kv_heads_;
  sel.take.assign(static_cast<size_t>(B), 0);
  std::vector<std::vector<int32_t>> rows(static_cast<size_t>(B * H));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      std::vector<int32_t>& row = rows[static_cast<size_t>(b * H + h)];
      for (int64_t p = 0; p < positions; ++p) {
        if (token_at(layer, b, h, p) >= first_valid[static_cast<size_t>(b)]) {
          row.push_back(static_cast<int32_t>(p));
        }
      }
      const int32_t n = static_cast<int32_t>(row.size());
      int32_t& take = sel.take[static_cast<size_t>(b)];
      take = h == 0 ? n : std::min(take, n);
    }
    sel.fetch = std::max<int64_t>(sel.fetch, sel.take[static_cast<size_t>(b)]);
  }
  sel.fetch = std::max<int64_t>(sel.fetch, 1);
  sel.tokens.assign(static_cast<size_t>(B * H * sel.fetch), 0);
  for (int64_t row = 0; row < B * H; ++row) {
    const int64_t take = sel.take[static_cast<size_t>(row / H)];
    std::copy_n(rows[static_cast<size_t>(row)].begin(), take, sel.tokens.begin() + row * sel.fetch);
  }
  sel.mean_count = static_cast<double>(sel.fetch);
  return sel;
}

int64_t CappedPool::valid_entries(int64_t layer, int64_t b, int32_t first_valid,
                                  int64_t length) const {
  int64_t valid = 0;
  for (int64_t p = 0; p < used(length); ++p) valid += token_at(layer, b, 0, p) >= first_valid;
  return valid;
}

void CappedPool::count_fetches(int64_t layer, const PartialLayer::Selection& selection,
                               int64_t step) {
  EvictionTable& table = eviction_[static_cast<size_t>(layer)];
  for (int64_t row = 0; row < batch_ * kv_heads_; ++row) {
    const int64_t take = selection.take[static_cast<size_t>(row / kv_heads_)];
    for (int64_t j = 0; j < take; ++j) {
      table.on_fetch(row, selection.tokens[static_cast<size_t>(row * selection.fetch + j)], step);
    }
  }
}

void CappedPool::count_dense_fetches(int64_t layer, const PartialLayer::Selection& selection,
                                     const Tensor& staged_keys, const Tensor& queries, double alpha,
                                     int64_t step) {
  const int64_t H = kv_heads_, d = staged_keys.dim(3), rows = staged_keys.dim(2);
  const int64_t group = queries.dim(1) / d / H;
  const size_t row_bytes = static_cast<size_t>(d) * dtype_size(staged_keys.dtype());
  const float* q = queries.data<float>();  // (B, H * d) query heads, scaled
  std::vector<float> key(static_cast<size_t>(d)), logits;
  std::vector<char> fetched;
  for (int64_t row = 0; row < batch_ * H; ++row) {
    const int64_t take = selection.take[static_cast<size_t>(row / H)];
    // A position counts as fetched when one query head of the group attends within alpha of its
    // own top. Staged rows [fetch - take, fetch) hold the selected positions, row fetch the new
    // token.
    fetched.assign(static_cast<size_t>(take), 0);
    for (int64_t head = row * group; head < (row + 1) * group; ++head) {
      const float* query = q + head * d;
      logits.assign(static_cast<size_t>(take + 1), 0.0f);
      for (int64_t j = 0; j <= take; ++j) {
        const size_t staged_row = static_cast<size_t>(row * rows + selection.fetch - take + j);
        convert_to_f32(static_cast<const char*>(staged_keys.raw()) + staged_row * row_bytes,
                       staged_keys.dtype(), key.data(), key.size());
        float dot = 0.0f;
        for (int64_t c = 0; c < d; ++c) dot += query[c] * key[c];
        logits[static_cast<size_t>(j)] = dot;
      }
      const float top = *std::max_element(logits.begin(), logits.end());
      for (int64_t j = 0; j < take; ++j) {
        if (logits[static_cast<size_t>(j)] > top - alpha) fetched[static_cast<size_t>(j)] = 1;
      }
    }
    const int32_t* positions = selection.tokens.data() + row * selection.fetch;
    for (int64_t j = 0; j < take; ++j) {
      if (fetched[static_cast<size_t>(j)]) {
        eviction_[static_cast<size_t>(layer)].on_fetch(row, positions[j], step);
      }
    }
  }
}

void CappedPool::keep_sequences(const std::vector<int64_t>& keep) {
  for (size_t l = 0; l < tokens_.size(); ++l) {
    compact_batch(tokens_[l], keep, static_cast<size_t>(kv_heads_ * slots_));
    eviction_[l].keep_sequences(keep, kv_heads_);
  }
  batch_ = std::ssize(keep);
}

}  // namespace infinigen
