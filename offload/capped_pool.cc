// offload: the capped KV pool's positions and eviction.
#include "offload/capped_pool.h"

#include <algorithm>
#include <numeric>

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
  return apply_prompt_keep(layer, keep, first_valid, n);
}

std::vector<std::vector<int32_t>> CappedPool::keep_prompt_newest(
    int64_t layer, const std::vector<int32_t>& first_valid, int64_t n) {
  std::vector<PromptKeep> keep(static_cast<size_t>(batch_ * kv_heads_));
  for (int64_t row = 0; row < batch_ * kv_heads_; ++row) {
    const int64_t first =
        std::max<int64_t>(first_valid[static_cast<size_t>(row / kv_heads_)], n - slots_);
    PromptKeep& mine = keep[static_cast<size_t>(row)];
    for (int64_t t = first; t < n; ++t) mine.tokens.push_back(static_cast<int32_t>(t));
    mine.fetches.assign(mine.tokens.size(), 0);
    mine.last_fetch.assign(mine.tokens.size(), -1);
  }
  return apply_prompt_keep(layer, keep, first_valid, n);
}

std::vector<std::vector<int32_t>> CappedPool::apply_prompt_keep(
    int64_t layer, std::vector<PromptKeep>& keep, const std::vector<int32_t>& first_valid,
    int64_t n) {
  const size_t l = static_cast<size_t>(layer);
  const int64_t B = batch_, H = kv_heads_;
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

int64_t CappedPool::record(int64_t layer, int64_t row, int64_t position) const {
  const EvictionTable& table = eviction_[static_cast<size_t>(layer)];
  switch (table.policy()) {
    case EvictionPolicy::Counter:
      return table.counter(row, position);
    case EvictionPolicy::Lru:
      return table.last_use(row, position);
    case EvictionPolicy::Fifo:
      return 0;
  }
  return 0;
}

void CappedPool::record_as_history(int64_t record, int64_t& fetches, int64_t& last_fetch) const {
  const EvictionPolicy policy = eviction_.front().policy();
  fetches = policy == EvictionPolicy::Counter ? record : 0;
  last_fetch = policy == EvictionPolicy::Lru ? record : -1;
}

CappedPool::Held CappedPool::held(int64_t layer, int64_t row) const {
  const int32_t* row_tokens = tokens_[static_cast<size_t>(layer)].data() + row * slots_;
  std::vector<std::pair<int32_t, int32_t>> order;  // (token, position), oldest first
  for (int64_t p = 0; p < slots_; ++p) {
    if (row_tokens[p] >= 0) order.emplace_back(row_tokens[p], static_cast<int32_t>(p));
  }
  std::sort(order.begin(), order.end());
  Held held;
  for (const auto& [token, position] : order) {
    int64_t fetches = 0, last_fetch = -1;
    record_as_history(record(layer, row, position), fetches, last_fetch);
    held.entries.tokens.push_back(token);
    held.entries.fetches.push_back(fetches);
    held.entries.last_fetch.push_back(last_fetch);
    held.positions.push_back(position);
  }
  return held;
}

std::vector<std::pair<int32_t, int32_t>> CappedPool::refill_row(int64_t layer, int64_t row,
                                                                const Held& before,
                                                                const PromptKeep& keep,
                                                                int64_t first_new,
                                                                int64_t& evicted) {
  const auto used = std::ssize(before.positions);
  INFINIGEN_CHECK(std::ssize(keep.tokens) <= slots_, "capped pool: ", keep.tokens.size(),
                  " tokens kept in ", slots_, " positions");
  std::vector<int32_t> tokens(keep.tokens.size(), -1);
  std::vector<int64_t> fetches(tokens.size(), 0), last_fetch(tokens.size(), -1);
  std::vector<char> taken(static_cast<size_t>(slots_), 0);
  std::vector<int32_t> position_of(keep.tokens.size(), -1);
  // The held tokens kept stay where they are.
  int64_t kept_held = 0;
  for (size_t i = 0; i < keep.tokens.size(); ++i) {
    const int32_t token = keep.tokens[i];
    if (token >= first_new) continue;
    const auto at =
        std::lower_bound(before.entries.tokens.begin(), before.entries.tokens.end(), token);
    INFINIGEN_CHECK(at != before.entries.tokens.end() && *at == token, "capped pool: token ", token,
                    " kept but not held");
    position_of[i] = before.positions[static_cast<size_t>(at - before.entries.tokens.begin())];
    taken[static_cast<size_t>(position_of[i])] = 1;
    ++kept_held;
  }
  evicted += used - kept_held;
  // The pass's kept tokens: the evicted held tokens' positions, then the free ones.
  std::vector<std::pair<int32_t, int32_t>> placed;
  int64_t next = 0;
  for (size_t i = 0; i < keep.tokens.size(); ++i) {
    if (keep.tokens[i] < first_new) continue;
    while (taken[static_cast<size_t>(next)] != 0) ++next;
    taken[static_cast<size_t>(next)] = 1;
    position_of[i] = static_cast<int32_t>(next);
    placed.emplace_back(keep.tokens[i], static_cast<int32_t>(next));
  }
  // Every kept token at its position, with its history.
  for (size_t i = 0; i < keep.tokens.size(); ++i) {
    const auto j = static_cast<size_t>(position_of[i]);
    tokens[j] = keep.tokens[i];
    fetches[j] = keep.fetches[i];
    last_fetch[j] = keep.last_fetch[i];
  }
  fill_row(layer, row, tokens, fetches, last_fetch);
  return placed;
}

void CappedPool::fill_row(int64_t layer, int64_t row, const std::vector<int32_t>& tokens,
                          const std::vector<int64_t>& fetches,
                          const std::vector<int64_t>& last_fetch) {
  EvictionTable& table = eviction_[static_cast<size_t>(layer)];
  int32_t* row_tokens = tokens_[static_cast<size_t>(layer)].data() + row * slots_;
  table.clear_row(row);
  std::fill_n(row_tokens, slots_, -1);
  std::copy(tokens.begin(), tokens.end(), row_tokens);
  // In age order, each insertion is O(1).
  std::vector<int32_t> order(tokens.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return tokens[static_cast<size_t>(a)] < tokens[static_cast<size_t>(b)];
  });
  for (int32_t j : order) table.on_insert(row, j, tokens[static_cast<size_t>(j)]);
  table.seed_row(row, fetches, last_fetch);
}

void CappedPool::count_extension_drops(int64_t evicted, int64_t not_kept) {
  if (!stats_) return;
  stats_->evictions += static_cast<uint64_t>(evicted);
  stats_->prompt_not_kept += static_cast<uint64_t>(not_kept);
}

void CappedPool::save(int64_t layer, const std::vector<int32_t>& first_valid, int32_t* tokens,
                      int32_t* records) const {
  const bool lru = eviction_.front().policy() == EvictionPolicy::Lru;
  for (int64_t row = 0; row < batch_ * kv_heads_; ++row) {
    const int32_t start = first_valid[static_cast<size_t>(row / kv_heads_)];
    for (int64_t p = 0; p < slots_; ++p) {
      const int32_t token = token_at(layer, row / kv_heads_, row % kv_heads_, p);
      const size_t at = static_cast<size_t>(row * slots_ + p);
      tokens[at] = token >= 0 ? token - start : -1;
      records[at] =
          token >= 0 ? static_cast<int32_t>(record(layer, row, p) - (lru ? start : 0)) : 0;
    }
  }
}

void CappedPool::restore_row(int64_t layer, int64_t row, const std::vector<int32_t>& tokens,
                             const std::vector<int64_t>& records) {
  INFINIGEN_CHECK(std::ssize(tokens) <= slots_ && records.size() == tokens.size(),
                  "capped pool: ", tokens.size(), " tokens restored into ", slots_, " positions");
  std::vector<int64_t> fetches(tokens.size()), last_fetch(tokens.size());
  for (size_t j = 0; j < tokens.size(); ++j)
    record_as_history(records[j], fetches[j], last_fetch[j]);
  fill_row(layer, row, tokens, fetches, last_fetch);
}

void CappedPool::keep_sequences(const std::vector<int64_t>& keep) {
  for (size_t l = 0; l < tokens_.size(); ++l) {
    compact_batch(tokens_[l], keep, static_cast<size_t>(kv_heads_ * slots_));
    eviction_[l].keep_sequences(keep, kv_heads_);
  }
  batch_ = std::ssize(keep);
}

}  // namespace infinigen
