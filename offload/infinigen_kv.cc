// offload: the `infinigen` KV policy.
#include "offload/infinigen_kv.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/cuda_stream.h"
#include "core/ops.h"
#include "core/saturating.h"
#include "core/trace.h"
#include "offload/kv_policy.h"
#include "offload/memory_planner.h"
#include "offload/staged_recall.h"

namespace infinigen {

namespace {

// A staging as `full`'s and the pool (capped or not), plus per speculated layer the partial key
// cache (B, H_kv, tokens, r) (in pinned host memory for the last partial_key_host_layers of
// them), and per layer the partial query weights (H, rows, D) in the weights' dtype with an fp32
// bias: r rows per head, or at most d with a rotation (the rotary pairs of the columns, or every
// row under a skew) and the skew (H_kv, d, d) fp32; per layer the partial query rows (B, H, rows)
// fp32 and, under a pool limit, the token of each position (B, H_kv, positions) I32; once the
// logits (B, H_kv, tokens) fp32 and two selections (B, H_kv, n' cap) I32. With the dense layers'
// KV on the device, their whole K and V (B, H_kv, tokens, d) in the KV dtype.
// The device holds the most in one of two phases: the prompt's passes, with the whole staging and
// the partial keys (the CPU backend builds them over the passes; CUDA writes them on the device
// at the last pass, while the staging is still whole), and the decode steps, with the staging of
// decode_staging_rows and the partial keys.
KvMemory infinigen_memory(const MemoryRequest& r) {
  const ModelConfig& c = r.config;
  const int64_t tokens = request_positions(r);
  const bool capped = r.kv_pool_tokens > 0;
  const int64_t pooled = capped ? std::min(r.kv_pool_tokens, tokens) : tokens;
  const SpeculationOptions& s = r.options.speculation;
  const int64_t rp = partial_columns(s.partial_ratio, c.head_dim());
  const int64_t d = c.head_dim(), rows = c.rope.enabled() ? d : rp;
  const auto key_size = static_cast<int64_t>(dtype_size(s.partial_key_dtype));
  const auto weight_size = static_cast<int64_t>(dtype_size(c.dtype));
  const auto kv_size = static_cast<int64_t>(dtype_size(r.kv_dtype));
  const int64_t on_host = partial_key_host_layers(r.options, c.num_layers);
  const int64_t on_device = speculated_layers(r.options, c.num_layers) - on_host;
  const int64_t resident = resident_dense_layers(r.options, c.num_layers, capped);
  const int64_t dense = std::clamp<int64_t>(s.dense_layers, 0, c.num_layers);
  const auto partial_keys = [&](int64_t layers) {
    return saturating_product({layers, r.batch, c.kv_heads(), tokens, rp, key_size});
  };
  const auto whole_kv = [&](int64_t layers) {
    return saturating_product({layers, 2, r.batch, c.kv_heads(), tokens, d, kv_size});
  };
  const size_t speculation = saturating_sum(
      {saturating_product({c.num_layers, c.num_heads, rows, c.hidden_size, weight_size}),
       saturating_product({c.num_layers, c.num_heads, rows, 4}),
       c.rope.enabled() ? saturating_product({c.num_layers, c.kv_heads(), d, d, 4}) : 0,
       saturating_product({c.num_layers, r.batch, c.num_heads, rows, 4}),
       capped ? saturating_product({c.num_layers, r.batch, c.kv_heads(), pooled, 4}) : 0,
       saturating_product({r.batch, c.kv_heads(), pooled, 4}),
       saturating_product({2, r.batch, c.kv_heads(), s.fetch_cap(tokens), 4}), whole_kv(resident)});
  const size_t prompt =
      saturating_sum({kv_staging_bytes(r, tokens), speculation, partial_keys(on_device)});
  const int64_t decode_rows =
      decode_staging_rows(tokens, s.fetch_cap(tokens), dense, resident, capped);
  // The row cache (offload/row_cache.h), allocated once the prompt is done; auto counts as on
  // (the planner decides it before a run).
  const size_t row_cache =
      capped || r.options.row_cache == RowCacheUse::Off
          ? 0
          : RowCache::bytes(speculated_layers(r.options, c.num_layers), r.batch, c.kv_heads(),
                            std::min(s.fetch_cap(tokens), tokens), d, r.kv_dtype);
  const size_t decode = saturating_sum(
      {kv_staging_bytes(r, decode_rows), speculation, partial_keys(on_device), row_cache});
  KvMemory memory{std::max(prompt, decode),
                  saturating_sum({kv_pool_bytes(r, pooled), partial_keys(on_host)}),
                  kv_pool_shape(r, pooled)};
  memory.placement_reads =
      saturating_sum({capped ? 0 : whole_kv(dense - resident), partial_keys(on_host)});
  if (decode_rows < tokens) memory.decode_staging_rows = decode_rows;
  return memory;
}

}  // namespace

int64_t decode_staging_rows(int64_t capacity, int64_t fetch_cap, int64_t dense_layers,
                            int64_t resident_layers, bool capped) {
  if (capped || resident_layers < dense_layers) return capacity;
  return std::min(capacity, fetch_cap + 1);
}

const KvPolicy& infinigen_kv_policy() {
  static const KvPolicy policy{
      "infinigen",
      "all KV in host memory, each layer loads the tokens speculated at the layer before",
      {"alpha", "partial_ratio", "partial_index_rule", "partial_key_dtype", "fetch_rule",
       "max_num_kv", "max_fetch_share", "dense_layers", "dense_kv", "partial_key_host_layers",
       "row_cache", "kv_pool_limit", "eviction", "check_recall", "kv_block_tokens", "share_prefix",
       "prefill_chunk"},
      /*exact=*/false,
      /*selects_loads=*/true,
      // Speculation runs on the host, or on the device (speculate/device_partial.h).
      [](Device) { return true; },
      infinigen_memory,
      [](const KvStoreArgs& a) -> std::unique_ptr<KvStore> {
        const OffloadOptions& o = a.options;
        return std::make_unique<InfinigenKv>(
            a.config, a.batch, a.capacity, a.kv_dtype, a.device, o.kv_block_tokens, a.engine,
            a.stats, o.speculation, o.check_recall, KvPoolLimit{a.pool_positions, o.eviction},
            a.replay,
            InfinigenPlacement{resident_dense_layers(o, a.config.num_layers, a.pool_positions > 0),
                               partial_key_host_layers(o, a.config.num_layers),
                               o.row_cache != RowCacheUse::Off});
      },
      /*resumable=*/true,
      // The saved partial keys and columns depend on these, and a capped pool's state on the
      // last two (saved whole at every turn's end: InfinigenKv::saves_state_each_turn).
      {"partial_ratio", "partial_key_dtype", "dense_layers", "kv_pool_limit", "eviction"},
      // Its pool is pinned host memory; on CUDA its partial keys are copied from the device
      // before a save reads them (finish_stores).
      /*host_token_rows=*/true,
      /*shifts_positions=*/true};
  return policy;
}

InfinigenKv::InfinigenKv(const ModelConfig& config, int64_t batch, int64_t capacity, DType kv_dtype,
                         Device device, int64_t block_tokens, TransferEngine& engine,
                         OffloadStats& stats, const SpeculationOptions& options, bool check_recall,
                         const KvPoolLimit& limit, const FetchReplay* replay,
                         const InfinigenPlacement& placement)
    : KvStore(batch, capacity),
      options_(options),
      placement_(placement),
      stats_(stats),
      check_recall_(check_recall),
      replay_(replay),
      num_layers_(config.num_layers),
      head_dim_(config.head_dim()),
      heads_(config.num_heads),
      kv_heads_(config.kv_heads()),
      slots_(limit.positions > 0 ? std::min(limit.positions, capacity) : capacity),
      hidden_(config.hidden_size),
      weight_dtype_(config.dtype),
      rotary_(config.rope.enabled()),
      partial_(static_cast<size_t>(config.num_layers)),
      selection_(static_cast<size_t>(config.num_layers)),
      paged_(*this, config, kv_dtype, device, block_tokens, engine, stats,
             slots_ < capacity ? slots_ : 0, slots_ < capacity ? 0 : placement.resident_layers) {
  options_.validate();
  INFINIGEN_CHECK(slots_ >= 2, option("kv_pool_limit"), " leaves ", slots_,
                  " position per sequence and head; at least 2 are needed");
  INFINIGEN_CHECK(device == Device::Cpu || !check_recall, option("check_recall"),
                  " measures on the host: use it with ", option("device"), " cpu");
  options_.max_num_kv = options_.fetch_cap(capacity);
  if (dry_run()) {
    INFINIGEN_CHECK(replay_ != nullptr, "a dry run of infinigen has no fetched share to replay");
    replay_->validate(config.num_layers);
  }
  if (slots_ < capacity) {
    capped_.emplace(num_layers_, batch, kv_heads_, slots_, limit.eviction, &stats,
                    KvPool::capacity_bytes(paged_.pool().shape()));
  }
  use_row_cache_ = placement.row_cache && !capped_;
  if (device == Device::Cuda && !dry_run()) {
    device_.emplace(num_layers_, batch, kv_heads_, slots_, std::min(options_.max_num_kv, slots_),
                    paged_.pool().shape(), capped_.has_value(), paged_.pipeline().keys(0).shape(),
                    kv_dtype, heads_ * head_dim_, use_row_cache_);
  }
}

int32_t InfinigenKv::token_at(int64_t layer, int64_t b, int64_t h, int64_t position) const {
  return capped_ ? capped_->token_at(layer, b, h, position) : static_cast<int32_t>(position);
}

void InfinigenKv::start_pass(int64_t n_new) {
  KvStore::start_pass(n_new);
  // A prompt's pass or an extension loads every layer whole: the next speculated step starts
  // from an empty cache.
  if (prompt_pass() || extending()) row_cache_.clear();
  paged_.start_pass();
  // Decode: layer 0 (dense) starts moving before the embedding.
  if (length() > 0 && !capped_extension()) load_whole(0);
}

void InfinigenKv::start_layer(int64_t layer) {
  // While this layer computes, the next one's KV moves into the other staging buffer: the whole
  // layer here; a speculated layer's selection is known only from this layer's attention input.
  const int64_t next = layer + 1;
  if (length() > 0 && next < num_layers_ && !speculated(next) && !capped_extension()) {
    load_whole(next);
  }
}

void InfinigenKv::keep_sequences(const std::vector<int64_t>& keep,
                                 const std::vector<LeaderMove>& moves) {
  paged_.keep_sequences(keep, moves);
  const SharedPrefixes kept = shared().kept(keep);
  for (PartialLayer& partial : partial_) partial.keep_sequences(keep, moves, kept);
  if (capped_) capped_->keep_sequences(keep);
  row_cache_.keep_sequences(keep);
  if (device_) {
    // The last step's kernels write the partial keys (on the device, or mapped in host memory).
    paged_.pipeline().engine().compute_stream().synchronize();
    device_->keep_sequences(keep, moves, kept);
  }
}

void InfinigenKv::observe(int64_t, const AttentionInput& input) {
  input_.reset();  // references: rebuilt, not assigned
  input_.emplace(input);
}

void InfinigenKv::append(int64_t layer, const Tensor& keys, const Tensor& values) {
  // A resumed conversation's turn keeps the speculation state it restored: its prompt extends it
  // as decode steps do.
  if (prompt_pass() && !resumed()) {
    prompt_layer(layer, keys, values);
  } else {
    decode_layer(layer, keys, values);
  }
}

void InfinigenKv::prompt_layer(int64_t layer, const Tensor& keys, const Tensor& values) {
  prompt_tokens_ = length() + pass_tokens();
  const AttentionInput& in = *input_;
  PartialLayer& partial = partial_[static_cast<size_t>(layer)];
  const PartialSource source{in.queries, keys, in.q_weight, in.q_bias, in.rope_inv_freq, in.skew};
  if (capped_) {
    // One pass (OffloadOptions::validate refuses chunks with a pool limit): the pool keeps the
    // prompt tokens it chooses, and the partial key cache their positions.
    store_prompt_in_capped_pool(layer, keys, values);
    if (dense(layer)) return;
    partial.build(source, pass_first_valid(), heads_, kv_heads_, slots_,
                  partial_columns(options_.partial_ratio, head_dim_), options_.index_rule,
                  &capped_->position_tokens(layer), options_.partial_key_dtype);
    return;
  }
  // The pool's rows of the layer's earlier passes land with its latest store so far.
  const EventPtr earlier_rows = paged_.pipeline().stored(layer);
  paged_.append(layer, keys, values);
  if (dense(layer)) return;
  // A speculated layer's column rule adds up over the prompt's passes (a shared prefix's pass of
  // the groups' leaders, then the chunks of the sequences' own tokens); after the last, its
  // columns, partial query weights and partial keys.
  if (length() == 0) {
    partial.begin_prompt(source, batch(), heads_, kv_heads_,
                         partial_columns(options_.partial_ratio, head_dim_), options_.index_rule,
                         options_.partial_key_dtype);
  }
  pass_sequences_.resize(static_cast<size_t>(pass_batch()));
  for (int64_t i = 0; i < pass_batch(); ++i) {
    pass_sequences_[static_cast<size_t>(i)] = pass_sequence(i);
  }
  partial.accumulate(in.queries, keys, pass_sequences_, pass_first_valid(), length());
  if (sharing_pass()) partial.continue_from_prefixes(shared());
  if (!last_prompt_pass()) return;
  // On CUDA the device keeps the partial key cache (write_prompt_partial_keys).
  partial.choose_columns(in.q_weight, in.q_bias, slots_, /*device_keys=*/device_.has_value());
  if (!shared().empty()) partial.share_prefixes(shared(), /*from_leaders=*/false);
  if (dry_run()) return;
  earlier_rows->wait();
  write_prompt_partial_keys(layer, keys);
}

void InfinigenKv::write_prompt_partial_keys(int64_t layer, const Tensor& keys) {
  PartialLayer& partial = partial_[static_cast<size_t>(layer)];
  if (device_) {
    // On the device, straight into its partial key cache: the earlier passes' keys read from the
    // pool where they landed, the pass's from its keys; nothing crosses back to the host.
    device_->build_from_prompt(layer, partial, keys, length(), paged_.pool(), first_valid(),
                               partial_keys_on_host(layer));
    return;
  }
  // The tokens of the prompt's earlier passes are read back from the pool, where they have
  // landed; the pass's own from its fresh keys.
  const Tensor host = keys.device() == Device::Cpu ? keys : keys.to(Device::Cpu);
  const float* fresh = host.data<float>();
  const int64_t n = pass_tokens(), past = length(), d = head_dim_, KV = kv_heads_ * d;
  const DType kv_dtype = paged_.pool().shape().dtype;
  const SharedPrefixes& prefixes = shared();
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < batch(); ++b) {
    for (int64_t g = 0; g < kv_heads_; ++g) {
      std::vector<float> row(static_cast<size_t>(d));
      for (int64_t t = 0; t < past; ++t) {
        // A prefix's rows once, through its group's leader.
        if (!holds_token(b, t) || (prefixes.in_prefix(b, t) && prefixes.source(b) != b)) continue;
        convert_to_f32(paged_.token_row(layer, 0, b, g, t), kv_dtype, row.data(), row.size());
        partial.write_partial_key(b, g, t, row.data());
      }
      for (int64_t j = 0; j < n; ++j) {
        if (!holds_token(b, past + j)) continue;
        partial.write_partial_key(b, g, past + j, fresh + (b * n + j) * KV + g * d);
      }
    }
  }
}

void InfinigenKv::decode_layer(int64_t layer, const Tensor& keys, const Tensor& values) {
  if (capped_extension()) {
    extend_capped_pool(layer, keys, values);
    return;
  }
  const size_t l = static_cast<size_t>(layer);
  LayerPipeline& pipeline = paged_.pipeline();
  // 1. The next layer's selection, speculated from this layer's attention input; its rows move
  //    while this layer's attention runs.
  if (layer + 1 < num_layers_ && speculated(layer + 1)) {
    select_and_load(layer + 1, input_->x, input_->positions);
  }
  if (!compact(layer)) {
    // Loaded whole (a dense layer, or every layer of an extension): stored as `full` stores, and
    // in a speculated layer's partial key cache; view() is the paged pool's.
    paged_.append(layer, keys, values);
    if (!dense(layer)) partial_[l].append(keys, length());
    if (extending()) prompt_tokens_ = length() + pass_tokens();
    return;
  }
  // 2. The new token: after this layer's staged rows (row n'), into the pool and into the
  //    partial key cache.
  const PartialLayer::Selection& sel = selection_[l];
  Tensor& staged_keys = pipeline.keys(layer);
  Tensor& staged_values = pipeline.values(layer);
  ops::cache_store(keys, staged_keys, sel.fetch);
  ops::cache_store(values, staged_values, sel.fetch);
  if (capped_) {
    const std::vector<int32_t> at = capped_->place_token(layer, length());
    // A victim's old row may be among this step's loads of the layer: overwrite it after them.
    paged_.store_token_at(layer, keys, values, at, pipeline.loaded(layer));
    if (device_ && !dense(layer)) {
      device_->place(layer, keys, at, static_cast<int32_t>(length()),
                     pipeline.engine().compute_stream());
    } else if (!dense(layer)) {
      partial_[l].append(keys, 0, &at);
    }
  } else {
    paged_.store_token(layer, keys, values);
    if (device_) {
      device_->append(layer, keys, length());
    } else {
      partial_[l].append(keys, length());
    }
  }
  // 3. Attention follows this layer's load; the rows the row cache held are copied from it, and
  //    rows of a shared prefix that several sequences selected came once and are copied to the
  //    others; then the selected rows are the cache's.
  pipeline.wait_for_load(layer);
  const bool cached = use_row_cache_ && row_cache_.allocated() && !dense(layer);
  if (cached) {
    // On the device: the held rows into the staging, then the whole selection into the cache
    // (K and V rows of d), which the cost model prices as the runtime records it.
    const LayerTraffic& traffic = pipeline.traffic(layer);
    traced("row_cache_copy",
           {static_cast<int64_t>(traffic.tokens_from_row_cache + traffic.tokens_fetched), 2,
            head_dim_},
           staged_keys.dtype());
  }
  for (const CopyChunk& copy : row_cache_copies_[l % 2]) {
    device_copy(copy.dst, staged_keys.device(), copy.src, row_cache_.device(), copy.bytes);
  }
  for (const CopyChunk& copy : shared_row_copies_[l % 2]) {
    device_copy(copy.dst, staged_keys.device(), copy.src, staged_keys.device(), copy.bytes);
  }
  if (cached && !device_) {  // on CUDA, the gather's kernels stored it
    row_cache_.store(layer, staged_keys, staged_values, sel.fetch, sel.take, sel.tokens);
  }
  // 4. Diagnostics and the eviction policy's view of what attention used.
  if (check_recall_ && !dense(layer)) pipeline.traffic(layer).recall = measure_recall(layer);
  if (capped_ && dense(layer) && !dry_run()) {  // (a dry run has no attention to count)
    if (device_) {
      const DeviceSpeculation::HostCopies host = device_->to_host(
          staged_keys, input_->queries, pipeline.engine().compute_stream());
      capped_->count_dense_fetches(layer, sel, host.staged_keys, host.queries, options_.alpha,
                                   length());
    } else {
      capped_->count_dense_fetches(layer, sel, staged_keys, input_->queries, options_.alpha,
                                   length());
    }
  }
  compact_first_valid_.resize(static_cast<size_t>(batch()));
  for (int64_t b = 0; b < batch(); ++b) {
    compact_first_valid_[static_cast<size_t>(b)] =
        static_cast<int32_t>(sel.fetch - sel.take[static_cast<size_t>(b)]);
  }
  view_ = {&staged_keys, &staged_values, sel.fetch + 1, &compact_first_valid_};
}

KvStore::View InfinigenKv::view(int64_t layer) {
  return compact(layer) ? view_ : paged_.view(layer);
}

void InfinigenKv::end_pass(int64_t n_new) {
  const bool prompt_done = last_prompt_pass();
  if (device_ && prompt_done) {
    // The prompt's passes are done (the columns were chosen from all of it): each speculated
    // layer's partial state moves to the device for good, before the first decode step.
    for (int64_t layer = options_.dense_layers; layer < num_layers_; ++layer) {
      if (device_->holds(layer)) continue;  // built from the prompt on the device
      device_->upload(layer, partial_[static_cast<size_t>(layer)],
                      capped_ ? &capped_->position_tokens(layer) : nullptr,
                      partial_keys_on_host(layer));
    }
    uploaded_ = true;
  }
  paged_.end_pass();
  if (prompt_done) {
    paged_.pipeline().resize_staging(
        decode_staging_rows(capacity(), options_.max_num_kv, options_.dense_layers,
                            paged_.resident_layers(), capped_.has_value()));
    if (use_row_cache_ && !row_cache_.allocated()) {
      // After the staging shrank, as the memory plan counts it (the decode steps' device part).
      const Tensor& staging = paged_.pipeline().keys(0);
      row_cache_.allocate(num_layers_, options_.dense_layers, batch(), kv_heads_,
                          std::min(options_.max_num_kv, slots_), head_dim_, staging.dtype(),
                          staging.device());
    }
  }
  KvStore::end_pass(n_new);
}

void InfinigenKv::load_whole(int64_t layer) {
  if (!capped_) {
    paged_.load_layer(layer);
    return;
  }
  selection_[static_cast<size_t>(layer)] = capped_->select_all(layer, first_valid(), length());
  load_selection(layer);
}

void InfinigenKv::store_prompt_in_capped_pool(int64_t layer, const Tensor& keys,
                                              const Tensor& values) {
  LayerPipeline& pipeline = paged_.pipeline();
  // The prompt's rows go through the layer's staging, once the store that last read it is done.
  pipeline.await_store_reads(layer);
  ops::cache_store(keys, pipeline.keys(layer), 0);
  ops::cache_store(values, pipeline.values(layer), 0);
  // Every position of the capped pool, now: decode steps write new tokens into free positions,
  // then into victims', and allocate nothing.
  paged_.pool().reserve(slots_);
  const std::vector<std::vector<int32_t>> kept =
      dry_run() ? capped_->keep_prompt_newest(layer, first_valid(), keys.dim(0) / batch())
                : capped_->keep_prompt(layer, input_->queries, keys, first_valid(), head_dim_,
                                       options_.alpha);
  std::vector<PoolRowMove> moves;
  for (int64_t row = 0; row < batch() * kv_heads_; ++row) {
    const std::vector<int32_t>& tokens = kept[static_cast<size_t>(row)];
    for (size_t j = 0; j < tokens.size(); ++j) {
      moves.push_back({row / kv_heads_, row % kv_heads_, tokens[j], static_cast<int64_t>(j)});
    }
  }
  paged_.store_staged_rows(layer, moves);
}

std::vector<int32_t> InfinigenKv::replayed_take(int64_t layer) const {
  std::vector<int64_t> valid(static_cast<size_t>(batch()));
  for (int64_t b = 0; b < batch(); ++b) {
    valid[static_cast<size_t>(b)] =
        used_positions() - first_valid()[static_cast<size_t>(b)] + shared().prefix_length(b);
  }
  return replay_->take(length() - prompt_tokens_ + 1, layer, num_layers_, options_.dense_layers,
                       kv_heads_, length(), valid, options_.max_num_kv);
}

void InfinigenKv::select_and_load(int64_t layer, const Tensor& x,
                                  const std::vector<int32_t>& positions) {
  const size_t l = static_cast<size_t>(layer);
  if (partial_keys_on_host(layer)) read_host_partial_keys(layer, used_positions());
  const PartialLayer::Selection previous = std::move(selection_[l]);
  if (device_) {
    RowCache* cache = use_row_cache_ && row_cache_.allocated() ? &row_cache_ : nullptr;
    selection_[l] = device_->select(layer, x, positions, used_positions(), first_valid(), options_,
                                    paged_.pipeline().engine().compute_stream(), cache);
    if (capped_) capped_->count_fetches(layer, selection_[l], length());
    count_traffic(layer);
    count_fetched_again(layer, previous);
    if (cache) {
      // The positions stay on the device, where the cache holds the last step's selection: the
      // rows it holds are the rows fetched again.
      LayerTraffic& traffic = paged_.pipeline().traffic(layer);
      traffic.tokens_from_row_cache = static_cast<uint64_t>(device_->cached_rows());
      if (row_cache_.filled(layer)) traffic.tokens_fetched_again = device_->cached_rows();
    }
    device_->gather(layer, selection_[l], paged_.pool(), paged_.pipeline(), cache);
    return;
  }
  const std::vector<int32_t> take = dry_run() ? replayed_take(layer) : std::vector<int32_t>{};
  selection_[l] =
      partial_[l].speculate(x, positions, used_positions(), first_valid(), options_,
                            capped_ ? &capped_->position_tokens(layer) : nullptr, &take);
  if (capped_) capped_->count_fetches(layer, selection_[l], length());
  // The first decode step's selection, for diagnostics (the runs that check recall).
  if (check_recall_ && length() == prompt_tokens_) record_first_selection(layer);
  count_fetched_again(layer, previous);
  load_selection(layer);
}

void InfinigenKv::count_fetched_again(int64_t layer, const PartialLayer::Selection& previous) {
  const PartialLayer::Selection& sel = selection_[static_cast<size_t>(layer)];
  // Known when both steps' positions are on the host for the same batch (not after sequences
  // left it, not where the selection stays on the device), and each position holds one token
  // across the steps (a capped pool puts new tokens in evicted ones' positions).
  if (capped_ || sel.tokens.empty() || previous.tokens.empty() ||
      std::ssize(previous.take) != batch()) {
    return;
  }
  int64_t again = 0;
  for (int64_t b = 0; b < batch(); ++b) {
    for (int64_t h = 0; h < kv_heads_; ++h) {
      // Both ascending positions, which are tokens here.
      const int32_t* now = sel.tokens.data() + (b * kv_heads_ + h) * sel.fetch;
      const int32_t* before = previous.tokens.data() + (b * kv_heads_ + h) * previous.fetch;
      const int32_t* now_end = now + sel.take[static_cast<size_t>(b)];
      const int32_t* before_end = before + previous.take[static_cast<size_t>(b)];
      while (now != now_end && before != before_end) {
        if (*now < *before) {
          ++now;
        } else if (*before < *now) {
          ++before;
        } else {
          ++again, ++now, ++before;
        }
      }
    }
  }
  paged_.pipeline().traffic(layer).tokens_fetched_again = again;
}

void InfinigenKv::record_first_selection(int64_t layer) {
  const PartialLayer::Selection& sel = selection_[static_cast<size_t>(layer)];
  std::vector<FirstSelection>& record = stats_.first_selection();
  record.resize(static_cast<size_t>(num_layers_));
  FirstSelection& first = record[static_cast<size_t>(layer)];
  first.kv_heads = kv_heads_;
  first.tokens.assign(static_cast<size_t>(batch() * kv_heads_), {});
  const SharedPrefixes& prefixes = shared();
  for (int64_t b = 0; b < batch(); ++b) {
    const int64_t own_from = first_valid()[static_cast<size_t>(b)];
    for (int64_t h = 0; h < kv_heads_; ++h) {
      std::vector<int32_t>& tokens = first.tokens[static_cast<size_t>(b * kv_heads_ + h)];
      const int32_t* positions = sel.tokens.data() + (b * kv_heads_ + h) * sel.fetch;
      for (int32_t j = 0; j < sel.take[static_cast<size_t>(b)]; ++j) {
        // A row of the pool holds a token of the prefix (in its leader's rows) or its own.
        const int64_t row = token_at(layer, b, h, positions[j]);
        tokens.push_back(static_cast<int32_t>(prefixes.in_prefix(b, row)
                                                  ? row - prefixes.begin(b)
                                                  : prefixes.prefix_length(b) + row - own_from));
      }
      std::sort(tokens.begin(), tokens.end());
    }
  }
}

void InfinigenKv::read_host_partial_keys(int64_t layer, int64_t used) {
  LayerPipeline& pipeline = paged_.pipeline();
  const uint64_t bytes = static_cast<uint64_t>(batch() * kv_heads_ * used *
                                               partial_columns(options_.partial_ratio, head_dim_)) *
                         dtype_size(options_.partial_key_dtype);
  pipeline.traffic(layer).kv_h2d_bytes += bytes;
  pipeline.step().h2d_bytes += bytes;
  if (!dry_run()) return;  // the speculation kernels read them in place
  // A kernel's read, one contiguous run per (sequence, KV head), that speculation waits for.
  TransferEngine& engine = pipeline.engine();
  const EventPtr read =
      engine.load_by_kernel([](void*) { return 0; }, bytes, batch() * kv_heads_, nullptr,
                            {"partial_key_read", layer, TransferContent::KvRange});
  StepStats& step = pipeline.step();
  engine.compute_waits(read, {&step.layers[static_cast<size_t>(layer)].load_wait_seconds,
                              &step.load_wait_seconds});
}

void InfinigenKv::load_selection(int64_t layer) {
  const size_t l = static_cast<size_t>(layer), p = l % 2;
  LayerPipeline& pipeline = paged_.pipeline();
  const PartialLayer::Selection& sel = selection_[l];
  Tensor& keys = pipeline.keys(layer);
  Tensor& values = pipeline.values(layer);
  pipeline.poison(layer);
  const KvPool& pool = paged_.pool();
  const int64_t B = batch(), H = kv_heads_, cap = keys.dim(2);
  const size_t row_bytes = static_cast<size_t>(head_dim_) * dtype_size(keys.dtype());
  std::vector<CopyChunk> chunks;
  chunks.reserve(static_cast<size_t>(2 * B * H * sel.fetch));
  // A shared prefix's row crosses the link once, for the first member of its group that selected
  // it: (group, head, position) -> that sequence's staging row. A dry run cannot know which
  // selections coincide (they are replayed, not speculated) and prices every sequence's fetch.
  std::vector<CopyChunk>& copies = shared_row_copies_[p];
  copies.clear();
  const SharedPrefixes& shared = this->shared();
  std::vector<int64_t> first_staged(static_cast<size_t>(shared.num_groups() * H * shared.rows()),
                                    -1);
  // The rows the layer's row cache holds are copied from it, not loaded (a dry run replays how
  // many: the first ones of each (sequence, head)). A shared prefix's row that another sequence
  // of the group staged first is copied from there as before, and counts as no hit.
  const bool cached = use_row_cache_ && row_cache_.allocated() && speculated(layer);
  std::vector<CopyChunk>& from_cache = row_cache_copies_[p];
  from_cache.clear();
  uint64_t hits = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t take = sel.take[static_cast<size_t>(b)];
    const int64_t held = cached ? row_cache_.count(layer, b) : 0;
    for (int64_t h = 0; h < H; ++h) {
      const int64_t replayed = dry_run() && cached ? replayed_hits(layer, b, h, take, held) : 0;
      const int32_t* positions = sel.tokens.data() + (b * H + h) * sel.fetch;
      const int32_t* held_positions =
          held > 0 && !dry_run() ? row_cache_.positions(layer, b, h) : nullptr;
      int64_t c = 0;  // cursor in the ascending cached positions
      for (int64_t j = 0; j < take; ++j) {
        const int64_t dst_row = (b * H + h) * cap + sel.fetch - take + j;
        char* key_dst = static_cast<char*>(keys.raw()) + static_cast<size_t>(dst_row) * row_bytes;
        char* value_dst =
            static_cast<char*>(values.raw()) + static_cast<size_t>(dst_row) * row_bytes;
        if (shared.in_prefix(b, positions[j]) && !dry_run()) {
          int64_t* first = &first_staged[static_cast<size_t>(
              (shared.group(b) * H + h) * shared.rows() + positions[j])];
          if (*first >= 0) {
            const size_t at = static_cast<size_t>(*first) * row_bytes;
            copies.push_back({key_dst, static_cast<const char*>(keys.raw()) + at, row_bytes});
            copies.push_back({value_dst, static_cast<const char*>(values.raw()) + at, row_bytes});
            continue;
          }
          *first = dst_row;
        }
        if (dry_run()) {
          if (j < replayed) {
            ++hits;
            continue;
          }
        } else if (held > 0) {
          while (c < held && held_positions[c] < positions[j]) ++c;
          if (c < held && held_positions[c] == positions[j]) {
            from_cache.push_back({key_dst, row_cache_.key_row(layer, b, h, c), row_bytes});
            from_cache.push_back({value_dst, row_cache_.value_row(layer, b, h, c), row_bytes});
            ++hits;
            continue;
          }
        }
        chunks.push_back({key_dst, pool.row(layer, KvKind::Key, b, h, positions[j]), row_bytes});
        chunks.push_back(
            {value_dst, pool.row(layer, KvKind::Value, b, h, positions[j]), row_bytes});
      }
    }
  }
  count_traffic(layer);
  if (cached) pipeline.traffic(layer).tokens_from_row_cache = hits;
  pipeline.load(layer, std::move(chunks), TransferContent::KvRows);
}

int64_t InfinigenKv::replayed_hits(int64_t layer, int64_t b, int64_t h, int64_t take,
                                   int64_t cached) const {
  return std::min(cached, replay_->cached(length() - prompt_tokens_ + 1, layer, num_layers_,
                                          options_.dense_layers, b, h, batch(), kv_heads_, take));
}

void InfinigenKv::count_traffic(int64_t layer) {
  LayerTraffic& traffic = paged_.pipeline().traffic(layer);
  const PartialLayer::Selection& sel = selection_[static_cast<size_t>(layer)];
  for (int64_t b = 0; b < batch(); ++b) {
    traffic.tokens_fetched += static_cast<uint64_t>(sel.take[static_cast<size_t>(b)] * kv_heads_);
    // The pool's valid entries of this sequence: its tokens (a shared prefix's included), or its
    // valid positions when capped.
    const int32_t start = first_valid()[static_cast<size_t>(b)];
    const int64_t valid = capped_ ? capped_->valid_entries(layer, b, start, length())
                                  : length() - start + shared().prefix_length(b);
    traffic.tokens_stored += static_cast<uint64_t>(valid * kv_heads_);
  }
}

double InfinigenKv::measure_recall(int64_t layer) {
  paged_.pipeline().stored(layer)->wait();  // the pool holds every earlier entry of this layer
  const KvPool& pool = paged_.pool();
  return staged_recall(
      {input_->queries, paged_.pipeline().keys(layer), selection_[static_cast<size_t>(layer)],
       used_positions(), [&](int64_t b, int64_t g, int64_t position) -> const void* {
         // The current token, already placed in a capped pool, is the staging's row n'.
         const int32_t token = token_at(layer, b, g, position);
         return holds_token(b, token) && token < length()
                    ? pool.row(layer, KvKind::Key, b, g, position)
                    : nullptr;
       }});
}

void InfinigenKv::resume(int64_t length, std::vector<int32_t> first_valid, int64_t num_layers,
                         LayerRestorer restore) {
  INFINIGEN_CHECK(!capped_ || !dry_run(), "a dry run cannot price a resumed turn under ",
                  option("kv_pool_limit"), " yet");
  KvStore::resume(length, std::move(first_valid), num_layers, std::move(restore));
  if (capped_) {
    paged_.pool().reserve(slots_);  // held positions are restored anywhere in it
    history_end_.assign(static_cast<size_t>(batch()), 0);
  } else {
    paged_.resume(length);
  }
}

std::vector<KvStore::TokenStream> InfinigenKv::token_streams(int64_t layer) const {
  if (capped_) return {};  // positions, not tokens: saved as its state (capped_layer_state)
  std::vector<TokenStream> streams = paged_.token_streams();
  if (!dense(layer)) {
    streams.push_back({"partial_keys", options_.partial_key_dtype,
                       partial_columns(options_.partial_ratio, head_dim_)});
  }
  return streams;
}

const void* InfinigenKv::token_row(int64_t layer, size_t stream, int64_t b, int64_t h,
                                   int64_t t) const {
  if (stream < 2) return paged_.token_row(layer, stream, b, h, t);
  if (!uploaded_) return partial_[static_cast<size_t>(layer)].key_row(b, h, t);
  const size_t row = static_cast<size_t>(partial_columns(options_.partial_ratio, head_dim_)) *
                     dtype_size(options_.partial_key_dtype);
  const std::vector<char>& keys = host_partial_keys_[static_cast<size_t>(layer)];
  INFINIGEN_CHECK(!keys.empty(), "layer ", layer, ": partial keys not copied from the device");
  return keys.data() + static_cast<size_t>((b * kv_heads_ + h) * slots_ + t) * row;
}

void InfinigenKv::finish_stores() {
  paged_.pipeline().drain_stores();
  if (!uploaded_) return;
  paged_.pipeline().engine().compute_stream().synchronize();  // the appends of the steps so far
  host_partial_keys_.resize(static_cast<size_t>(num_layers_));
  for (int64_t layer = options_.dense_layers; layer < num_layers_; ++layer) {
    device_->copy_keys_to_host(layer, host_partial_keys_[static_cast<size_t>(layer)],
                               host_partial_keys_from_);
  }
  host_partial_keys_from_ = used_positions();
}

KvStore::LayerState InfinigenKv::layer_state(int64_t layer) const {
  if (capped_) return capped_layer_state(layer);
  return dense(layer) ? LayerState{} : partial_[static_cast<size_t>(layer)].state();
}

void InfinigenKv::restore_layer_state(int64_t layer, const LayerState& state) {
  if (capped_) {
    restore_capped_layer(layer, state);
    return;
  }
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

void InfinigenKv::rederive_rows(int64_t layer, int64_t b, int64_t from, int64_t count) {
  if (dense(layer) || dry_run()) return;
  PartialLayer& partial = partial_[static_cast<size_t>(layer)];
  const DType kv_dtype = paged_.pool().shape().dtype;
  std::vector<float> row(static_cast<size_t>(head_dim_));
  for (int64_t g = 0; g < kv_heads_; ++g) {
    for (int64_t t = from; t < from + count; ++t) {
      convert_to_f32(paged_.token_row(layer, 0, b, g, t), kv_dtype, row.data(), row.size());
      partial.write_partial_key(b, g, t, row.data());
    }
  }
}

}  // namespace infinigen
