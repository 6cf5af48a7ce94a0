// offload: a capped InfiniGen pool across a conversation's turns: the extension of a resumed
// turn's first pass, and the pool's state as a session saves and restores it.
#include <algorithm>
#include <cstring>
#include <numeric>

#include "core/cuda_stream.h"
#include "core/device.h"
#include "core/error.h"
#include "core/trace.h"
#include "offload/infinigen_kv.h"
#include "speculate/prompt_keep.h"

namespace infinigen {

namespace {

const Tensor& host_copy(const Tensor& t, Tensor& holder) {
  if (t.device() == Device::Cpu) return t;
  holder = t.to(Device::Cpu);
  return holder;
}

}  // namespace

void InfinigenKv::extend_capped_pool(int64_t layer, const Tensor& keys, const Tensor& values) {
  const size_t l = static_cast<size_t>(layer);
  const int64_t n = pass_tokens(), B = batch(), H = kv_heads_, d = head_dim_, past = length();
  const int64_t Q = heads_ * d, KV = H * d, group = heads_ / H;
  const DType kv_dtype = paged_.pool().shape().dtype;
  const size_t row_bytes = static_cast<size_t>(d) * dtype_size(kv_dtype);
  prompt_tokens_ = past + n;
  LayerPipeline& pipeline = paged_.pipeline();
  // The pool holds every row earlier passes stored, and on CUDA the device is done with the
  // staging of this layer's parity (the attention of layer - 2).
  pipeline.drain_stores();
  if (device_) pipeline.engine().compute_stream().synchronize();

  // Per sequence: the pass's rows before its new tokens (padding, or history the pool holds),
  // and per row what the pool holds (every head of a sequence holds as many).
  std::vector<int64_t> skip(static_cast<size_t>(B));
  std::vector<CappedPool::Held> held(static_cast<size_t>(B * H));
  int64_t fetch = 0;
  for (int64_t b = 0; b < B; ++b) {
    const auto i = static_cast<size_t>(b);
    const int64_t history_end = std::max<int64_t>(history_end_[i], first_valid()[i]);
    skip[i] = std::clamp<int64_t>(history_end - past, 0, n);
    for (int64_t g = 0; g < H; ++g)
      held[static_cast<size_t>(b * H + g)] = capped_->held(layer, b * H + g);
    const int64_t count = std::ssize(held[static_cast<size_t>(b * H)].positions);
    for (int64_t g = 1; g < H; ++g) {
      INFINIGEN_CHECK(std::ssize(held[static_cast<size_t>(b * H + g)].positions) == count, "layer ",
                      layer, ": the capped pool holds ",
                      held[static_cast<size_t>(b * H + g)].positions.size(), " tokens of sequence ",
                      b, ", head ", g, " and ", count, " of head 0");
    }
    fetch = std::max(fetch, count - skip[i]);
  }
  Tensor& staged_keys = pipeline.keys(layer);
  Tensor& staged_values = pipeline.values(layer);
  const int64_t rows = staged_keys.dim(2);
  INFINIGEN_CHECK(fetch + n <= rows, "layer ", layer, ": ", fetch, " held positions and ", n,
                  " new tokens do not fit the staging's ", rows, " rows");

  // The keep's scoring, for a trace: each new query of a group's heads over the held entries and
  // the new tokens up to its own (the cost model does not model a capped pool: no dry run).
  traced_lazily("extension_scores", [&] {
    int64_t scored = 0;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t m = n - skip[static_cast<size_t>(b)];
      scored += std::ssize(held[static_cast<size_t>(b * H)].positions) * m + m * (m + 1) / 2;
    }
    return std::array<int64_t, 5>{heads_, scored, d};
  });
  Tensor q_holder, k_holder, v_holder;
  const Tensor& q = host_copy(input_->queries, q_holder);  // (B * n, H * d), scaled
  const Tensor& k = host_copy(keys, k_holder);             // (B * n, H_kv * d)
  const Tensor k_stored = k.to_dtype(kv_dtype),
               v_stored = host_copy(values, v_holder).to_dtype(kv_dtype);
  // The staging, assembled on the host (in place on the CPU backend): (B, H_kv, rows, d), each
  // (b, h)'s held rows just before its new tokens' rows, then those.
  Tensor host_keys, host_values;
  if (device_) {
    host_keys = Tensor::zeros(staged_keys.shape(), kv_dtype);
    host_values = Tensor::zeros(staged_values.shape(), kv_dtype);
  }
  char* sk = static_cast<char*>(device_ ? host_keys.raw() : staged_keys.raw());
  char* sv = static_cast<char*>(device_ ? host_values.raw() : staged_values.raw());
  const float* qd = q.data<float>();
  const float* kd = k.data<float>();
  const char* new_keys = static_cast<const char*>(k_stored.raw());
  const char* new_values = static_cast<const char*>(v_stored.raw());
  KvPool& pool = paged_.pool();
  int64_t fetched = 0, stored = 0, evicted = 0, not_kept = 0;
#pragma omp parallel for collapse(2) schedule(dynamic, 1) reduction(+ : fetched, stored, evicted, not_kept)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t g = 0; g < H; ++g) {
      const int64_t row = b * H + g, s = skip[static_cast<size_t>(b)];
      CappedPool::Held& mine = held[static_cast<size_t>(row)];
      const int64_t count = std::ssize(mine.positions), base = fetch + s - count;
      char* row_k = sk + static_cast<size_t>(row * rows) * row_bytes;
      char* row_v = sv + static_cast<size_t>(row * rows) * row_bytes;
      mine.entries.keys.resize(static_cast<size_t>(count * d));
      for (int64_t c = 0; c < count; ++c) {
        const int64_t position = mine.positions[static_cast<size_t>(c)];
        const void* key = pool.row(layer, KvKind::Key, b, g, position);
        std::memcpy(row_k + static_cast<size_t>(base + c) * row_bytes, key, row_bytes);
        std::memcpy(row_v + static_cast<size_t>(base + c) * row_bytes,
                    pool.row(layer, KvKind::Value, b, g, position), row_bytes);
        convert_to_f32(key, kv_dtype, mine.entries.keys.data() + c * d, static_cast<size_t>(d));
      }
      const auto pass_row = [&](int64_t j) {
        return static_cast<size_t>((b * n + j) * KV + g * d);
      };
      for (int64_t j = s; j < n; ++j) {
        std::memcpy(row_k + static_cast<size_t>(fetch + j) * row_bytes,
                    new_keys + pass_row(j) * dtype_size(kv_dtype), row_bytes);
        std::memcpy(row_v + static_cast<size_t>(fetch + j) * row_bytes,
                    new_values + pass_row(j) * dtype_size(kv_dtype), row_bytes);
      }
      // What the pool keeps: the pass's attention counts as fetches, as a prompt's does.
      const PromptKeep keep = keep_extension_tokens(
          mine.entries, qd + b * n * Q + g * group * d, Q, group, kd + b * n * KV + g * d, KV, s, n,
          d, past, slots_, options_.alpha, capped_->eviction_policy());
      const std::vector<std::pair<int32_t, int32_t>> placed =
          capped_->refill_row(layer, row, mine, keep, past + s, evicted);
      for (const auto& [token, position] : placed) {
        const int64_t j = token - past;
        std::memcpy(pool.row(layer, KvKind::Key, b, g, position),
                    new_keys + pass_row(j) * dtype_size(kv_dtype), row_bytes);
        std::memcpy(pool.row(layer, KvKind::Value, b, g, position),
                    new_values + pass_row(j) * dtype_size(kv_dtype), row_bytes);
        if (!dense(layer)) partial_[l].write_partial_key(b, g, position, kd + pass_row(j));
      }
      fetched += count;
      stored += std::ssize(placed);
      not_kept += n - s - std::ssize(placed);
    }
  }
  capped_->count_extension_drops(evicted, not_kept);
  if (device_) {
    device_copy(staged_keys.raw(), staged_keys.device(), host_keys.raw(), Device::Cpu,
                host_keys.nbytes());
    device_copy(staged_values.raw(), staged_values.device(), host_values.raw(), Device::Cpu,
                host_values.nbytes());
  }
  LayerTraffic& traffic = pipeline.traffic(layer);
  traffic.tokens_fetched += static_cast<uint64_t>(fetched);
  traffic.tokens_stored += static_cast<uint64_t>(stored);
  compact_first_valid_.resize(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    compact_first_valid_[static_cast<size_t>(b)] =
        static_cast<int32_t>(fetch + skip[static_cast<size_t>(b)] -
                             std::ssize(held[static_cast<size_t>(b * H)].positions));
  }
  view_ = {&staged_keys, &staged_values, fetch + n, &compact_first_valid_};
}

KvStore::LayerState InfinigenKv::capped_layer_state(int64_t layer) const {
  const int64_t B = batch(), H = kv_heads_, S = slots_, d = head_dim_;
  const DType kv_dtype = paged_.pool().shape().dtype;
  const size_t row_bytes = static_cast<size_t>(d) * dtype_size(kv_dtype);
  LayerState state = dense(layer) ? LayerState{} : partial_[static_cast<size_t>(layer)].state();
  Tensor keys = Tensor::zeros({B, H, S, d}, kv_dtype),
         values = Tensor::zeros({B, H, S, d}, kv_dtype);
  Tensor tokens = Tensor::empty({B, H, S}, DType::I32),
         records = Tensor::empty({B, H, S}, DType::I32);
  capped_->save(layer, first_valid(), tokens.data<int32_t>(), records.data<int32_t>());
  const int32_t* saved = tokens.data<int32_t>();
  for (int64_t row = 0; row < B * H; ++row) {
    for (int64_t p = 0; p < S; ++p) {
      const size_t at = static_cast<size_t>(row * S + p);
      if (saved[at] < 0) continue;
      std::memcpy(static_cast<char*>(keys.raw()) + at * row_bytes,
                  paged_.pool().row(layer, KvKind::Key, row / H, row % H, p), row_bytes);
      std::memcpy(static_cast<char*>(values.raw()) + at * row_bytes,
                  paged_.pool().row(layer, KvKind::Value, row / H, row % H, p), row_bytes);
    }
  }
  state.emplace_back("capped_keys", std::move(keys));
  state.emplace_back("capped_values", std::move(values));
  state.emplace_back("capped_tokens", std::move(tokens));
  state.emplace_back("capped_records", std::move(records));
  return state;
}

void InfinigenKv::restore_capped_layer(int64_t layer, const LayerState& state) {
  const size_t l = static_cast<size_t>(layer);
  const int64_t B = batch(), H = kv_heads_, S = slots_, d = head_dim_;
  const DType kv_dtype = paged_.pool().shape().dtype;
  const size_t row_bytes = static_cast<size_t>(d) * dtype_size(kv_dtype);
  const auto find = [&](const std::string& name) -> const Tensor& {
    for (const auto& [key, tensor] : state) {
      if (key == name) return tensor;
    }
    fail("layer ", layer, ": the session keeps no ", name, " (it was not saved under ",
         option("kv_pool_limit"), ", or it is corrupt)");
  };
  const Tensor& saved_tokens = find("capped_tokens");
  const int64_t saved = saved_tokens.rank() == 3 ? saved_tokens.dim(2) : 0;
  const auto check = [&](const Tensor& t, const std::string& name, DType dtype, Shape shape) {
    INFINIGEN_CHECK(t.dtype() == dtype && t.shape() == shape, "layer ", layer, ": the session's ",
                    name, " is ", dtype_name(t.dtype()), " ", shape_string(t.shape()), ", not ",
                    dtype_name(dtype), " ", shape_string(shape), " (the session is corrupt)");
  };
  check(saved_tokens, "capped_tokens", DType::I32, {B, H, saved});
  const Tensor& saved_records = find("capped_records");
  const Tensor& saved_keys = find("capped_keys");
  const Tensor& saved_values = find("capped_values");
  check(saved_records, "capped_records", DType::I32, {B, H, saved});
  check(saved_keys, "capped_keys", kv_dtype, {B, H, saved, d});
  check(saved_values, "capped_values", kv_dtype, {B, H, saved, d});
  PartialLayer& partial = partial_[l];
  if (!dense(layer)) partial.restore(state, B, heads_, H, d, S, options_.partial_key_dtype);
  const bool lru = capped_->eviction_policy() == EvictionPolicy::Lru;
  const int32_t* index = saved_tokens.data<int32_t>();
  const int32_t* record = saved_records.data<int32_t>();
  KvPool& pool = paged_.pool();
  for (int64_t b = 0; b < B; ++b) {
    const int32_t start = first_valid()[static_cast<size_t>(b)];
    int64_t history_end = start, count = -1;
    for (int64_t g = 0; g < H; ++g) {
      const int64_t row = b * H + g;
      // The saved entries in the order of their saved positions, as absolute tokens.
      HeldEntries entries;
      std::vector<int64_t> at;  // saved position of each
      for (int64_t p = 0; p < saved; ++p) {
        const int64_t i = row * saved + p;
        if (index[i] < 0) continue;
        // Tokens within the store's rows, records within what a run can write.
        const int64_t rows = capacity() - start;
        INFINIGEN_CHECK(index[i] < rows && record[i] >= 0 && (!lru || record[i] < rows), "layer ",
                        layer, ": the session's capped pool holds token ", index[i],
                        " with eviction record ", record[i], " in sequence ", b, ", which has ",
                        rows, " rows (the session is corrupt)");
        entries.tokens.push_back(start + index[i]);
        int64_t fetches = 0, last_fetch = -1;
        capped_->record_as_history(record[i] + (lru ? start : 0), fetches, last_fetch);
        entries.fetches.push_back(fetches);
        entries.last_fetch.push_back(last_fetch);
        at.push_back(p);
        history_end = std::max<int64_t>(history_end, start + index[i] + 1);
      }
      std::vector<int32_t> sorted = entries.tokens;
      std::sort(sorted.begin(), sorted.end());
      INFINIGEN_CHECK(std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end(), "layer ",
                      layer, ": the session's capped pool holds a token of sequence ", b, ", head ",
                      g, " twice (the session is corrupt)");
      INFINIGEN_CHECK(count < 0 || std::ssize(at) == count, "layer ", layer,
                      ": the session's capped pool holds ", at.size(), " tokens of sequence ", b,
                      ", head ", g, " and ", count, " of head 0 (the session is corrupt)");
      count = std::ssize(at);
      std::vector<float> keys(static_cast<size_t>(count * d));
      for (int64_t c = 0; c < count; ++c) {
        convert_to_f32(
            static_cast<const char*>(saved_keys.raw()) +
                static_cast<size_t>(row * saved + at[static_cast<size_t>(c)]) * row_bytes,
            kv_dtype, keys.data() + c * d, static_cast<size_t>(d));
      }
      // A pool of fewer positions than were saved keeps what its policy would (the newest half,
      // and the older entries it ranks highest); the saved entries stay in their order.
      std::vector<char> kept(static_cast<size_t>(count), 1);
      if (count > S) {
        HeldEntries by_age = entries;  // keep_extension_tokens takes them oldest first
        std::vector<int64_t> order(static_cast<size_t>(count));
        std::iota(order.begin(), order.end(), 0);
        std::sort(order.begin(), order.end(), [&](int64_t a, int64_t c) {
          return entries.tokens[static_cast<size_t>(a)] < entries.tokens[static_cast<size_t>(c)];
        });
        by_age.keys.resize(keys.size());
        for (size_t r = 0; r < order.size(); ++r) {
          const auto o = static_cast<size_t>(order[r]);
          by_age.tokens[r] = entries.tokens[o];
          by_age.fetches[r] = entries.fetches[o];
          by_age.last_fetch[r] = entries.last_fetch[o];
          std::copy_n(keys.begin() + static_cast<ptrdiff_t>(o) * d, d,
                      by_age.keys.begin() + static_cast<ptrdiff_t>(r) * d);
        }
        const PromptKeep keep =
            keep_extension_tokens(by_age, nullptr, d, 1, nullptr, d, 0, 0, d, 0, S, options_.alpha,
                                  capped_->eviction_policy());
        for (int64_t c = 0; c < count; ++c) {
          kept[static_cast<size_t>(c)] = std::binary_search(keep.tokens.begin(), keep.tokens.end(),
                                                            entries.tokens[static_cast<size_t>(c)]);
        }
      }
      std::vector<int32_t> tokens;
      std::vector<int64_t> records;
      for (int64_t c = 0; c < count; ++c) {
        if (!kept[static_cast<size_t>(c)]) continue;
        const int64_t position = std::ssize(tokens);
        const size_t from =
            static_cast<size_t>(row * saved + at[static_cast<size_t>(c)]) * row_bytes;
        std::memcpy(pool.row(layer, KvKind::Key, b, g, position),
                    static_cast<const char*>(saved_keys.raw()) + from, row_bytes);
        std::memcpy(pool.row(layer, KvKind::Value, b, g, position),
                    static_cast<const char*>(saved_values.raw()) + from, row_bytes);
        if (!dense(layer)) partial.write_partial_key(b, g, position, keys.data() + c * d);
        tokens.push_back(entries.tokens[static_cast<size_t>(c)]);
        records.push_back(record[row * saved + at[static_cast<size_t>(c)]] + (lru ? start : 0));
      }
      capped_->restore_row(layer, row, tokens, records);
    }
    if (layer == 0) history_end_[static_cast<size_t>(b)] = static_cast<int32_t>(history_end);
  }
}

}  // namespace infinigen
