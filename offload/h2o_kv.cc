// offload: the `h2o` baseline: heavy hitters plus recent tokens within a fixed KV budget.
#include "offload/h2o_kv.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "core/ops.h"
#include "core/saturating.h"
#include "core/trace.h"
#include "offload/kv_policy.h"
#include "offload/memory_planner.h"

namespace infinigen {

const KvPolicy& h2o_kv_policy() {
  static const KvPolicy policy{
      "h2o",
      "heavy hitters + recent tokens within a budget, kept in host memory, all loaded each step",
      {"h2o_budget"},
      /*exact=*/false,
      /*selects_loads=*/false,
      // Scores accumulate on the host (CPU backend) or on the device (CUDA).
      [](Device) { return true; },
      [](const MemoryRequest& r) -> KvMemory {
        // The kept entries (`slots` per layer, sequence and head) in the host pool; on the
        // device their staging with a row for the new token, or in a resumed turn's first pass
        // for each of its tokens.
        const ModelConfig& c = r.config;
        const int64_t slots = h2o_slots(r.options.h2o_budget, request_positions(r));
        size_t device = kv_staging_bytes(r, slots + (r.resumed ? r.prompt_len : 1));
        if (r.gemm_scratch) {
          // The CUDA backend keeps the bookkeeping on the device: per row of every layer a score
          // and a token index, the decode's scratch (a float per row), each (b, h)'s placed row
          // per layer, and while the prefill runs its scratch (per prompt position two floats
          // per query head, a float and a flag per KV head).
          device = saturating_sum(
              {device, saturating_product({8 * c.num_layers + 4, r.batch, c.kv_heads(), slots + 1}),
               saturating_product({4, c.num_layers, r.batch, c.kv_heads()}),
               saturating_product({8, r.batch, c.num_heads + c.kv_heads(), r.prompt_len})});
        }
        return {device,
                saturating_product({2, c.num_layers, r.batch, c.kv_heads(), slots, c.head_dim(),
                                    static_cast<int64_t>(dtype_size(r.kv_dtype))})};
      },
      [](const KvStoreArgs& a) -> std::unique_ptr<KvStore> {
        return std::make_unique<H2oKv>(a.config, a.batch, a.capacity, a.kv_dtype, a.device,
                                       a.options.h2o_budget, a.engine, a.stats);
      },
      // Saved as its layers' state at every turn's end (H2oKv::layer_state); the pool is pinned
      // host memory on either backend. Kept entries cannot move: no overflow.
      /*resumable=*/true,
      /*session_options=*/{"h2o_budget"},
      /*host_token_rows=*/true,
      /*shifts_positions=*/false};
  return policy;
}

namespace {

// A CPU tensor with `tensor`'s contents (itself when it is on the CPU already).
Tensor on_host(const Tensor& tensor) {
  return tensor.device() == Device::Cpu ? tensor : tensor.to(Device::Cpu);
}

// Products rounded on their own, summed in order: the reference the device's scores
// (kernels/cuda/h2o.cu, tiled, with FMAs) match within fp32 rounding. offload/CMakeLists.txt
// compiles this file with -ffp-contract=off, so that the reference does not depend on which
// products the compiler fuses into FMAs (the vectorised body and the tail of this loop differ at
// -O3).
float dot(const float* a, const float* b, int64_t n) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}

// logits -> softmax probabilities in place (n >= 1).
void softmax_inplace(float* logits, int64_t n) {
  const float max = *std::max_element(logits, logits + n);
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    logits[i] = std::exp(logits[i] - max);
    sum += logits[i];
  }
  for (int64_t i = 0; i < n; ++i) logits[i] /= sum;
}

// `budget`, which must be a share in (0, 1].
double checked_budget(double budget) {
  INFINIGEN_CHECK(budget > 0.0 && budget <= 1.0, "h2o budget must be in (0, 1], got ", budget);
  return budget;
}

}  // namespace

int64_t h2o_choose_victim(std::span<const float> scores, std::span<const int32_t> tokens,
                          int32_t recent_start) {
  INFINIGEN_CHECK(scores.size() == tokens.size(), "h2o victim: ", scores.size(), " scores for ",
                  tokens.size(), " tokens");
  int64_t victim = -1;
  for (size_t i = 0; i < scores.size(); ++i) {
    if (tokens[i] >= recent_start) continue;
    if (victim < 0) {
      victim = static_cast<int64_t>(i);
      continue;
    }
    const auto v = static_cast<size_t>(victim);
    if (scores[i] < scores[v] || (scores[i] == scores[v] && tokens[i] < tokens[v])) {
      victim = static_cast<int64_t>(i);
    }
  }
  return victim;
}

void h2o_accumulate_scores(const float* query, const float* keys, int64_t n, int64_t d,
                           float* probs, float* scores) {
  for (int64_t r = 0; r < n; ++r) probs[r] = dot(query, keys + r * d, d);
  softmax_inplace(probs, n);
  for (int64_t r = 0; r < n; ++r) scores[r] += probs[r];
}

std::vector<int64_t> h2o_keep(std::span<const float> scores, std::span<const int32_t> tokens,
                              int64_t slots, int64_t recent) {
  const auto n = static_cast<int64_t>(scores.size());
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), int64_t{0});
  const auto token = [&](int64_t i) { return tokens[static_cast<size_t>(i)]; };
  std::sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return token(x) < token(y); });
  if (n <= slots) return order;
  // The recent window, then the older candidates by score (ties to the newer).
  std::vector<int64_t> keep(order.end() - recent, order.end());
  order.resize(static_cast<size_t>(n - recent));
  std::sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
    const float sx = scores[static_cast<size_t>(x)], sy = scores[static_cast<size_t>(y)];
    return sx != sy ? sx > sy : token(x) > token(y);
  });
  keep.insert(keep.end(), order.begin(), order.begin() + (slots - recent));
  std::sort(keep.begin(), keep.end(), [&](int64_t x, int64_t y) { return token(x) < token(y); });
  return keep;
}

int64_t h2o_slots(double budget, int64_t capacity) {
  // The epsilon keeps products such as 0.29 * 100 = 28.999... at the intended count.
  return std::max<int64_t>(
      2, static_cast<int64_t>(std::floor(budget * static_cast<double>(capacity) + 1e-9)));
}

H2oKv::H2oKv(const ModelConfig& config, int64_t batch, int64_t capacity, DType kv_dtype,
             Device device, double budget, TransferEngine& engine, OffloadStats& stats)
    : KvStore(batch, capacity),
      heads_(config.kv_heads()),
      group_(config.num_heads / config.kv_heads()),
      head_dim_(config.head_dim()),
      kv_dtype_(kv_dtype),
      device_(device),
      on_device_(device == Device::Cuda && !dry_run()),
      slots_(h2o_slots(checked_budget(budget), capacity)),
      recent_(slots_ / 2),
      row_bytes_(static_cast<size_t>(config.head_dim()) * dtype_size(kv_dtype)),
      count_(static_cast<size_t>(batch), 0),
      history_in_pass_(static_cast<size_t>(batch), 0),
      view_first_valid_(static_cast<size_t>(batch), 0),
      pipeline_(config.num_layers, engine, stats, {batch, heads_, slots_ + 1, head_dim_}, kv_dtype,
                device) {
  const int64_t L = config.num_layers;
  pool_.reset(static_cast<char*>(pinned_alloc(
      static_cast<size_t>(L * 2 * batch * heads_ * slots_) * row_bytes_, "the H2O KV pool")));
  // The largest chunk list either way, so that no step grows the CUDA gathers' buffers: a layer's
  // K and V runs, one per (sequence, head), of up to `slots` rows.
  engine.reserve_gathers(static_cast<size_t>(2 * batch * heads_),
                         static_cast<size_t>(2 * batch * heads_ * slots_) * row_bytes_);
  if (on_device_) {
    const Shape rows = {batch, heads_, slots_ + 1};
    for (int64_t l = 0; l < L; ++l) {
      device_scores_.push_back(Tensor::zeros(rows, DType::F32, device));
      device_tokens_.push_back(Tensor::zeros(rows, DType::I32, device));
      placed_.push_back(Tensor::zeros({batch, heads_}, DType::I32, device));
    }
    probs_ = Tensor::empty(rows, DType::F32, device);
    return;
  }
  const auto rows = static_cast<size_t>(L * batch * heads_ * (slots_ + 1));
  if (!dry_run()) host_keys_.assign(rows * static_cast<size_t>(head_dim_), 0.0f);
  scores_.assign(rows, 0.0f);
  tokens_.assign(rows, -1);
}

char* H2oKv::pool_row(int64_t layer, int64_t kind, int64_t b, int64_t h, int64_t row) const {
  const auto index =
      static_cast<size_t>((((layer * 2 + kind) * batch() + b) * heads_ + h) * slots_ + row);
  return pool_.get() + index * row_bytes_;
}

char* H2oKv::staging_row(Tensor& staging, int64_t b, int64_t h, int64_t row) const {
  const auto index = static_cast<size_t>((b * heads_ + h) * (slots_ + 1) + row);
  return static_cast<char*>(staging.raw()) + index * row_bytes_;
}

float H2oKv::round_kv(float value) const {
  switch (kv_dtype_) {
    case DType::F16:
      return f16_to_float(float_to_f16(value));
    case DType::BF16:
      return bf16_to_float(float_to_bf16(value));
    default:
      return value;
  }
}

template <typename T>
std::vector<T> H2oKv::kept_entries(const std::vector<T>& host, const std::vector<Tensor>& device,
                                   int64_t layer, int64_t b, int64_t h) const {
  const int64_t first = slots_ - kept(b);
  if (!on_device_) {
    return {host.begin() + static_cast<std::ptrdiff_t>(entry(layer, b, h, first)),
            host.begin() + static_cast<std::ptrdiff_t>(entry(layer, b, h, slots_))};
  }
  // The device's bookkeeping is written on the compute stream, which the host does not follow.
  pipeline_.engine().compute_stream().synchronize();
  std::vector<T> out(static_cast<size_t>(slots_ - first));
  const Tensor& rows = device[static_cast<size_t>(layer)];
  const auto offset = static_cast<size_t>((b * heads_ + h) * (slots_ + 1) + first);
  device_copy(out.data(), Device::Cpu, static_cast<const T*>(rows.raw()) + offset, device_,
              out.size() * sizeof(T));
  return out;
}

std::vector<int32_t> H2oKv::kept_tokens(int64_t layer, int64_t b, int64_t h) const {
  return kept_entries(tokens_, device_tokens_, layer, b, h);
}

std::vector<float> H2oKv::kept_scores(int64_t layer, int64_t b, int64_t h) const {
  return kept_entries(scores_, device_scores_, layer, b, h);
}

void H2oKv::keep_sequences(const std::vector<int64_t>& keep, const std::vector<LeaderMove>&) {
  pipeline_.keep_batch(std::ssize(keep));  // after every transfer in flight
  const int64_t L = pipeline_.num_layers();
  const size_t rows = static_cast<size_t>(heads_ * (slots_ + 1));  // bookkeeping per sequence
  if (!dry_run()) {
    // [L][2][B][H][slots] rows -> [L][2][K][H][slots].
    compact_batch_bytes(pool_.get(), 2 * L, batch(), keep,
                        static_cast<size_t>(heads_ * slots_) * row_bytes_);
  }
  compact_batch(host_keys_, keep, rows * static_cast<size_t>(head_dim_), L);
  compact_batch(scores_, keep, rows, L);
  compact_batch(tokens_, keep, rows, L);
  for (size_t l = 0; l < device_scores_.size(); ++l) {
    compact_batch(device_scores_[l], keep);
    compact_batch(device_tokens_[l], keep);
    compact_batch(placed_[l], keep);
  }
  if (probs_.defined()) probs_ = probs_.slice_rows(0, std::ssize(keep));
  compact_batch(count_, keep, 1);
  compact_batch(view_first_valid_, keep, 1);
}

void H2oKv::start_pass(int64_t n_new) {
  KvStore::start_pass(n_new);
  const bool extension = extending();
  // An extension's staging holds the kept rows and the pass's n (after every transfer in flight).
  if (extension) pipeline_.resize_staging(slots_ + n_new);
  for (int64_t b = 0; b < batch(); ++b) {
    // An extension stages the kept rows just before the sequence's new tokens.
    const auto i = static_cast<size_t>(b);
    view_first_valid_[i] =
        static_cast<int32_t>(slots_ - count_[i] + (extension ? history_in_pass_[i] : 0));
  }
  pipeline_.start_pass(*this);
  // Decode: layer 0's KV starts moving before the embedding.
  if (length() > 0 && !extension) issue_load(0);
}

void H2oKv::start_layer(int64_t layer) {
  // While this layer computes, the next layer's KV moves into the other staging buffer (which
  // layer - 1 has finished reading: compute runs in order).
  if (length() > 0 && !extending() && layer + 1 < pipeline_.num_layers()) issue_load(layer + 1);
}

void H2oKv::issue_load(int64_t layer) {
  Tensor& keys = pipeline_.keys(layer);
  Tensor& values = pipeline_.values(layer);
  if (debug_poison()) {  // rows that the load does not bring must never be read
    pipeline_.await_store_reads(layer);
    pipeline_.poison(layer);
  }
  std::vector<CopyChunk> chunks;
  chunks.reserve(static_cast<size_t>(2 * batch() * heads_));
  LayerTraffic& traffic = pipeline_.traffic(layer);
  for (int64_t b = 0; b < batch(); ++b) {
    const int64_t count = count_[static_cast<size_t>(b)], row0 = slots_ - count;
    if (count == 0) continue;
    const size_t run = static_cast<size_t>(count) * row_bytes_;
    for (int64_t h = 0; h < heads_; ++h) {
      chunks.push_back({staging_row(keys, b, h, row0), pool_row(layer, 0, b, h, row0), run});
      chunks.push_back({staging_row(values, b, h, row0), pool_row(layer, 1, b, h, row0), run});
    }
    traffic.tokens_fetched += static_cast<uint64_t>(count * heads_);
  }
  traffic.tokens_stored = traffic.tokens_fetched;  // the pool holds exactly what is loaded
  pipeline_.load(layer, std::move(chunks));
}

void H2oKv::observe(int64_t layer, const AttentionInput& input) {
  (void)layer;
  queries_ = input.queries;  // the model's buffer, valid until the layer's attention has run
}

void H2oKv::append(int64_t layer, const Tensor& keys, const Tensor& values) {
  INFINIGEN_CHECK(queries_.defined(), "h2o: append(", layer, ") before observe");
  if (length() == 0) {
    prefill(layer, keys, values);
  } else if (extending()) {
    extend(layer, keys, values);
  } else {
    decode(layer, keys, values);
  }
  queries_ = Tensor();
}

KvStore::View H2oKv::view(int64_t layer) {
  // An extension's staging was written from the host in append.
  if (extending()) {
    return {&pipeline_.keys(layer), &pipeline_.values(layer), slots_ + pass_tokens(),
            &view_first_valid_};
  }
  // On CUDA the decode's scoring, in append, waited for the load already.
  if (device_ != Device::Cuda) pipeline_.wait_for_load(layer);
  return {&pipeline_.keys(layer), &pipeline_.values(layer), slots_ + 1, &view_first_valid_};
}

void H2oKv::prefill(int64_t layer, const Tensor& keys, const Tensor& values) {
  const int64_t n = pass_tokens(), B = batch(), H = heads_, d = head_dim_;
  if (traced("h2o_prefill_scores", {B, H * group_, n, d})) {
    keep_newest_prompt_tokens(layer, n);  // a dry run: what zero scores keep
    pipeline_.await_store_reads(layer);
  } else if (on_device_) {
    prefill_on_device(layer, keys, values);
  } else {
    prefill_on_host(layer, keys, values);
  }
  store_prompt_rows(layer);
}

void H2oKv::prefill_on_host(int64_t layer, const Tensor& keys, const Tensor& values) {
  const int64_t n = pass_tokens(), B = batch(), H = heads_, d = head_dim_, width = H * d;
  const int64_t q_width = width * group_;
  // Staged compact rows (B, H_kv, slots + 1, d) fp32; rows nobody stores stay zero.
  Tensor staged_k = Tensor::zeros({B, H, slots_ + 1, d}, DType::F32);
  Tensor staged_v = Tensor::zeros({B, H, slots_ + 1, d}, DType::F32);
  const std::vector<int32_t>& fv = first_valid();
  const Tensor q = on_host(queries_), k = on_host(keys), v = on_host(values);
  const float* qd = q.data<float>();
  const float* kd = k.data<float>();
  const float* vd = v.data<float>();
  float* sk = staged_k.data<float>();
  float* sv = staged_v.data<float>();
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      const int64_t start = fv[static_cast<size_t>(b)], valid = n - start;
      // (valid, d): the valid keys as the KV dtype stores them.
      std::vector<float> rounded(static_cast<size_t>(valid * d));
      for (int64_t j = 0; j < valid; ++j) {
        const float* src = kd + (b * n + start + j) * width + h * d;
        for (int64_t e = 0; e < d; ++e) rounded[static_cast<size_t>(j * d + e)] = round_kv(src[e]);
      }
      // Causal softmax of every valid query of the group's heads; each key sums the
      // probability it received.
      std::vector<float> score(static_cast<size_t>(valid), 0.0f);
      std::vector<float> probs(static_cast<size_t>(valid));
      for (int64_t head = h * group_; head < (h + 1) * group_; ++head) {
        for (int64_t i = 0; i < valid; ++i) {
          const float* qi = qd + (b * n + start + i) * q_width + head * d;
          for (int64_t j = 0; j <= i; ++j) {
            probs[static_cast<size_t>(j)] = dot(qi, rounded.data() + j * d, d);
          }
          softmax_inplace(probs.data(), i + 1);
          for (int64_t j = 0; j <= i; ++j)
            score[static_cast<size_t>(j)] += probs[static_cast<size_t>(j)];
        }
      }
      // Keep the recent window and the highest-scoring older tokens (ties keep the newer).
      std::vector<int32_t> token(static_cast<size_t>(valid));
      std::iota(token.begin(), token.end(), static_cast<int32_t>(start));
      const std::vector<int64_t> keep = h2o_keep(score, token, slots_, recent_);
      const int64_t row0 = slots_ - static_cast<int64_t>(keep.size());
      for (size_t r = 0; r < keep.size(); ++r) {
        const int64_t j = keep[r], row = row0 + static_cast<int64_t>(r);
        const size_t e = entry(layer, b, h, row);
        const int64_t staged = ((b * H + h) * (slots_ + 1) + row) * d;
        std::memcpy(sk + staged, kd + (b * n + start + j) * width + h * d, sizeof(float) * d);
        std::memcpy(sv + staged, vd + (b * n + start + j) * width + h * d, sizeof(float) * d);
        std::memcpy(&host_keys_[e * static_cast<size_t>(d)], rounded.data() + j * d,
                    sizeof(float) * d);
        scores_[e] = score[static_cast<size_t>(j)];
        tokens_[e] = static_cast<int32_t>(start + j);
      }
    }
  }
  // The kept rows reach the pool as a decode step's would: staged on the device, then stored.
  // The staging buffer was last read by the store of layer - 2.
  pipeline_.await_store_reads(layer);
  Tensor& staging_keys = pipeline_.keys(layer);
  Tensor& staging_values = pipeline_.values(layer);
  const Tensor ck = staged_k.to_dtype(kv_dtype_), cv = staged_v.to_dtype(kv_dtype_);
  device_copy(staging_keys.raw(), device_, ck.raw(), Device::Cpu, ck.nbytes());
  device_copy(staging_values.raw(), device_, cv.raw(), Device::Cpu, cv.nbytes());
}

void H2oKv::prefill_on_device(int64_t layer, const Tensor& keys, const Tensor& values) {
  const int64_t n = pass_tokens(), B = batch(), H = heads_;
  if (layer == 0) {  // the pass's scratch, for every layer (freed by end_pass)
    row_stats_ = Tensor::empty({2, B, H * group_, n}, DType::F32, device_);
    key_scores_ = Tensor::empty({B, H, n}, DType::F32, device_);
    keep_flags_ = Tensor::zeros({B, H, n}, DType::I32, device_);
  }
  // The kernels write the kept rows into the staging buffer, which the store of layer - 2 read.
  pipeline_.await_store_reads(layer);
  const size_t l = static_cast<size_t>(layer);
  ops::h2o_prefill(queries_, keys, values, pipeline_.keys(layer), pipeline_.values(layer),
                   device_scores_[l], device_tokens_[l], row_stats_, key_scores_, keep_flags_,
                   first_valid(), slots_, recent_);
}

void H2oKv::store_prompt_rows(int64_t layer) {
  // The kept rows reach the pool as a decode step's would: staged on the device, then stored.
  const int64_t n = pass_tokens(), B = batch(), H = heads_;
  const std::vector<int32_t>& fv = first_valid();
  Tensor& staging_keys = pipeline_.keys(layer);
  Tensor& staging_values = pipeline_.values(layer);
  std::vector<CopyChunk> chunks;
  chunks.reserve(static_cast<size_t>(2 * B * H));
  LayerTraffic& traffic = pipeline_.traffic(layer);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t count = std::min(n - fv[static_cast<size_t>(b)], slots_), row0 = slots_ - count;
    if (count == 0) continue;
    const size_t run = static_cast<size_t>(count) * row_bytes_;
    for (int64_t h = 0; h < H; ++h) {
      chunks.push_back(
          {pool_row(layer, 0, b, h, row0), staging_row(staging_keys, b, h, row0), run});
      chunks.push_back(
          {pool_row(layer, 1, b, h, row0), staging_row(staging_values, b, h, row0), run});
    }
    traffic.tokens_stored += static_cast<uint64_t>(H * count);
  }
  pipeline_.store(layer, std::move(chunks));
}

void H2oKv::decode(int64_t layer, const Tensor& keys, const Tensor& values) {
  const int64_t B = batch(), H = heads_, d = head_dim_;
  Tensor& staging_keys = pipeline_.keys(layer);
  Tensor& staging_values = pipeline_.values(layer);
  // The new token goes into row `slots` of every (b, h), which the store of layer - 2 (or of the
  // previous step's last layers) has finished reading.
  pipeline_.await_store_reads(layer);
  ops::cache_store(keys, staging_keys, slots_);
  ops::cache_store(values, staging_values, slots_);
  // On CUDA the scores read the kept keys from the staging: after this step's load of the layer
  // (on the device; view() then has nothing to wait for). The host reads its own copy.
  if (device_ == Device::Cuda) pipeline_.wait_for_load(layer);
  int64_t scored = 0;  // (entry, query) pairs the scoring visits, for the trace
  for (int32_t count : count_) scored += H * group_ * (count + 1);
  if (traced("h2o_decode_scores", {B, H * group_, scored / (H * group_), d})) {
    // A dry run: the new token enters with no score, so victims are the oldest candidates.
    const auto token = static_cast<int32_t>(length());
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < H; ++h) {
        tokens_[entry(layer, b, h, slots_)] = token;
        scores_[entry(layer, b, h, slots_)] = 0.0f;
      }
    }
  } else if (on_device_) {
    decode_on_device(layer);
    return;
  } else {
    score_on_host(layer, keys);
  }
  place_on_host(layer);
}

void H2oKv::score_on_host(int64_t layer, const Tensor& keys) {
  const int64_t B = batch(), H = heads_, d = head_dim_, width = H * d;
  const auto token = static_cast<int32_t>(length());
  const Tensor q = on_host(queries_), k = on_host(keys);
  const float* qd = q.data<float>();
  const float* kd = k.data<float>();
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      const size_t fresh = entry(layer, b, h, slots_);
      float* key = &host_keys_[fresh * static_cast<size_t>(d)];
      const float* src = kd + b * width + h * d;
      for (int64_t e = 0; e < d; ++e) key[e] = round_kv(src[e]);
      tokens_[fresh] = token;
      scores_[fresh] = 0.0f;
      // Each query head's softmax over the kept entries and the new token, as attention
      // computes it.
      const int64_t row0 = slots_ - count_[static_cast<size_t>(b)], n = slots_ + 1 - row0;
      const size_t first = entry(layer, b, h, row0);  // the kept rows follow it
      std::vector<float> probs(static_cast<size_t>(n));
      for (int64_t head = h * group_; head < (h + 1) * group_; ++head) {
        h2o_accumulate_scores(qd + (b * H * group_ + head) * d,
                              &host_keys_[first * static_cast<size_t>(d)], n, d, probs.data(),
                              &scores_[first]);
      }
    }
  }
}

void H2oKv::place_on_host(int64_t layer) {
  // The layer is scored: place the new token of every (b, h) in a free row, or in the victim's.
  const int64_t B = batch(), H = heads_;
  Tensor& staging_keys = pipeline_.keys(layer);
  Tensor& staging_values = pipeline_.values(layer);
  const auto recent_start = static_cast<int32_t>(length() + 1 - recent_);
  std::vector<CopyChunk> chunks;
  chunks.reserve(static_cast<size_t>(2 * B * H));
  for (int64_t b = 0; b < B; ++b) {
    const int64_t count = count_[static_cast<size_t>(b)], row0 = slots_ - count;
    for (int64_t h = 0; h < H; ++h) {
      int64_t to = row0 - 1;
      if (count == slots_) {
        const auto first = static_cast<std::ptrdiff_t>(entry(layer, b, h, row0));
        const auto n = static_cast<size_t>(slots_ + 1 - row0);
        const int64_t victim =
            h2o_choose_victim(std::span<const float>(scores_.data() + first, n),
                              std::span<const int32_t>(tokens_.data() + first, n), recent_start);
        INFINIGEN_CHECK(victim >= 0 && row0 + victim < slots_,
                        "h2o: no eviction candidate outside the recent window");
        to = row0 + victim;
      }
      move_entry(layer, b, h, slots_, to);
      chunks.push_back(
          {pool_row(layer, 0, b, h, to), staging_row(staging_keys, b, h, slots_), row_bytes_});
      chunks.push_back(
          {pool_row(layer, 1, b, h, to), staging_row(staging_values, b, h, slots_), row_bytes_});
    }
  }
  // A victim's old row may be among the rows this step's load of the layer reads.
  pipeline_.store(layer, std::move(chunks), pipeline_.loaded(layer));
}

void H2oKv::decode_on_device(int64_t layer) {
  const size_t l = static_cast<size_t>(layer);
  const Tensor& staging_keys = pipeline_.keys(layer);
  const Tensor& staging_values = pipeline_.values(layer);
  const Tensor& placed = placed_[l];
  // Scores and the choice of every (b, h)'s row, on the compute stream.
  ops::h2o_decode(queries_, staging_keys, device_scores_[l], device_tokens_[l], probs_, placed_[l],
                  view_first_valid_, static_cast<int32_t>(length()),
                  static_cast<int32_t>(length() + 1 - recent_));
  // The store of the new rows where the device placed them: a kernel on the store stream, after
  // that choice (it follows the compute enqueued before it) and after this step's load of the
  // layer (a victim's old row may be among the rows it reads).
  void* pool_keys = pool_row(layer, 0, 0, 0, 0);
  void* pool_values = pool_row(layer, 1, 0, 0, 0);
  const int64_t rows = 2 * batch() * heads_;
  pipeline_.store_by_kernel(
      layer,
      [&](void*) {
        ops::h2o_store_placed(staging_keys, staging_values, placed, pool_keys, pool_values);
        return 0;
      },
      static_cast<uint64_t>(rows) * row_bytes_, rows, pipeline_.loaded(layer));
}

void H2oKv::keep_newest_prompt_tokens(int64_t layer, int64_t n) {
  for (int64_t b = 0; b < batch(); ++b) {
    const int64_t start = first_valid()[static_cast<size_t>(b)];
    const int64_t kept = std::min(n - start, slots_);
    for (int64_t h = 0; h < heads_; ++h) {
      for (int64_t r = 0; r < kept; ++r) {
        const size_t e = entry(layer, b, h, slots_ - kept + r);
        tokens_[e] = static_cast<int32_t>(n - kept + r);
        scores_[e] = 0.0f;
      }
    }
  }
}

void H2oKv::move_entry(int64_t layer, int64_t b, int64_t h, int64_t from, int64_t to) {
  const size_t src = entry(layer, b, h, from), dst = entry(layer, b, h, to);
  const auto d = static_cast<size_t>(head_dim_);
  if (!host_keys_.empty()) {  // none in a dry run
    std::copy_n(host_keys_.begin() + static_cast<std::ptrdiff_t>(src * d), d,
                host_keys_.begin() + static_cast<std::ptrdiff_t>(dst * d));
  }
  scores_[dst] = scores_[src];
  tokens_[dst] = tokens_[src];
}

void H2oKv::end_pass(int64_t n_new) {
  const bool extension = extending();
  if (length() == 0) {
    for (int64_t b = 0; b < batch(); ++b) {
      const int64_t valid = n_new - first_valid()[static_cast<size_t>(b)];
      count_[static_cast<size_t>(b)] = static_cast<int32_t>(std::min(valid, slots_));
    }
  } else if (extension) {
    count_ = extended_count_;
    std::fill(history_in_pass_.begin(), history_in_pass_.end(), 0);
  } else {
    for (int32_t& count : count_)
      count = static_cast<int32_t>(std::min<int64_t>(count + 1, slots_));
  }
  pipeline_.end_pass(*this);  // reads the pass's state before KvStore::end_pass moves it
  if (extension) pipeline_.resize_staging(slots_ + 1);  // the decode steps' staging
  if (length() == 0) {        // the prefill's scratch (freeing waits for the kernels using it)
    row_stats_ = Tensor();
    key_scores_ = Tensor();
    keep_flags_ = Tensor();
  }
  KvStore::end_pass(n_new);
}

void H2oKv::read_bookkeeping(int64_t layer, std::vector<float>& scores,
                             std::vector<int32_t>& tokens) const {
  const auto n = static_cast<size_t>(batch() * heads_ * (slots_ + 1));
  scores.resize(n);
  tokens.resize(n);
  if (!on_device_) {
    const auto first = static_cast<std::ptrdiff_t>(entry(layer, 0, 0, 0));
    std::copy_n(scores_.begin() + first, n, scores.begin());
    std::copy_n(tokens_.begin() + first, n, tokens.begin());
    return;
  }
  // The device's bookkeeping is written on the compute stream, which the host does not follow.
  pipeline_.engine().compute_stream().synchronize();
  const auto l = static_cast<size_t>(layer);
  device_copy(scores.data(), Device::Cpu, device_scores_[l].raw(), device_, n * sizeof(float));
  device_copy(tokens.data(), Device::Cpu, device_tokens_[l].raw(), device_, n * sizeof(int32_t));
}

void H2oKv::write_bookkeeping(int64_t layer, const std::vector<float>& scores,
                              const std::vector<int32_t>& tokens) {
  if (!on_device_) {
    const auto first = static_cast<std::ptrdiff_t>(entry(layer, 0, 0, 0));
    std::copy(scores.begin(), scores.end(), scores_.begin() + first);
    std::copy(tokens.begin(), tokens.end(), tokens_.begin() + first);
    return;
  }
  const auto l = static_cast<size_t>(layer);
  device_copy(device_scores_[l].raw(), device_, scores.data(), Device::Cpu,
              scores.size() * sizeof(float));
  device_copy(device_tokens_[l].raw(), device_, tokens.data(), Device::Cpu,
              tokens.size() * sizeof(int32_t));
}

void H2oKv::extend(int64_t layer, const Tensor& keys, const Tensor& values) {
  const int64_t n = pass_tokens(), B = batch(), H = heads_, d = head_dim_, S = slots_;
  const int64_t past = length(), rows = S + n, width = H * d, q_width = width * group_;
  // Per sequence: the pass's rows before its new tokens (history kept already, or padding),
  // and the entries kept after the pass (the same for every layer and head: each has count + new
  // candidates).
  std::vector<int64_t> first_new(static_cast<size_t>(B)), kept(static_cast<size_t>(B));
  extended_count_.resize(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    const auto i = static_cast<size_t>(b);
    first_new[i] = history_in_pass_[i];
    kept[i] = std::min(count_[i] + n - first_new[i], S);
    extended_count_[i] = static_cast<int32_t>(kept[i]);
  }
  // (query, candidate) pairs each query head scores over the batch, for the trace: each new
  // token's query over the kept entries and the new tokens up to its own.
  int64_t scored = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t m = n - first_new[static_cast<size_t>(b)];
    scored += count_[static_cast<size_t>(b)] * m + m * (m + 1) / 2;
  }
  if (traced("extension_scores", {H * group_, scored, d})) {
    // A dry run: with no scores the newest tokens are what is kept.
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < H; ++h) {
        const int64_t k = kept[static_cast<size_t>(b)];
        for (int64_t r = 0; r < k; ++r) {
          tokens_[entry(layer, b, h, S - k + r)] = static_cast<int32_t>(past + n - k + r);
          scores_[entry(layer, b, h, S - k + r)] = 0.0f;
        }
      }
    }
    return;
  }
  // The pool holds every row earlier passes stored, and on CUDA the device is done with the
  // staging of this layer's parity (the attention of layer - 2) and with the bookkeeping.
  pipeline_.drain_stores();
  if (device_ == Device::Cuda) pipeline_.engine().compute_stream().synchronize();
  std::vector<float> scores;
  std::vector<int32_t> tokens;
  read_bookkeeping(layer, scores, tokens);
  const Tensor q = on_host(queries_);
  // The pass's rows (B * n, H * d) as the KV dtype stores them.
  const Tensor k = on_host(keys).to_dtype(kv_dtype_), v = on_host(values).to_dtype(kv_dtype_);
  const size_t kv_bytes = dtype_size(kv_dtype_);
  // The staging, assembled here: (B, H, slots + n, d), each (b, h)'s kept rows just before its
  // new tokens' rows (over the pass's rows of history it keeps already), then those.
  Tensor staged_k = Tensor::zeros({B, H, rows, d}, kv_dtype_);
  Tensor staged_v = Tensor::zeros({B, H, rows, d}, kv_dtype_);
  const float* qd = q.data<float>();
  LayerTraffic& traffic = pipeline_.traffic(layer);
#pragma omp parallel for collapse(2) schedule(dynamic, 1)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      const auto i = static_cast<size_t>(b);
      const int64_t count = count_[i], skip = first_new[i], row0 = S + skip - count;
      char* sk =
          static_cast<char*>(staged_k.raw()) + static_cast<size_t>((b * H + h) * rows) * row_bytes_;
      char* sv =
          static_cast<char*>(staged_v.raw()) + static_cast<size_t>((b * H + h) * rows) * row_bytes_;
      if (count > 0) {
        std::memcpy(sk + static_cast<size_t>(row0) * row_bytes_,
                    pool_row(layer, 0, b, h, S - count), static_cast<size_t>(count) * row_bytes_);
        std::memcpy(sv + static_cast<size_t>(row0) * row_bytes_,
                    pool_row(layer, 1, b, h, S - count), static_cast<size_t>(count) * row_bytes_);
      }
      for (int64_t j = skip; j < n; ++j) {
        const size_t src = static_cast<size_t>((b * n + j) * width + h * d) * kv_bytes;
        std::memcpy(sk + static_cast<size_t>(S + j) * row_bytes_,
                    static_cast<const char*>(k.raw()) + src, row_bytes_);
        std::memcpy(sv + static_cast<size_t>(S + j) * row_bytes_,
                    static_cast<const char*>(v.raw()) + src, row_bytes_);
      }
      // The candidates, staging rows [row0, slots + n): the kept entries, then the new tokens.
      const int64_t from = row0, m = rows - from;
      std::vector<float> key(static_cast<size_t>(m * d));
      convert_to_f32(sk + static_cast<size_t>(from) * row_bytes_, kv_dtype_, key.data(),
                     key.size());
      std::vector<float> score(static_cast<size_t>(m), 0.0f);
      std::vector<int32_t> token(static_cast<size_t>(m));
      for (int64_t c = 0; c < count; ++c) {
        score[static_cast<size_t>(c)] = scores[entry(0, b, h, S - count + c)];
        token[static_cast<size_t>(c)] = tokens[entry(0, b, h, S - count + c)];
      }
      for (int64_t c = count; c < m; ++c) {
        token[static_cast<size_t>(c)] = static_cast<int32_t>(past + skip + c - count);
      }
      // Each valid query of the group's heads: its softmax over the kept entries and the pass's
      // tokens up to its own, as attention computes it, summed into their scores.
      std::vector<float> probs(static_cast<size_t>(m));
      for (int64_t head = h * group_; head < (h + 1) * group_; ++head) {
        for (int64_t j = skip; j < n; ++j) {
          // Query j sees the kept entries and the new tokens up to its own.
          h2o_accumulate_scores(qd + (b * n + j) * q_width + head * d, key.data(),
                                count + j - skip + 1, d, probs.data(), score.data());
        }
      }
      const std::vector<int64_t> keep = h2o_keep(score, token, S, recent_);
      const int64_t first = S - std::ssize(keep);
      for (size_t r = 0; r < keep.size(); ++r) {
        const int64_t c = keep[r], row = first + static_cast<int64_t>(r);
        std::memcpy(pool_row(layer, 0, b, h, row), sk + static_cast<size_t>(from + c) * row_bytes_,
                    row_bytes_);
        std::memcpy(pool_row(layer, 1, b, h, row), sv + static_cast<size_t>(from + c) * row_bytes_,
                    row_bytes_);
        const size_t e = entry(0, b, h, row);
        scores[e] = score[static_cast<size_t>(c)];
        tokens[e] = token[static_cast<size_t>(c)];
        if (!host_keys_.empty()) {
          std::memcpy(&host_keys_[entry(layer, b, h, row) * static_cast<size_t>(d)],
                      key.data() + c * d, sizeof(float) * static_cast<size_t>(d));
        }
      }
    }
  }
  write_bookkeeping(layer, scores, tokens);
  device_copy(pipeline_.keys(layer).raw(), device_, staged_k.raw(), Device::Cpu, staged_k.nbytes());
  device_copy(pipeline_.values(layer).raw(), device_, staged_v.raw(), Device::Cpu,
              staged_v.nbytes());
  for (int64_t b = 0; b < B; ++b) {
    traffic.tokens_fetched += static_cast<uint64_t>(count_[static_cast<size_t>(b)] * H);
    traffic.tokens_stored += static_cast<uint64_t>(kept[static_cast<size_t>(b)] * H);
  }
}

KvStore::LayerState H2oKv::layer_state(int64_t layer) const {
  const int64_t B = batch(), H = heads_, S = slots_, d = head_dim_;
  if (dry_run()) {  // shapes only
    return {{"h2o_keys", Tensor::empty({B, H, S, d}, kv_dtype_)},
            {"h2o_values", Tensor::empty({B, H, S, d}, kv_dtype_)},
            {"h2o_tokens", Tensor::empty({B, H, S}, DType::I32)},
            {"h2o_scores", Tensor::empty({B, H, S}, DType::F32)}};
  }
  std::vector<float> scores;
  std::vector<int32_t> tokens;
  read_bookkeeping(layer, scores, tokens);
  Tensor keys = Tensor::zeros({B, H, S, d}, kv_dtype_),
         values = Tensor::zeros({B, H, S, d}, kv_dtype_);
  Tensor saved_tokens = Tensor::empty({B, H, S}, DType::I32);
  Tensor saved_scores = Tensor::zeros({B, H, S}, DType::F32);
  std::fill_n(saved_tokens.data<int32_t>(), saved_tokens.numel(), -1);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t count = count_[static_cast<size_t>(b)];
    const int32_t start = first_valid()[static_cast<size_t>(b)];
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t row = S - count; row < S; ++row) {
        const size_t at = static_cast<size_t>((b * H + h) * S + row);
        std::memcpy(static_cast<char*>(keys.raw()) + at * row_bytes_, pool_row(layer, 0, b, h, row),
                    row_bytes_);
        std::memcpy(static_cast<char*>(values.raw()) + at * row_bytes_,
                    pool_row(layer, 1, b, h, row), row_bytes_);
        saved_tokens.data<int32_t>()[at] = tokens[entry(0, b, h, row)] - start;
        saved_scores.data<float>()[at] = scores[entry(0, b, h, row)];
      }
    }
  }
  return {{"h2o_keys", keys},
          {"h2o_values", values},
          {"h2o_tokens", saved_tokens},
          {"h2o_scores", saved_scores}};
}

void H2oKv::restore_layer_state(int64_t layer, const LayerState& state) {
  const int64_t B = batch(), H = heads_, S = slots_, d = head_dim_;
  if (state.empty() && dry_run()) {    // shapes only: each sequence's newest tokens, as equal
    for (int64_t b = 0; b < B; ++b) {  // (zero) scores keep
      const int64_t count = std::min<int64_t>(length() - first_valid()[static_cast<size_t>(b)], S);
      count_[static_cast<size_t>(b)] = static_cast<int32_t>(count);
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t r = 0; r < count; ++r) {
          tokens_[entry(layer, b, h, S - count + r)] = static_cast<int32_t>(length() - count + r);
          scores_[entry(layer, b, h, S - count + r)] = 0.0f;
        }
      }
    }
    return;
  }
  const auto find = [&](const std::string& name) -> const Tensor& {
    for (const auto& [key, tensor] : state) {
      if (key == name) return tensor;
    }
    fail("layer ", layer, ": the session's H2O state has no ", name, " (the session is corrupt)");
  };
  const Tensor& saved_tokens = find("h2o_tokens");
  const int64_t saved = saved_tokens.rank() == 3 ? saved_tokens.dim(2) : 0;
  const auto check = [&](const Tensor& t, const std::string& name, DType dtype, Shape shape) {
    INFINIGEN_CHECK(t.dtype() == dtype && t.shape() == shape, "layer ", layer, ": the session's ",
                    name, " is ", dtype_name(t.dtype()), " ", shape_string(t.shape()), ", not ",
                    dtype_name(dtype), " ", shape_string(shape), " (the session is corrupt)");
  };
  check(saved_tokens, "h2o_tokens", DType::I32, {B, H, saved});
  const Tensor& saved_scores = find("h2o_scores");
  const Tensor& saved_keys = find("h2o_keys");
  const Tensor& saved_values = find("h2o_values");
  check(saved_scores, "h2o_scores", DType::F32, {B, H, saved});
  check(saved_keys, "h2o_keys", kv_dtype_, {B, H, saved, d});
  check(saved_values, "h2o_values", kv_dtype_, {B, H, saved, d});
  const int32_t* index = saved_tokens.data<int32_t>();
  std::vector<float> scores(static_cast<size_t>(B * H * (S + 1)), 0.0f);
  std::vector<int32_t> tokens(scores.size(), -1);
  for (int64_t b = 0; b < B; ++b) {
    const int32_t start = first_valid()[static_cast<size_t>(b)];
    // The conversation's newest token is in every head's recent window: the history's length.
    int64_t history = 0, saved_count = 0;
    for (int64_t r = 0; r < saved; ++r) {
      saved_count += index[b * H * saved + r] >= 0 ? 1 : 0;
      for (int64_t h = 0; h < H; ++h) {
        history = std::max<int64_t>(history, index[(b * H + h) * saved + r] + 1);
      }
    }
    // The history's newest tokens may be among the pass's rows: kept as saved, not new.
    const int64_t in_pass = std::max<int64_t>(0, start + history - length());
    const int64_t count = std::min(saved_count, S);
    if (layer == 0) {
      count_[static_cast<size_t>(b)] = static_cast<int32_t>(count);
      history_in_pass_[static_cast<size_t>(b)] = static_cast<int32_t>(in_pass);
    }
    INFINIGEN_CHECK(count == count_[static_cast<size_t>(b)] &&
                        in_pass == history_in_pass_[static_cast<size_t>(b)],
                    "layer ", layer, ": the session's H2O state keeps ", count, " entries of ",
                    history, " tokens of sequence ", b, " where layer 0 keeps ",
                    count_[static_cast<size_t>(b)], " (the session is corrupt)");
    for (int64_t h = 0; h < H; ++h) {
      std::vector<int64_t> rows;
      std::vector<float> score;
      std::vector<int32_t> token;
      for (int64_t r = 0; r < saved; ++r) {
        const int64_t at = (b * H + h) * saved + r;
        if (index[at] < 0) continue;
        rows.push_back(r);
        score.push_back(saved_scores.data<float>()[at]);
        token.push_back(start + index[at]);
      }
      INFINIGEN_CHECK(std::ssize(rows) == saved_count, "layer ", layer,
                      ": the session's H2O state holds ", rows.size(), " entries of sequence ", b,
                      ", head ", h, " and ", saved_count, " of head 0 (the session is corrupt)");
      const std::vector<int64_t> keep = h2o_keep(score, token, count, std::min(recent_, count));
      for (size_t k = 0; k < keep.size(); ++k) {
        const int64_t c = keep[k], row = S - count + static_cast<int64_t>(k);
        const size_t from = static_cast<size_t>((b * H + h) * saved + rows[static_cast<size_t>(c)]);
        std::memcpy(pool_row(layer, 0, b, h, row),
                    static_cast<const char*>(saved_keys.raw()) + from * row_bytes_, row_bytes_);
        std::memcpy(pool_row(layer, 1, b, h, row),
                    static_cast<const char*>(saved_values.raw()) + from * row_bytes_, row_bytes_);
        scores[entry(0, b, h, row)] = score[static_cast<size_t>(c)];
        tokens[entry(0, b, h, row)] = token[static_cast<size_t>(c)];
        if (!host_keys_.empty()) {
          convert_to_f32(pool_row(layer, 0, b, h, row), kv_dtype_,
                         &host_keys_[entry(layer, b, h, row) * static_cast<size_t>(d)],
                         static_cast<size_t>(d));
        }
      }
    }
  }
  write_bookkeeping(layer, scores, tokens);
}

}  // namespace infinigen
