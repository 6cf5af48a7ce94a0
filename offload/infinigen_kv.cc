// offload: the `infinigen` KV policy.
#include "offload/infinigen_kv.h"

#include <cmath>

#include "core/ops.h"
#include "core/saturating.h"
#include "core/trace.h"
#include "offload/kv_policy.h"
#include "offload/memory_planner.h"
#include "speculate/prompt_keep.h"

namespace infinigen {

const KvPolicy& infinigen_kv_policy() {
  static const KvPolicy policy{
      "infinigen",
      "all KV in host memory, each layer loads the tokens speculated at the layer before",
      {"alpha", "partial_ratio", "partial_index_rule", "partial_key_dtype", "fetch_rule",
       "max_num_kv", "dense_layers", "kv_pool_limit", "eviction", "check_recall", "kv_block_tokens",
       "share_prefix"},
      /*exact=*/false,
      /*selects_loads=*/true,
      // Speculation and the partial key cache live on the host.
      [](Device device) { return device == Device::Cpu; },
      [](const MemoryRequest& r) -> KvMemory {
        // A staging as `full`'s and the pool (capped or not), plus per layer the partial key
        // cache (B, H_kv, tokens, r) and the partial query weights (H, rows, D) in the weights'
        // dtype with an fp32 bias: r rows per head, or at most d with a rotation (the rotary
        // pairs of the columns, or every row under a skew) and the skew (H_kv, d, d) fp32.
        const ModelConfig& c = r.config;
        const int64_t tokens = request_positions(r);
        const int64_t pooled = r.kv_pool_tokens > 0 ? std::min(r.kv_pool_tokens, tokens) : tokens;
        const SpeculationOptions& s = r.options.speculation;
        const int64_t rp = partial_columns(s.partial_ratio, c.head_dim());
        const int64_t d = c.head_dim(), rows = c.rope.enabled() ? d : rp;
        const auto key_size = static_cast<int64_t>(dtype_size(s.partial_key_dtype));
        const auto weight_size = static_cast<int64_t>(dtype_size(c.dtype));
        return {
            saturating_sum(
                {kv_staging_bytes(r, tokens),
                 saturating_product({c.num_layers, r.batch, c.kv_heads(), tokens, rp, key_size}),
                 saturating_product({c.num_layers, c.num_heads, rows, c.hidden_size, weight_size}),
                 saturating_product({c.num_layers, c.num_heads, rows, 4}),
                 c.rope.enabled() ? saturating_product({c.num_layers, c.kv_heads(), d, d, 4}) : 0}),
            kv_pool_bytes(r, pooled), kv_pool_shape(r, pooled)};
      },
      [](const KvStoreArgs& a) -> std::unique_ptr<KvStore> {
        const OffloadOptions& o = a.options;
        return std::make_unique<InfinigenKv>(a.config, a.batch, a.capacity, a.kv_dtype, a.device,
                                             o.kv_block_tokens, a.engine, a.stats, o.speculation,
                                             o.check_recall,
                                             KvPoolLimit{a.pool_positions, o.eviction}, a.replay);
      },
      /*resumable=*/true,
      // The saved partial keys and columns depend on these.
      {"partial_ratio", "partial_key_dtype", "dense_layers"}};
  return policy;
}

InfinigenKv::InfinigenKv(const ModelConfig& config, int64_t batch, int64_t capacity, DType kv_dtype,
                         Device device, int64_t block_tokens, TransferEngine& engine,
                         OffloadStats& stats, const SpeculationOptions& options, bool check_recall,
                         const KvPoolLimit& limit, const FetchReplay* replay)
    : OffloadedKv(config, batch, capacity, kv_dtype, device, block_tokens, engine, stats,
                  limit.positions > 0 ? std::min(limit.positions, capacity) : 0),
      options_(options),
      check_recall_(check_recall),
      replay_(replay),
      head_dim_(config.head_dim()),
      heads_(config.num_heads),
      kv_heads_(config.kv_heads()),
      group_(config.num_heads / config.kv_heads()),
      slots_(limit.positions > 0 ? std::min(limit.positions, capacity) : capacity),
      hidden_(config.hidden_size),
      weight_dtype_(config.dtype),
      rotary_(config.rope.enabled()),
      partial_(static_cast<size_t>(config.num_layers)),
      selection_(static_cast<size_t>(config.num_layers)) {
  options_.validate();
  INFINIGEN_CHECK(device == Device::Cpu, option("policy"),
                  " infinigen runs on the CPU backend for now");
  INFINIGEN_CHECK(slots_ >= 2, option("kv_pool_limit"), " leaves ", slots_,
                  " position per sequence and head; at least 2 are needed");
  options_.max_num_kv = options_.fetch_cap(capacity);
  if (dry_run()) {
    INFINIGEN_CHECK(replay_ != nullptr, "a dry run of infinigen has no fetched share to replay");
    replay_->validate(config.num_layers);
  }
  if (limited()) {
    position_tokens_.assign(
        static_cast<size_t>(config.num_layers),
        std::vector<int32_t>(static_cast<size_t>(batch * kv_heads_ * slots_), -1));
    for (int64_t l = 0; l < config.num_layers; ++l) {
      eviction_.emplace_back(limit.eviction, batch * kv_heads_, slots_);
    }
  }
}

int32_t InfinigenKv::token_at(int64_t layer, int64_t b, int64_t h, int64_t position) const {
  if (!limited()) return static_cast<int32_t>(position);
  return position_tokens_[static_cast<size_t>(layer)]
                         [static_cast<size_t>((b * kv_heads_ + h) * slots_ + position)];
}

void InfinigenKv::start_layer(int64_t layer) {
  // Dense layers are loaded one layer ahead, as `full` does; speculated ones from observe().
  if (extending() || dense(layer + 1)) OffloadedKv::start_layer(layer);
}

void InfinigenKv::issue_load(int64_t layer) {
  if (!limited()) {
    OffloadedKv::issue_load(layer);
    return;
  }
  selection_[static_cast<size_t>(layer)] = select_all(layer);
  load_selection(layer);
}

void InfinigenKv::observe(int64_t layer, const AttentionInput& input) {
  if (length() == 0) {
    prefill_input_.reset();
    prefill_input_.emplace(input);
    return;
  }
  if (extending()) return;  // every layer is loaded whole; nothing to speculate
  if (check_recall_ || limited()) decode_queries_ = input.queries;
  // Speculate the next layer's attention from this layer's input, and start its load.
  if (layer + 1 < static_cast<int64_t>(partial_.size()) && !dense(layer + 1)) {
    select_and_load(layer + 1, input.x, input.positions);
  }
}

void InfinigenKv::append(int64_t layer, const Tensor& keys, const Tensor& values) {
  const size_t l = static_cast<size_t>(layer);
  const size_t p = l % 2;
  if (length() == 0) {
    prompt_tokens_ = pass_tokens();
    if (limited()) {
      store_prompt_in_capped_pool(layer, keys, values);
    } else {
      OffloadedKv::append(layer, keys, values);
    }
    if (dense(layer)) return;
    const AttentionInput& in = *prefill_input_;
    const int64_t r = partial_columns(options_.partial_ratio, head_dim_);
    // Shared prefixes are a batch of their groups' leaders, their partial keys kept once for
    // every member.
    partial_[l].build({in.queries, keys, in.q_weight, in.q_bias, in.rope_inv_freq, in.skew},
                      pass_first_valid(), heads_, kv_heads_, slots_, r, options_.index_rule,
                      limited() ? &position_tokens_[l] : nullptr, options_.partial_key_dtype);
    if (sharing_pass()) partial_[l].share_prefixes(shared(), /*from_leaders=*/true);
    return;
  }
  if (!compact(layer)) {
    OffloadedKv::append(layer, keys, values);
    if (extending() && !dense(layer)) partial_[l].append(keys, length());
    if (extending()) prompt_tokens_ = length() + pass_tokens();
    return;
  }
  // The new token goes after the staged rows (row n'), and to the pool and partial key cache.
  ops::cache_store(keys, staging_keys_[p], selection_[l].fetch);
  ops::cache_store(values, staging_values_[p], selection_[l].fetch);
  if (!limited()) {
    store_new_token(layer, keys, values);
    partial_[l].append(keys, length());
    return;
  }
  const std::vector<int32_t> positions = place_new_token(layer);
  // As store_new_token, but each row to its own position.
  store_buffer_read_[p]->wait();
  ops::cache_store(keys, store_keys_[p], 0);
  ops::cache_store(values, store_values_[p], 0);
  const size_t row_bytes = static_cast<size_t>(head_dim_) * dtype_size(store_keys_[p].dtype());
  std::vector<CopyChunk> chunks;
  for (int64_t b = 0; b < batch(); ++b) {
    for (int64_t h = 0; h < kv_heads_; ++h) {
      const int64_t at = positions[static_cast<size_t>(b * kv_heads_ + h)];
      const size_t src = static_cast<size_t>(b * kv_heads_ + h) * row_bytes;
      chunks.push_back({pool_.row(layer, KvKind::Key, b, h, at),
                        static_cast<const char*>(store_keys_[p].raw()) + src, row_bytes});
      chunks.push_back({pool_.row(layer, KvKind::Value, b, h, at),
                        static_cast<const char*>(store_values_[p].raw()) + src, row_bytes});
    }
  }
  const uint64_t bytes = static_cast<uint64_t>(chunks.size() * row_bytes);
  stats_.current().layers[l].kv_d2h_bytes += bytes;
  stats_.current().d2h_bytes += bytes;
  // A victim's old row may be among this step's loads of the layer: overwrite it after them.
  stored_[l] =
      engine_.store(std::move(chunks), loaded_[l], {"kv_store", layer, TransferContent::KvRows});
  store_buffer_read_[p] = stored_[l];
  if (!dense(layer)) partial_[l].append(keys, 0, &positions);
}

void InfinigenKv::store_prompt_in_capped_pool(int64_t layer, const Tensor& keys,
                                              const Tensor& values) {
  const size_t l = static_cast<size_t>(layer), p = l % 2;
  const int64_t n = pass_tokens(), B = batch(), H = kv_heads_, d = head_dim_, KV = H * d;
  const int64_t Q = heads_ * d;
  // The prompt's rows go through staging[p], which the store of layer - 2 last read.
  if (layer >= 2) stored_[l - 2]->wait();
  ops::cache_store(keys, staging_keys_[p], 0);
  ops::cache_store(values, staging_values_[p], 0);

  // Which tokens each (sequence, head) keeps: the eviction policy's choice from the prompt's
  // attention (speculate/prompt_keep.h; the query heads of a KV head's group together), and
  // the history they start decoding with.
  const float* q = prefill_input_->queries.data<float>();  // (B * n, H * d), scaled
  const float* k = keys.data<float>();                     // (B * n, H_kv * d)
  std::vector<PromptKeep> keep(static_cast<size_t>(B * H));
#pragma omp parallel for schedule(dynamic)
  for (int64_t row = 0; row < B * H; ++row) {
    const int64_t b = row / H, g = row % H;
    keep[static_cast<size_t>(row)] = keep_prompt_tokens(
        q + b * n * Q + g * group_ * d, Q, group_, k + b * n * KV + g * d, KV,
        first_valid()[static_cast<size_t>(b)], n, d, slots_, options_.alpha, eviction_[l].policy());
  }

  // Every position of the capped pool, now: decode steps write new tokens into free positions,
  // then into victims', and allocate nothing.
  pool_.reserve(slots_);
  const int64_t cap = staging_keys_[p].dim(2);
  const size_t row_bytes = static_cast<size_t>(d) * dtype_size(staging_keys_[p].dtype());
  std::vector<CopyChunk> chunks;
  for (int64_t row = 0; row < B * H; ++row) {
    const int64_t b = row / H, h = row % H;
    const PromptKeep& kept = keep[static_cast<size_t>(row)];
    for (size_t j = 0; j < kept.tokens.size(); ++j) {
      const int64_t token = kept.tokens[j];
      position_tokens_[l][static_cast<size_t>(row * slots_) + j] = static_cast<int32_t>(token);
      eviction_[l].on_insert(row, static_cast<int64_t>(j), token);
      const size_t src = static_cast<size_t>(row * cap + token) * row_bytes;
      chunks.push_back({pool_.row(layer, KvKind::Key, b, h, static_cast<int64_t>(j)),
                        static_cast<const char*>(staging_keys_[p].raw()) + src, row_bytes});
      chunks.push_back({pool_.row(layer, KvKind::Value, b, h, static_cast<int64_t>(j)),
                        static_cast<const char*>(staging_values_[p].raw()) + src, row_bytes});
    }
    eviction_[l].seed_row(row, kept.fetches, kept.last_fetch);
  }
  const uint64_t bytes = total_bytes(chunks);
  stats_.current().layers[l].kv_d2h_bytes += bytes;
  stats_.current().d2h_bytes += bytes;
  stored_[l] =
      engine_.store(std::move(chunks), nullptr, {"kv_store", layer, TransferContent::KvRows});
}

void InfinigenKv::count_dense_fetches(int64_t layer) {
  const size_t l = static_cast<size_t>(layer), p = l % 2;
  const PartialLayer::Selection& sel = selection_[l];
  const Tensor& staged = staging_keys_[p];
  const int64_t H = kv_heads_, d = head_dim_, cap = staged.dim(2);
  const size_t row_bytes = static_cast<size_t>(d) * dtype_size(staged.dtype());
  const float* q = decode_queries_.data<float>();  // (B, H * d) query heads, scaled
  std::vector<float> key(static_cast<size_t>(d)), logits;
  std::vector<char> fetched;
  for (int64_t row = 0; row < batch() * H; ++row) {
    const int64_t take = sel.take[static_cast<size_t>(row / H)];
    // A position counts as fetched when one query head of the group attends within alpha of its
    // own top. Staged rows [fetch - take, fetch) hold the selected positions, row fetch the new
    // token.
    fetched.assign(static_cast<size_t>(take), 0);
    for (int64_t head = row * group_; head < (row + 1) * group_; ++head) {
      const float* query = q + head * d;
      logits.assign(static_cast<size_t>(take + 1), 0.0f);
      for (int64_t j = 0; j <= take; ++j) {
        const size_t staged_row = static_cast<size_t>(row * cap + sel.fetch - take + j);
        convert_to_f32(static_cast<const char*>(staged.raw()) + staged_row * row_bytes,
                       staged.dtype(), key.data(), key.size());
        float dot = 0.0f;
        for (int64_t c = 0; c < d; ++c) dot += query[c] * key[c];
        logits[static_cast<size_t>(j)] = dot;
      }
      const float top = *std::max_element(logits.begin(), logits.end());
      for (int64_t j = 0; j < take; ++j) {
        if (logits[static_cast<size_t>(j)] > top - options_.alpha)
          fetched[static_cast<size_t>(j)] = 1;
      }
    }
    const int32_t* positions = sel.tokens.data() + row * sel.fetch;
    for (int64_t j = 0; j < take; ++j) {
      if (fetched[static_cast<size_t>(j)]) eviction_[l].on_fetch(row, positions[j], length());
    }
  }
}

std::vector<int32_t> InfinigenKv::place_new_token(int64_t layer) {
  const size_t l = static_cast<size_t>(layer);
  const int64_t t = length();  // the prefill reserved every position (store_prompt_in_capped_pool)
  std::vector<int32_t> positions(static_cast<size_t>(batch() * kv_heads_));
  for (int64_t row = 0; row < batch() * kv_heads_; ++row) {
    const int64_t at =
        eviction_[l].full(row) ? eviction_[l].victim(row, t) : eviction_[l].size(row);
    positions[static_cast<size_t>(row)] = static_cast<int32_t>(at);
    position_tokens_[l][static_cast<size_t>(row * slots_ + at)] = static_cast<int32_t>(t);
    eviction_[l].on_insert(row, at, t);
  }
  return positions;
}

PartialLayer::Selection InfinigenKv::select_all(int64_t layer) const {
  PartialLayer::Selection sel;
  const int64_t used = used_positions(), B = batch();
  sel.take.assign(static_cast<size_t>(B), 0);
  std::vector<std::vector<int32_t>> rows(static_cast<size_t>(B * kv_heads_));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < kv_heads_; ++h) {
      for (int64_t p = 0; p < used; ++p) {
        if (token_at(layer, b, h, p) >= first_valid()[static_cast<size_t>(b)]) {
          rows[static_cast<size_t>(b * kv_heads_ + h)].push_back(static_cast<int32_t>(p));
        }
      }
      const int32_t n = static_cast<int32_t>(rows[static_cast<size_t>(b * kv_heads_ + h)].size());
      sel.take[static_cast<size_t>(b)] = h == 0 ? n : std::min(sel.take[static_cast<size_t>(b)], n);
    }
    sel.fetch = std::max<int64_t>(sel.fetch, sel.take[static_cast<size_t>(b)]);
  }
  sel.fetch = std::max<int64_t>(sel.fetch, 1);
  sel.tokens.assign(static_cast<size_t>(B * kv_heads_ * sel.fetch), 0);
  for (int64_t row = 0; row < B * kv_heads_; ++row) {
    const int64_t take = sel.take[static_cast<size_t>(row / kv_heads_)];
    std::copy_n(rows[static_cast<size_t>(row)].begin(), take, sel.tokens.begin() + row * sel.fetch);
  }
  sel.mean_count = static_cast<double>(sel.fetch);
  return sel;
}

void InfinigenKv::select_and_load(int64_t layer, const Tensor& x,
                                  const std::vector<int32_t>& positions) {
  const size_t l = static_cast<size_t>(layer);
  PartialLayer::Selection& sel = selection_[l];
  std::vector<int32_t> replay_take;
  if (dry_run()) {
    std::vector<int64_t> valid(static_cast<size_t>(batch()));
    for (int64_t b = 0; b < batch(); ++b) {
      valid[static_cast<size_t>(b)] =
          used_positions() - first_valid()[static_cast<size_t>(b)] + shared().prefix_length(b);
    }
    replay_take =
        replay_->take(length() - prompt_tokens_ + 1, layer, std::ssize(partial_),
                      options_.dense_layers, kv_heads_, length(), valid, options_.max_num_kv);
  }
  sel = partial_[l].speculate(x, positions, used_positions(), first_valid(), options_,
                              limited() ? &position_tokens_[l] : nullptr, &replay_take);
  if (limited()) {  // each fetched entry counts for the eviction policy
    for (int64_t row = 0; row < batch() * kv_heads_; ++row) {
      const int64_t take = sel.take[static_cast<size_t>(row / kv_heads_)];
      for (int64_t j = 0; j < take; ++j) {
        eviction_[l].on_fetch(row, sel.tokens[static_cast<size_t>(row * sel.fetch + j)], length());
      }
    }
  }
  load_selection(layer);
}

void InfinigenKv::load_selection(int64_t layer) {
  const size_t l = static_cast<size_t>(layer), p = l % 2;
  const PartialLayer::Selection& sel = selection_[l];
  Tensor& keys = staging_keys_[p];
  Tensor& values = staging_values_[p];
  if (debug_poison()) {
    fill_nan(keys);
    fill_nan(values);
  }
  const int64_t B = batch(), H = kv_heads_, cap = keys.dim(2);
  const size_t row_bytes = static_cast<size_t>(head_dim_) * dtype_size(keys.dtype());
  std::vector<CopyChunk> chunks;
  chunks.reserve(static_cast<size_t>(2 * B * H * sel.fetch));
  LayerTraffic& traffic = stats_.current().layers[l];
  // A shared prefix's row crosses the link once, for the first member of its group that selected
  // it: (group, head, position) -> that sequence's staging row. A dry run cannot know which
  // selections coincide (they are replayed, not speculated) and prices every sequence's fetch.
  std::vector<CopyChunk>& copies = shared_row_copies_[p];
  copies.clear();
  const SharedPrefixes& shared = this->shared();
  std::vector<int64_t> first_staged(static_cast<size_t>(shared.num_groups() * H * shared.rows()),
                                    -1);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t take = sel.take[static_cast<size_t>(b)];
    for (int64_t h = 0; h < H; ++h) {
      const int32_t* positions = sel.tokens.data() + (b * H + h) * sel.fetch;
      for (int64_t j = 0; j < take; ++j) {
        const int64_t dst_row = (b * H + h) * cap + sel.fetch - take + j;
        char* key_dst = static_cast<char*>(keys.raw()) + static_cast<size_t>(dst_row) * row_bytes;
        char* value_dst =
            static_cast<char*>(values.raw()) + static_cast<size_t>(dst_row) * row_bytes;
        if (shared.in_prefix(b, positions[j]) && !dry_run()) {
          int64_t& first = first_staged[static_cast<size_t>(
              (shared.group(b) * H + h) * shared.rows() + positions[j])];
          if (first >= 0) {
            const size_t at = static_cast<size_t>(first) * row_bytes;
            copies.push_back({key_dst, static_cast<const char*>(keys.raw()) + at, row_bytes});
            copies.push_back({value_dst, static_cast<const char*>(values.raw()) + at, row_bytes});
            continue;
          }
          first = dst_row;
        }
        chunks.push_back({key_dst, pool_.row(layer, KvKind::Key, b, h, positions[j]), row_bytes});
        chunks.push_back(
            {value_dst, pool_.row(layer, KvKind::Value, b, h, positions[j]), row_bytes});
      }
    }
    traffic.tokens_fetched += static_cast<uint64_t>(take * H);
    // The pool's valid entries of this sequence: its tokens (a shared prefix's included), or its
    // valid positions when capped.
    int64_t valid = length() - first_valid()[static_cast<size_t>(b)] + shared.prefix_length(b);
    if (limited()) {
      valid = 0;
      for (int64_t q = 0; q < used_positions(); ++q) {
        valid += token_at(layer, b, 0, q) >= first_valid()[static_cast<size_t>(b)] ? 1 : 0;
      }
    }
    traffic.tokens_stored += static_cast<uint64_t>(valid * H);
  }
  const uint64_t bytes = static_cast<uint64_t>(chunks.size() * row_bytes);
  traffic.kv_h2d_bytes += bytes;
  stats_.current().h2d_bytes += bytes;
  loaded_[l] =
      engine_.load(std::move(chunks), stored_[l], {"kv_load", layer, TransferContent::KvRows});
}

KvStore::View InfinigenKv::view(int64_t layer) {
  if (!compact(layer)) return OffloadedKv::view(layer);
  const size_t l = static_cast<size_t>(layer), p = l % 2;
  wait_for_load(layer);
  for (const CopyChunk& copy : shared_row_copies_[p]) {  // shared rows loaded once
    device_copy(copy.dst, staging_keys_[p].device(), copy.src, staging_keys_[p].device(),
                copy.bytes);
  }
  LayerTraffic& traffic = stats_.current().layers[l];
  const PartialLayer::Selection& sel = selection_[l];
  compact_first_valid_.resize(static_cast<size_t>(batch()));
  for (int64_t b = 0; b < batch(); ++b) {
    compact_first_valid_[static_cast<size_t>(b)] =
        static_cast<int32_t>(sel.fetch - sel.take[static_cast<size_t>(b)]);
  }
  if (check_recall_ && !dense(layer)) traffic.recall = measure_recall(layer);
  if (limited() && dense(layer)) count_dense_fetches(layer);
  return {&staging_keys_[p], &staging_values_[p], sel.fetch + 1, &compact_first_valid_};
}

double InfinigenKv::measure_recall(int64_t layer) const {
  const size_t l = static_cast<size_t>(layer), p = l % 2;
  stored_[l]->wait();  // the pool holds every earlier entry of this layer
  const PartialLayer::Selection& sel = selection_[l];
  const Tensor& staged = staging_keys_[p];
  const int64_t B = batch(), H = kv_heads_, d = head_dim_, cap = staged.dim(2);
  const float* q = decode_queries_.data<float>();  // (B, heads * d), scaled
  std::vector<float> key(static_cast<size_t>(d));
  double total_recall = 0.0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t take = sel.take[static_cast<size_t>(b)];
    for (int64_t g = 0; g < H; ++g) {
      // Per query head of the group: the share of its attention weight that the staged rows of
      // its KV head carry.
      for (int64_t head = g * group_; head < (g + 1) * group_; ++head) {
        const float* query = q + (b * heads_ + head) * d;
        const auto logit = [&](const void* row) {
          convert_to_f32(row, staged.dtype(), key.data(), key.size());
          double dot = 0.0;
          for (int64_t c = 0; c < d; ++c) dot += static_cast<double>(query[c]) * key[c];
          return dot;
        };
        // Over the pool's valid entries (every earlier token, or what a capped pool still
        // holds), the current token (row n' of the staging buffer) included.
        std::vector<double> logits(static_cast<size_t>(used_positions()), -INFINITY);
        for (int64_t pos = 0; pos < used_positions(); ++pos) {
          const int32_t token = token_at(layer, b, g, pos);
          // The current token, already placed in a capped pool, is counted below.
          if (holds_token(b, token) && token < length()) {
            logits[static_cast<size_t>(pos)] = logit(pool_.row(layer, KvKind::Key, b, g, pos));
          }
        }
        const size_t current_row = static_cast<size_t>((b * H + g) * cap + sel.fetch);
        const double current = logit(static_cast<const char*>(staged.raw()) +
                                     current_row * d * dtype_size(staged.dtype()));
        double top = current;
        for (double v : logits) top = std::max(top, v);
        double all = std::exp(current - top), kept = all;
        for (double v : logits) all += std::exp(v - top);
        const int32_t* positions = sel.tokens.data() + (b * H + g) * sel.fetch;
        for (int64_t j = 0; j < take; ++j) kept += std::exp(logits[positions[j]] - top);
        total_recall += kept / all;
      }
    }
  }
  return total_recall / static_cast<double>(B * heads_);
}

void InfinigenKv::resume(int64_t length, std::vector<int32_t> first_valid, int64_t num_layers,
                         LayerRestorer restore) {
  INFINIGEN_CHECK(!limited(), "a conversation cannot be resumed under ", option("kv_pool_limit"),
                  " yet");
  OffloadedKv::resume(length, std::move(first_valid), num_layers, std::move(restore));
}

std::vector<KvStore::TokenStream> InfinigenKv::token_streams(int64_t layer) const {
  if (limited()) return {};  // positions, not tokens: not saved yet
  std::vector<TokenStream> streams = OffloadedKv::token_streams(layer);
  if (!dense(layer)) {
    streams.push_back({"partial_keys", options_.partial_key_dtype,
                       partial_columns(options_.partial_ratio, head_dim_)});
  }
  return streams;
}

const void* InfinigenKv::token_row(int64_t layer, size_t stream, int64_t b, int64_t h,
                                   int64_t t) const {
  if (stream < 2) return OffloadedKv::token_row(layer, stream, b, h, t);
  return partial_[static_cast<size_t>(layer)].key_row(b, h, t);
}

KvStore::LayerState InfinigenKv::layer_state(int64_t layer) const {
  return dense(layer) ? LayerState{} : partial_[static_cast<size_t>(layer)].state();
}

void InfinigenKv::restore_layer_state(int64_t layer, const LayerState& state) {
  if (dense(layer)) {
    KvStore::restore_layer_state(layer, state);
    return;
  }
  if (state.empty() && dry_run()) {  // shapes only, as a real restore would have them
    partial_[static_cast<size_t>(layer)].restore_shapes(
        batch(), heads_, kv_heads_, head_dim_, slots_,
        partial_columns(options_.partial_ratio, head_dim_), rotary_, hidden_, weight_dtype_,
        options_.partial_key_dtype);
    return;
  }
  INFINIGEN_CHECK(!state.empty(), "layer ", layer, ": the session keeps no speculation state");
  partial_[static_cast<size_t>(layer)].restore(state, batch(), heads_, kv_heads_, head_dim_, slots_,
                                               options_.partial_key_dtype);
  if (!shared().empty()) {
    partial_[static_cast<size_t>(layer)].share_prefixes(shared(), /*from_leaders=*/false);
  }
}

}  // namespace infinigen
