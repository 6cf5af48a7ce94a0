// speculate: partial weights, partial key cache and speculation on the CPU.
#include "speculate/speculation.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <numeric>

#include "core/ops.h"
#include "core/trace.h"
#include "kernels/cpu/parallel.h"
#include "kernels/cpu/rope.h"

namespace infinigen {

namespace {

// Positions per unit of work of the speculation's scores: large enough that a unit's fixed costs
// vanish, small enough that one long sequence's positions spread over every thread.
constexpr int64_t kSpeculationChunk = 256;

// a . b over n elements in 8 lanes (lane l sums elements l, l + 8, ...; the lanes are then added
// in pairs, the remainder last): a fixed order that the compiler turns into vector
// multiply-adds, where a single running sum would have to stay scalar.
float lane_dot(const float* a, const float* b, int64_t n) {
  constexpr int64_t kLanes = 8;
  std::array<float, kLanes> lanes{};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) lanes[static_cast<size_t>(l)] += a[j + l] * b[j + l];
  }
  float rest = 0.0f;
  for (; j < n; ++j) rest += a[j] * b[j];
  return ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) +
         ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7])) + rest;
}

// `shares`' entry for layer `layer` of `num_layers`: its own when the measured model had as many
// layers, else the one at the same relative depth among the speculated layers (the measured
// model's first dense_layers entries are its dense layers, which load everything and say nothing
// about a speculated layer).
double per_layer_share(const std::vector<double>& shares, int64_t layer, int64_t num_layers,
                       int64_t dense_layers) {
  if (static_cast<int64_t>(shares.size()) == num_layers) return shares[static_cast<size_t>(layer)];
  const int64_t measured_dense =
      std::min<int64_t>(dense_layers, static_cast<int64_t>(shares.size()) - 1);
  const int64_t measured = static_cast<int64_t>(shares.size()) - measured_dense;
  const double depth = (static_cast<double>(layer - dense_layers) + 0.5) /
                       static_cast<double>(num_layers - dense_layers);
  const int64_t at =
      std::min<int64_t>(measured - 1, static_cast<int64_t>(depth * static_cast<double>(measured)));
  return shares[static_cast<size_t>(measured_dense + at)];
}

// A CPU view of `t`: itself, or a copy when it lives on the device.
Tensor on_host(const Tensor& t) {
  return t.device() == Device::Cpu ? t : t.to(Device::Cpu);
}

}  // namespace

void SpeculationOptions::validate() const {
  INFINIGEN_CHECK(alpha >= 0 && !std::isnan(alpha), option("alpha"), " must be >= 0, got ", alpha);
  INFINIGEN_CHECK(partial_ratio > 0 && partial_ratio <= 1, option("partial_ratio"),
                  " must be in (0, 1], got ", partial_ratio);
  INFINIGEN_CHECK(partial_key_dtype == DType::F32 || partial_key_dtype == DType::F16,
                  option("partial_key_dtype"), " must be f32 or f16, got ",
                  dtype_name(partial_key_dtype));
  INFINIGEN_CHECK(max_num_kv >= 0, option("max_num_kv"), " must be >= 0 (0: the default cap), got ",
                  max_num_kv);
  INFINIGEN_CHECK(max_fetch_share > 0 && max_fetch_share <= 1, option("max_fetch_share"),
                  " must be in (0, 1], got ", max_fetch_share);
  INFINIGEN_CHECK(dense_layers >= 1, option("dense_layers"),
                  " must be at least 1 (layer 0 has no previous layer to speculate from), got ",
                  dense_layers);
}

int64_t SpeculationOptions::fetch_cap(int64_t capacity) const {
  if (max_num_kv > 0) return max_num_kv;
  return std::max<int64_t>(1,
                           static_cast<int64_t>(static_cast<double>(capacity) * max_fetch_share));
}

int64_t FetchReplay::cached(int64_t step, int64_t layer, int64_t num_layers, int64_t dense_layers,
                            int64_t b, int64_t h, int64_t batch, int64_t heads,
                            int64_t take) const {
  const size_t s = static_cast<size_t>(step - 1);
  int64_t served = 0;
  if (s < again_rows.size()) {
    const int64_t total = static_cast<int64_t>(again_rows[s][static_cast<size_t>(layer)]);
    const int64_t pairs = batch * heads;
    served = total / pairs + (b * heads + h < total % pairs ? 1 : 0);
  } else if (!again.empty()) {
    const double share = per_layer_share(again, layer, num_layers, dense_layers);
    served = static_cast<int64_t>(std::floor(share * static_cast<double>(take)));
  }
  return std::min(served, take);
}

void FetchReplay::validate(int64_t num_layers) const {
  INFINIGEN_CHECK(!fraction.empty() || !rows.empty(),
                  "a dry run of infinigen needs the share of tokens it fetches per layer (a "
                  "measured run's), as nothing is speculated without computing");
  for (double f : fraction) {
    INFINIGEN_CHECK(f >= 0 && f <= 1, "fetched share ", f, " is not in [0, 1]");
  }
  for (double f : again) {
    INFINIGEN_CHECK(f >= 0 && f <= 1, "fetched-again share ", f, " is not in [0, 1]");
  }
  for (const std::vector<uint64_t>& step : again_rows) {
    INFINIGEN_CHECK(static_cast<int64_t>(step.size()) == num_layers, "row cache rows for ",
                    step.size(), " layers per step, the model has ", num_layers);
  }
  for (const std::vector<uint64_t>& step : rows) {
    INFINIGEN_CHECK(static_cast<int64_t>(step.size()) == num_layers, "fetched rows for ",
                    step.size(), " layers per step, the model has ", num_layers);
  }
}

std::vector<int32_t> FetchReplay::take(int64_t step, int64_t layer, int64_t num_layers,
                                       int64_t dense_layers, int64_t heads, int64_t stored,
                                       const std::vector<int64_t>& valid, int64_t cap) const {
  const int64_t B = static_cast<int64_t>(valid.size());
  std::vector<int32_t> take(static_cast<size_t>(B));
  const size_t s = static_cast<size_t>(step - 1);
  if (s < rows.size()) {
    // The measured rows over the sequences: per head, an even split with the remainder first.
    const int64_t per_head = static_cast<int64_t>(rows[s][static_cast<size_t>(layer)]) / heads;
    for (int64_t b = 0; b < B; ++b) {
      const int64_t share = per_head / B + (b < per_head % B ? 1 : 0);
      take[static_cast<size_t>(b)] =
          static_cast<int32_t>(std::min(share, valid[static_cast<size_t>(b)]));
    }
    return take;
  }
  const double share = per_layer_share(fraction, layer, num_layers, dense_layers);
  const int64_t per_head =
      std::clamp<int64_t>(static_cast<int64_t>(std::floor(share * static_cast<double>(stored))), 1,
                          std::max<int64_t>(1, std::min(cap, stored)));
  for (int64_t b = 0; b < B; ++b) {
    take[static_cast<size_t>(b)] =
        static_cast<int32_t>(std::min(per_head, valid[static_cast<size_t>(b)]));
  }
  return take;
}

int64_t partial_columns(double ratio, int64_t head_dim) {
  return std::max<int64_t>(1,
                           static_cast<int64_t>(std::floor(ratio * static_cast<double>(head_dim))));
}

void PartialLayer::build(const PartialSource& source, const std::vector<int32_t>& first_valid,
                         int64_t num_heads, int64_t num_kv_heads, int64_t capacity, int64_t r,
                         PartialIndexRule rule, const std::vector<int32_t>* position_tokens,
                         DType key_dtype) {
  const int64_t B = std::ssize(first_valid);
  begin_prompt(source, B, num_heads, num_kv_heads, r, rule, key_dtype);
  std::vector<int64_t> sequences(static_cast<size_t>(B));
  std::iota(sequences.begin(), sequences.end(), 0);
  accumulate(source.queries, source.keys, sequences, first_valid, 0);
  choose_columns(source.q_weight, source.q_bias, capacity);
  if (dry_run()) return;  // a dry run keeps no partial keys
  // Partial key cache of the prompt tokens the pool holds (padding too when every position is
  // its own token; speculation skips it).
  const int64_t n = source.queries.dim(0) / B, KV = kv_heads_ * head_dim_;
  INFINIGEN_CHECK(position_tokens || n <= capacity_, "partial key cache of ", capacity_,
                  " positions cannot hold ", n, " tokens");
  const Tensor host_keys = on_host(source.keys);
  const float* k = host_keys.data<float>();
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < batch_; ++b) {
    for (int64_t g = 0; g < kv_heads_; ++g) {
      for (int64_t p = 0; p < (position_tokens ? capacity_ : n); ++p) {
        const int64_t t =
            position_tokens
                ? (*position_tokens)[static_cast<size_t>((b * kv_heads_ + g) * capacity_ + p)]
                : p;
        if (t < 0) continue;
        INFINIGEN_CHECK(t < n, "partial key cache: token ", t, " of a prompt of ", n);
        write_partial_key(b, g, p, k + (b * n + t) * KV + g * head_dim_);
      }
    }
  }
}

void PartialLayer::begin_prompt(const PartialSource& source, int64_t batch, int64_t num_heads,
                                int64_t num_kv_heads, int64_t r, PartialIndexRule rule,
                                DType key_dtype) {
  INFINIGEN_CHECK(key_dtype == DType::F32 || key_dtype == DType::F16, option("partial_key_dtype"),
                  " must be f32 or f16, got ", dtype_name(key_dtype));
  INFINIGEN_CHECK(num_kv_heads >= 1 && num_heads % num_kv_heads == 0, "speculation: ", num_kv_heads,
                  " KV heads do not divide ", num_heads, " heads");
  key_dtype_ = key_dtype;
  batch_ = batch;
  shared_ = {};
  heads_ = num_heads;
  kv_heads_ = num_kv_heads;
  group_ = num_heads / num_kv_heads;
  rule_ = rule;
  const int64_t Q = source.queries.dim(1);
  head_dim_ = Q / num_heads;
  const int64_t d = head_dim_, KV = kv_heads_ * d;
  r_ = r;
  INFINIGEN_CHECK(source.keys.dim(1) == KV && source.q_weight.dim(0) == Q, "speculation: keys (",
                  source.keys.dim(1), " wide) or query weights (", source.q_weight.dim(0),
                  " rows) do not match ", num_heads, " heads and ", num_kv_heads, " KV heads of ",
                  d);
  const bool rotary = source.rope_inv_freq.defined(), skewed = source.skew.defined();
  INFINIGEN_CHECK(!skewed || rotary,
                  "speculation: a skew beside the weights is for rotary models "
                  "only (elsewhere it is folded into W_q and W_k)");
  INFINIGEN_CHECK(!rotary || 2 * source.rope_inv_freq.numel() == d,
                  "speculation: ", source.rope_inv_freq.numel(),
                  " rotary frequencies for a head of ", d);
  INFINIGEN_CHECK(!skewed || source.skew.shape() == Shape({kv_heads_, d, d}),
                  "speculation: skew of shape ", shape_string(source.skew.shape()), ", expected ",
                  shape_string({kv_heads_, d, d}));
  // Values are read only when computing (a dry run's tensors have no memory).
  inv_freq_.assign(rotary ? static_cast<size_t>(d / 2) : 0, 0.0f);
  skew_.assign(skewed ? static_cast<size_t>(kv_heads_ * d * d) : 0, 0.0f);
  if (!dry_run()) {
    if (rotary) {
      const Tensor freq = on_host(source.rope_inv_freq);
      std::copy_n(freq.data<float>(), inv_freq_.size(), inv_freq_.begin());
    }
    if (skewed) {
      const Tensor a = source.skew.to(Device::Cpu).to_dtype(DType::F32);
      std::copy_n(a.data<float>(), skew_.size(), skew_.begin());
    }
  }
  column_scores_.assign(dry_run() ? 0 : static_cast<size_t>(batch_ * KV), 0.0);
  prompt_rows_ = 0;
  device_scores_ = {};
  device_skew_ = {};
  if (!dry_run() && source.queries.device() == Device::Cuda) {
    // The passes' rows are on the device: so are the sums (accumulate), until choose_columns.
    device_scores_ = Tensor::empty({batch_, KV}, DType::I64, Device::Cuda);
    device_copy(device_scores_.raw(), Device::Cuda, column_scores_.data(), Device::Cpu,
                device_scores_.nbytes());
    if (skewed) {
      device_skew_ = Tensor::empty({kv_heads_, d, d}, DType::F32, Device::Cuda);
      device_copy(device_skew_.raw(), Device::Cuda, skew_.data(), Device::Cpu,
                  device_skew_.nbytes());
    }
  }
}

void PartialLayer::accumulate(const Tensor& queries, const Tensor& keys,
                              const std::vector<int64_t>& sequences,
                              const std::vector<int32_t>& first_valid, int64_t first_row) {
  const int64_t P = std::ssize(sequences), n = queries.dim(0) / P;
  prompt_rows_ = first_row + n;
  if (dry_run()) return;
  if (device_scores_.defined()) {
    ops::partial_column_scores(queries, keys, device_skew_, heads_, sequences, first_valid,
                               first_row, rule_ == PartialIndexRule::QK, device_scores_);
    return;
  }
  const int64_t d = head_dim_, Q = heads_ * d, KV = kv_heads_ * d;
  const Tensor host_queries = on_host(queries), host_keys = on_host(keys);
  const float* q = host_queries.data<float>();
  const float* k = host_keys.data<float>();
  std::vector<float> skewed_row(static_cast<size_t>(d));
  // Column scores per KV head over the pass's rows that hold tokens: |Q~| of the group's query
  // heads (+ |K~|), in the skewed space, into each sequence's own sums (so that a prompt in
  // several passes adds each sequence's tokens in the order one pass would).
  for (int64_t i = 0; i < P; ++i) {
    double* score = column_scores_.data() + sequences[static_cast<size_t>(i)] * KV;
    const auto add = [&](const float* row, int64_t g) {
      const float* v = row;
      if (!skew_.empty()) {
        const float* a = skew_.data() + g * d * d;
        for (int64_t c = 0; c < d; ++c) {
          float sum = 0.0f;
          for (int64_t j = 0; j < d; ++j) sum += row[j] * a[j * d + c];
          skewed_row[static_cast<size_t>(c)] = sum;
        }
        v = skewed_row.data();
      }
      for (int64_t c = 0; c < d; ++c) score[g * d + c] += std::fabs(v[c]);
    };
    for (int64_t j = std::max<int64_t>(0, first_valid[static_cast<size_t>(i)] - first_row); j < n;
         ++j) {
      for (int64_t h = 0; h < heads_; ++h) add(q + (i * n + j) * Q + h * d, h / group_);
      if (rule_ == PartialIndexRule::QK) {
        for (int64_t g = 0; g < kv_heads_; ++g) add(k + (i * n + j) * KV + g * d, g);
      }
    }
  }
}

void PartialLayer::continue_from_prefixes(const SharedPrefixes& shared) {
  const size_t KV = static_cast<size_t>(kv_heads_ * head_dim_);
  if (column_scores_.empty()) return;  // a dry run
  for (int64_t b = 0; b < shared.batch(); ++b) {
    const int64_t leader = shared.source(b);
    if (shared.prefix_length(b) == 0 || leader == b) continue;
    if (device_scores_.defined()) {
      const size_t row = KV * sizeof(double);
      device_copy(
          static_cast<char*>(device_scores_.raw()) + static_cast<size_t>(b) * row, Device::Cuda,
          static_cast<const char*>(device_scores_.raw()) + static_cast<size_t>(leader) * row,
          Device::Cuda, row);
      continue;
    }
    std::copy_n(column_scores_.begin() + static_cast<std::ptrdiff_t>(leader * KV), KV,
                column_scores_.begin() + static_cast<std::ptrdiff_t>(b * KV));
  }
}

std::vector<double> PartialLayer::column_scores() const {
  std::vector<double> scores = column_scores_;
  if (device_scores_.defined()) {
    device_copy(scores.data(), Device::Cpu, device_scores_.raw(), Device::Cuda,
                device_scores_.nbytes());
  }
  return scores;
}

void PartialLayer::choose_columns(const Tensor& q_weight, const Tensor& q_bias, int64_t capacity,
                                  bool device_keys) {
  const int64_t d = head_dim_, KV = kv_heads_ * d, D = q_weight.dim(1);
  capacity_ = capacity;
  columns_.assign(static_cast<size_t>(kv_heads_ * r_), 0);
  if (traced("partial_build", {batch_, kv_heads_, prompt_rows_, r_, D}, key_dtype_)) {
    for (int64_t g = 0; g < kv_heads_; ++g) {
      std::iota(columns_.begin() + g * r_, columns_.begin() + (g + 1) * r_, 0);
    }
  } else {
    // Kept on the device (accumulate): the B x H_kv * d sums come to the host here, the only
    // read of the prompt's column rule.
    if (device_scores_.defined()) column_scores_ = column_scores();
    // The sums of every sequence, added in order.
    std::vector<double> score(static_cast<size_t>(KV), 0.0);
    for (int64_t b = 0; b < batch_; ++b) {
      for (int64_t c = 0; c < KV; ++c) {
        score[static_cast<size_t>(c)] += column_scores_[static_cast<size_t>(b * KV + c)];
      }
    }
    for (int64_t g = 0; g < kv_heads_; ++g) {
      std::vector<int32_t> order(static_cast<size_t>(d));
      std::iota(order.begin(), order.end(), 0);
      const double* head_score = score.data() + g * d;
      std::stable_sort(order.begin(), order.end(),
                       [&](int32_t a, int32_t c) { return head_score[a] > head_score[c]; });
      std::sort(order.begin(), order.begin() + r_);
      std::copy(order.begin(), order.begin() + r_, columns_.begin() + g * r_);
    }
  }
  column_scores_ = {};
  device_scores_ = {};
  device_skew_ = {};

  derive_needed_rows(!inv_freq_.empty(), !skew_.empty());
  // Partial query weights: the needed rows of W_q (HF layout: rows are output features), in its
  // own dtype, gathered where W_q is (on the CUDA device, W_q never crosses the link), and their
  // biases.
  const int64_t rows = head_rows_.back();
  const bool on_device = q_weight.device() == Device::Cuda && !dry_run();
  weight_ = Tensor::empty({rows, D}, q_weight.dtype(), on_device ? Device::Cuda : Device::Cpu);
  bias_ = Tensor::empty({rows}, DType::F32);
  allocate_query_rows();
  keys_.clear();
  if (dry_run()) return;  // a dry run keeps no partial keys
  const Tensor bq = q_bias.defined() ? q_bias.to(Device::Cpu).to_dtype(DType::F32) : Tensor();
  std::vector<int32_t> sources(static_cast<size_t>(rows));  // the W_q row of each partial row
  for (int64_t h = 0; h < heads_; ++h) {
    const std::vector<int32_t>& dims = needed_[static_cast<size_t>(h / group_)];
    for (size_t j = 0; j < dims.size(); ++j) {
      const int64_t src = h * d + dims[j];
      const int64_t dst = head_rows_[static_cast<size_t>(h)] + static_cast<int64_t>(j);
      sources[static_cast<size_t>(dst)] = static_cast<int32_t>(src);
      bias_.data<float>()[dst] = bq.defined() ? bq.data<float>()[src] : 0.0f;
    }
  }
  if (on_device) {
    ops::gather_rows(q_weight, sources, weight_);
  } else {
    const Tensor w = q_weight.to(Device::Cpu);
    const size_t row_bytes = static_cast<size_t>(D) * dtype_size(w.dtype());
    for (int64_t dst = 0; dst < rows; ++dst) {
      std::memcpy(static_cast<char*>(weight_.raw()) + static_cast<size_t>(dst) * row_bytes,
                  static_cast<const char*>(w.raw()) +
                      static_cast<size_t>(sources[static_cast<size_t>(dst)]) * row_bytes,
                  row_bytes);
    }
  }
  if (!device_keys) {
    keys_.assign(static_cast<size_t>(batch_ * kv_heads_ * capacity_ * r_) * dtype_size(key_dtype_),
                 0);
  }
}

void PartialLayer::write_partial_key(int64_t b, int64_t g, int64_t position, const float* key) {
  thread_local std::vector<float> row;  // called once per prompt token and head: no allocation
  row.resize(static_cast<size_t>(r_));
  partial_of(key, g, row.data());
  write_key(key_offset(b, g, position), row.data());
}

void PartialLayer::derive_needed_rows(bool rotary, bool skewed) {
  const int64_t d = head_dim_;
  needed_.assign(static_cast<size_t>(kv_heads_), {});
  // The query dimensions each KV head's partial queries depend on: every one under a skew, else
  // its columns, with their rotary pairs (c, c +- d/2) when rotated.
  for (int64_t g = 0; g < kv_heads_; ++g) {
    std::vector<char> used(static_cast<size_t>(d), skewed ? 1 : 0);
    for (int64_t j = 0; j < r_ && !skewed; ++j) {
      const int32_t c = columns_[static_cast<size_t>(g * r_ + j)];
      used[static_cast<size_t>(c)] = 1;
      if (rotary) used[static_cast<size_t>((c + d / 2) % d)] = 1;
    }
    for (int32_t c = 0; c < d; ++c) {
      if (used[static_cast<size_t>(c)]) needed_[static_cast<size_t>(g)].push_back(c);
    }
  }
  head_rows_.assign(static_cast<size_t>(heads_ + 1), 0);
  for (int64_t h = 0; h < heads_; ++h) {
    head_rows_[static_cast<size_t>(h + 1)] =
        head_rows_[static_cast<size_t>(h)] + std::ssize(needed_[static_cast<size_t>(h / group_)]);
  }
}

void PartialLayer::partial_of(const float* key, int64_t g, float* out) const {
  const int32_t* cols = columns_.data() + g * r_;
  if (skew_.empty()) {
    for (int64_t j = 0; j < r_; ++j) out[j] = key[cols[j]];
    return;
  }
  const int64_t d = head_dim_;
  const float* a = skew_.data() + g * d * d;
  for (int64_t j = 0; j < r_; ++j) {
    float sum = 0.0f;
    for (int64_t i = 0; i < d; ++i) sum += key[i] * a[i * d + cols[j]];
    out[j] = sum;
  }
}

void PartialLayer::share_prefixes(const SharedPrefixes& shared, bool from_leaders) {
  const int64_t B = shared.batch(), G = shared.num_groups();
  INFINIGEN_CHECK(!shared.empty() && shared.rows() <= capacity_ && batch_ == (from_leaders ? G : B),
                  "speculation: shared prefixes of ", shared.rows(), " positions need a layer ",
                  from_leaders ? "built from the groups' leaders" : "restored for the batch");
  if (from_leaders && !keys_.empty()) {
    // Slot i (group i's leader's prefix) becomes the leader's; the others' slots follow it.
    const size_t slot = static_cast<size_t>(kv_heads_ * capacity_ * r_) * dtype_size(key_dtype_);
    std::vector<char> keys(static_cast<size_t>(B) * slot);
    for (int64_t i = 0; i < G; ++i) {
      std::copy_n(
          keys_.begin() + static_cast<std::ptrdiff_t>(static_cast<size_t>(i) * slot), slot,
          keys.begin() + static_cast<std::ptrdiff_t>(
                             static_cast<size_t>(shared.leaders()[static_cast<size_t>(i)]) * slot));
    }
    keys_ = std::move(keys);
  }
  batch_ = B;
  shared_ = shared;
  allocate_query_rows();
}

void PartialLayer::append(const Tensor& keys, int64_t position,
                          const std::vector<int32_t>* positions) {
  const int64_t KV = kv_heads_ * head_dim_, n = keys.dim(0) / batch_;
  if (traced("partial_append", {batch_ * n, kv_heads_, r_}, key_dtype_)) return;
  INFINIGEN_CHECK(!keys_.empty(), "speculation: this layer's partial keys moved to the device");
  const Tensor host = keys.device() == Device::Cpu ? keys : keys.to(Device::Cpu);
  const float* k = host.data<float>();
  INFINIGEN_CHECK(!positions || n == 1, "partial keys at given positions come one per sequence");
  std::vector<float> row(static_cast<size_t>(r_));
  for (int64_t b = 0; b < batch_; ++b) {
    for (int64_t g = 0; g < kv_heads_; ++g) {
      for (int64_t i = 0; i < n; ++i) {
        const int64_t at =
            positions ? (*positions)[static_cast<size_t>(b * kv_heads_ + g)] : position + i;
        INFINIGEN_CHECK(at >= 0 && at < capacity_, "partial key cache position ", at,
                        " outside its ", capacity_, " positions");
        partial_of(k + (b * n + i) * KV + g * head_dim_, g, row.data());
        write_key(key_offset(b, g, at), row.data());
      }
    }
  }
}

void PartialLayer::allocate_query_rows() {
  query_rows_ = Tensor::empty({batch_, head_rows_.back()}, DType::F32);
}

void PartialLayer::write_key(size_t offset, const float* values) {
  convert_from_f32(values, keys_.data() + offset, key_dtype_, static_cast<size_t>(r_));
}

std::vector<float> PartialLayer::partial_key(int64_t b, int64_t g, int64_t position) const {
  std::vector<float> key(static_cast<size_t>(r_));
  convert_to_f32(keys_.data() + key_offset(b, g, position), key_dtype_, key.data(), key.size());
  return key;
}

void PartialLayer::partial_query(const float* rows, int64_t h, int32_t rope_position,
                                 float* out) const {
  const int64_t d = head_dim_, g = h / group_;
  const std::vector<int32_t>& dims = needed_[static_cast<size_t>(g)];
  // The head's query with only its needed dimensions (zero elsewhere)...
  std::vector<float> q(static_cast<size_t>(d), 0.0f);
  for (size_t j = 0; j < dims.size(); ++j) q[static_cast<size_t>(dims[j])] = rows[j];
  // ... rotated by the model's own RoPE kernel (pairs of needed dimensions are complete) ...
  if (!inv_freq_.empty()) kernels::cpu::rope(q.data(), &rope_position, inv_freq_.data(), 1, 1, d);
  // ... then its partial columns, scaled like the real queries.
  partial_of(q.data(), g, out);
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  for (int64_t j = 0; j < r_; ++j) out[j] *= scale;
}

std::vector<float> PartialLayer::estimate_logits(
    const Tensor& x, const std::vector<int32_t>& rope_positions, int64_t used,
    const std::vector<int32_t>& first_valid, const std::vector<int32_t>* position_tokens) const {
  INFINIGEN_CHECK(x.dim(0) == batch_ && static_cast<int64_t>(first_valid.size()) == batch_ &&
                      used >= 0 && used <= capacity_,
                  "speculation over ", used, " positions of a batch of ", x.dim(0),
                  " does not fit a partial key cache of ", batch_, " x ", capacity_);
  INFINIGEN_CHECK(inv_freq_.empty() || std::ssize(rope_positions) == batch_,
                  "speculation of a rotary model needs the position of every sequence's token");
  // The needed rows of every head's query (B, head_rows_[H]), in query_rows_ on the CPU.
  const int64_t M = head_rows_.back();
  if (x.device() == Device::Cpu) {
    ops::linear(x, weight_, bias_, query_rows_);
  } else {
    // On CUDA the store speculates with its DevicePartialLayer (speculate/device_partial.h);
    // what comes here with a device input (a dry run's replay, a test) is projected on that
    // device and copied back, allocating as it goes.
    Tensor rows = Tensor::empty({batch_, M}, DType::F32, x.device());
    ops::linear(x, weight_.device() == x.device() ? weight_ : weight_.to(x.device()), bias_, rows);
    device_copy(query_rows_.raw(), Device::Cpu, rows.raw(), x.device(), rows.nbytes());
  }
  if (traced("speculate", {batch_, kv_heads_, used, r_, heads_}, key_dtype_)) return {};
  INFINIGEN_CHECK(!keys_.empty(), "speculation: this layer's partial keys moved to the device");
  // The scaled partial query of every head, (B, H, r): made once, read by every chunk below.
  const int64_t H = heads_;
  std::vector<float> queries(static_cast<size_t>(batch_ * H * r_));
  for (int64_t b = 0; b < batch_; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      partial_query(query_rows_.data<float>() + b * M + head_rows_[static_cast<size_t>(h)], h,
                    inv_freq_.empty() ? 0 : rope_positions[static_cast<size_t>(b)],
                    queries.data() + (b * H + h) * r_);
    }
  }
  // (B, H_kv, used): the largest estimated logit over each KV head's query heads, -inf where a
  // position holds no token the sequence attends to. The positions of each (sequence, KV head) are
  // split into chunks of a fixed size, so that a batch of a few long sequences still uses every
  // thread; the split depends on the shapes only and each logit is computed the same way in any
  // chunk, so the result does not depend on the thread count.
  std::vector<float> logits(static_cast<size_t>(batch_ * kv_heads_ * used), -INFINITY);
  const int64_t chunks = (used + kSpeculationChunk - 1) / kSpeculationChunk;
  const bool spread = batch_ * H * used * r_ > kernels::cpu::kParallelWork;
#pragma omp parallel for collapse(3) schedule(static) if (spread)
  for (int64_t b = 0; b < batch_; ++b) {
    for (int64_t g = 0; g < kv_heads_; ++g) {
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t begin = c * kSpeculationChunk;
        score_positions(queries.data() + (b * H + g * group_) * r_, b, g, begin,
                        std::min(used, begin + kSpeculationChunk), first_valid, position_tokens,
                        logits.data() + (b * kv_heads_ + g) * used);
      }
    }
  }
  return logits;
}

void PartialLayer::score_positions(const float* queries, int64_t b, int64_t g, int64_t begin,
                                   int64_t end, const std::vector<int32_t>& first_valid,
                                   const std::vector<int32_t>* position_tokens,
                                   float* logits) const {
  // Each key is widened once (fp16) and dotted with every query head of its group while it is in
  // the first-level cache.
  std::vector<float> widened(key_dtype_ == DType::F32 ? 0 : static_cast<size_t>(r_));
  for (int64_t p = begin; p < end; ++p) {
    const int64_t token =
        position_tokens
            ? (*position_tokens)[static_cast<size_t>((b * kv_heads_ + g) * capacity_ + p)]
            : p;
    if (!holds_token(token, first_valid, b)) continue;  // -inf: padding or empty
    const char* stored = keys_.data() + key_offset(b, g, p);
    const float* key = reinterpret_cast<const float*>(stored);
    if (key_dtype_ != DType::F32) {
      convert_to_f32(stored, key_dtype_, widened.data(), widened.size());
      key = widened.data();
    }
    float best = -INFINITY;
    for (int64_t h = 0; h < group_; ++h) best = std::max(best, lane_dot(queries + h * r_, key, r_));
    logits[p] = best;
  }
}

PartialLayer::Selection PartialLayer::speculate(
    const Tensor& x, const std::vector<int32_t>& rope_positions, int64_t used,
    const std::vector<int32_t>& first_valid, const SpeculationOptions& options,
    const std::vector<int32_t>* position_tokens, const std::vector<int32_t>* replay_take) const {
  std::vector<float> logits =
      estimate_logits(x, rope_positions, used, first_valid, position_tokens);
  if (dry_run()) {
    INFINIGEN_CHECK(replay_take != nullptr,
                    "a dry run of infinigen has no fetched share to replay");
    return replayed(*replay_take, used, first_valid, position_tokens);
  }
  return select(logits, used, options);
}

PartialLayer::Selection PartialLayer::replayed(const std::vector<int32_t>& take, int64_t used,
                                               const std::vector<int32_t>& first_valid,
                                               const std::vector<int32_t>* position_tokens) const {
  const int64_t H = kv_heads_;
  // The valid positions of a row: [first_valid[b], used) when every position holds its own
  // token and nothing is shared, else those whose token is one of the sequence's.
  const bool listed = position_tokens || !shared_.empty();
  const auto valid_positions = [&](int64_t row) {
    const int64_t b = row / H;
    std::vector<int32_t> valid;
    for (int64_t p = 0; p < used; ++p) {
      const int64_t token =
          position_tokens ? (*position_tokens)[static_cast<size_t>(row * capacity_ + p)] : p;
      if (holds_token(token, first_valid, b)) valid.push_back(static_cast<int32_t>(p));
    }
    return valid;
  };
  Selection sel;
  sel.take.resize(static_cast<size_t>(batch_));
  std::vector<std::vector<int32_t>> valid;
  if (listed) {
    for (int64_t row = 0; row < batch_ * H; ++row) valid.push_back(valid_positions(row));
  }
  for (int64_t b = 0; b < batch_; ++b) {
    int64_t fewest = std::max<int64_t>(0, used - first_valid[static_cast<size_t>(b)]);
    if (listed) {
      fewest = used;
      for (int64_t g = 0; g < H; ++g) {
        fewest = std::min<int64_t>(fewest, std::ssize(valid[static_cast<size_t>(b * H + g)]));
      }
    }
    sel.take[static_cast<size_t>(b)] =
        static_cast<int32_t>(std::min<int64_t>(take[static_cast<size_t>(b)], fewest));
    sel.fetch = std::max<int64_t>(sel.fetch, sel.take[static_cast<size_t>(b)]);
    sel.mean_count +=
        static_cast<double>(sel.take[static_cast<size_t>(b)]) / static_cast<double>(batch_);
  }
  sel.fetch = std::max<int64_t>(sel.fetch, 1);
  sel.tokens.assign(static_cast<size_t>(batch_ * H * sel.fetch), 0);
  for (int64_t row = 0; row < batch_ * H; ++row) {
    const int64_t n = sel.take[static_cast<size_t>(row / H)];
    int32_t* out = sel.tokens.data() + row * sel.fetch;
    if (listed) {
      std::copy_n(valid[static_cast<size_t>(row)].begin(), n, out);
    } else {
      std::iota(out, out + n, first_valid[static_cast<size_t>(row / H)]);
    }
  }
  return sel;
}

PartialLayer::Selection PartialLayer::select(const std::vector<float>& logits, int64_t used,
                                             const SpeculationOptions& options) const {
  INFINIGEN_CHECK(options.max_num_kv >= 1, "speculation needs a resolved max_num_kv");
  const int64_t rows = batch_ * kv_heads_;
  // Per row: the alpha count and the valid positions.
  std::vector<int64_t> counts(static_cast<size_t>(rows)), valid(static_cast<size_t>(rows));
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < rows; ++row) {
    const float* s = logits.data() + row * used;
    float top = -INFINITY;
    int64_t n_valid = 0;
    for (int64_t p = 0; p < used; ++p) {
      if (s[p] == -INFINITY) continue;
      top = std::max(top, s[p]);
      ++n_valid;
    }
    int64_t count = 0;
    for (int64_t p = 0; p < used; ++p) count += s[p] > top - options.alpha ? 1 : 0;
    counts[static_cast<size_t>(row)] = count;
    valid[static_cast<size_t>(row)] = n_valid;
  }
  const auto fetch_size = [&](int64_t first_row, int64_t n_rows) {
    const int64_t total = std::accumulate(counts.begin() + first_row,
                                          counts.begin() + first_row + n_rows, int64_t{0});
    const double mean = static_cast<double>(total) / static_cast<double>(n_rows);
    return std::clamp<int64_t>(static_cast<int64_t>(std::floor(mean)), 1, options.max_num_kv);
  };
  Selection sel;
  sel.mean_count = static_cast<double>(std::accumulate(counts.begin(), counts.end(), int64_t{0})) /
                   static_cast<double>(rows);
  const int64_t batch_fetch = fetch_size(0, rows);
  sel.take.resize(static_cast<size_t>(batch_));
  for (int64_t b = 0; b < batch_; ++b) {
    const int64_t wanted =
        options.fetch_rule == FetchRule::Batch ? batch_fetch : fetch_size(b * kv_heads_, kv_heads_);
    // Rows of one sequence hold the same number of valid positions (padding is stored, and
    // evicted, alike in every KV head); the minimum guards the staging layout all the same.
    const int64_t fewest =
        *std::min_element(valid.begin() + b * kv_heads_, valid.begin() + (b + 1) * kv_heads_);
    sel.take[static_cast<size_t>(b)] = static_cast<int32_t>(std::min(wanted, fewest));
    sel.fetch = std::max<int64_t>(sel.fetch, sel.take[static_cast<size_t>(b)]);
  }
  sel.fetch = std::max<int64_t>(sel.fetch, 1);  // the staging keeps a row for every sequence
  sel.tokens.assign(static_cast<size_t>(rows * sel.fetch), 0);
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t take = sel.take[static_cast<size_t>(row / kv_heads_)];
    if (take == 0) continue;
    const float* s = logits.data() + row * used;
    std::vector<int32_t> order;
    order.reserve(static_cast<size_t>(used));
    for (int64_t p = 0; p < used; ++p) {
      if (s[p] != -INFINITY) order.push_back(static_cast<int32_t>(p));
    }
    // Top `take` by estimated logit (ties to the lower position), then in position order, so
    // that selecting everything reproduces full attention's order of summation.
    std::nth_element(order.begin(), order.begin() + (take - 1), order.end(),
                     [&](int32_t a, int32_t c) { return s[a] > s[c] || (s[a] == s[c] && a < c); });
    std::sort(order.begin(), order.begin() + take);
    std::copy_n(order.begin(), take, sel.tokens.begin() + row * sel.fetch);
  }
  return sel;
}

void PartialLayer::set_shape(int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                             int64_t head_dim, int64_t capacity, int64_t r, DType key_dtype) {
  batch_ = batch;
  heads_ = num_heads;
  kv_heads_ = num_kv_heads;
  group_ = num_heads / num_kv_heads;
  head_dim_ = head_dim;
  capacity_ = capacity;
  r_ = r;
  key_dtype_ = key_dtype;
  shared_ = {};
}

std::vector<std::pair<std::string, Tensor>> PartialLayer::state() const {
  // Tensors of a dry run (core/trace.h) have shapes and no memory.
  const bool values = !dry_run();
  Tensor columns = Tensor::empty({kv_heads_, r_}, DType::I32);
  if (values) std::copy(columns_.begin(), columns_.end(), columns.data<int32_t>());
  std::vector<std::pair<std::string, Tensor>> state = {
      {"partial_columns", std::move(columns)},
      {"partial_weight", weight_.device() == Device::Cpu ? weight_ : weight_.to(Device::Cpu)},
      {"partial_bias", bias_}};
  if (!skew_.empty()) {
    Tensor skew = Tensor::empty({kv_heads_, head_dim_, head_dim_}, DType::F32);
    if (values) std::copy(skew_.begin(), skew_.end(), skew.data<float>());
    state.emplace_back("partial_skew", std::move(skew));
  }
  if (!inv_freq_.empty()) {
    Tensor freq = Tensor::empty({head_dim_ / 2}, DType::F32);
    if (values) std::copy(inv_freq_.begin(), inv_freq_.end(), freq.data<float>());
    state.emplace_back("partial_inv_freq", std::move(freq));
  }
  return state;
}

void PartialLayer::restore(const std::vector<std::pair<std::string, Tensor>>& state, int64_t batch,
                           int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                           int64_t capacity, DType key_dtype) {
  const auto find = [&](const char* name) -> const Tensor* {
    for (const auto& [key, tensor] : state) {
      if (key == name) return &tensor;
    }
    return nullptr;
  };
  const Tensor* columns = find("partial_columns");
  const Tensor* weight = find("partial_weight");
  const Tensor* bias = find("partial_bias");
  const Tensor* skew = find("partial_skew");
  const Tensor* freq = find("partial_inv_freq");
  INFINIGEN_CHECK(columns && weight && bias,
                  "speculation state lacks partial_columns, "
                  "partial_weight or partial_bias");
  INFINIGEN_CHECK(columns->dtype() == DType::I32 && columns->rank() == 2 &&
                      columns->dim(0) == num_kv_heads && columns->dim(1) >= 1 &&
                      columns->dim(1) <= head_dim,
                  "speculation state: partial_columns of shape ", shape_string(columns->shape()),
                  " do not fit ", num_kv_heads, " KV heads of ", head_dim);
  set_shape(batch, num_heads, num_kv_heads, head_dim, capacity, columns->dim(1), key_dtype);
  columns_.assign(columns->data<int32_t>(), columns->data<int32_t>() + columns->numel());
  for (int32_t c : columns_) {
    INFINIGEN_CHECK(c >= 0 && c < head_dim, "speculation state: partial column ", c,
                    " outside a head of ", head_dim);
  }
  INFINIGEN_CHECK(!skew || skew->shape() == Shape({num_kv_heads, head_dim, head_dim}),
                  "speculation state: partial_skew does not fit the model");
  INFINIGEN_CHECK(!freq || freq->numel() * 2 == head_dim,
                  "speculation state: partial_inv_freq does not fit the model");
  skew_.assign(skew ? skew->data<float>() : nullptr,
               skew ? skew->data<float>() + skew->numel() : nullptr);
  inv_freq_.assign(freq ? freq->data<float>() : nullptr,
                   freq ? freq->data<float>() + freq->numel() : nullptr);
  derive_needed_rows(freq != nullptr, skew != nullptr);
  INFINIGEN_CHECK(weight->rank() == 2 && weight->dim(0) == head_rows_.back() &&
                      bias->dtype() == DType::F32 && bias->numel() == head_rows_.back(),
                  "speculation state: partial weights of shape ", shape_string(weight->shape()),
                  " do not fit its columns (", head_rows_.back(), " rows)");
  weight_ = *weight;
  bias_ = *bias;
  allocate_query_rows();
  keys_.assign(static_cast<size_t>(batch_ * kv_heads_ * capacity_ * r_) * dtype_size(key_dtype_),
               0);
}

void PartialLayer::restore_shapes(int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                                  int64_t head_dim, int64_t capacity, int64_t r, bool rotary,
                                  int64_t hidden, DType weight_dtype, DType key_dtype) {
  set_shape(batch, num_heads, num_kv_heads, head_dim, capacity, r, key_dtype);
  columns_.assign(static_cast<size_t>(kv_heads_ * r_), 0);
  for (int64_t g = 0; g < kv_heads_; ++g) {
    std::iota(columns_.begin() + g * r_, columns_.begin() + (g + 1) * r_, 0);
  }
  skew_.clear();
  inv_freq_.assign(rotary ? static_cast<size_t>(head_dim / 2) : 0, 0.0f);
  derive_needed_rows(rotary, false);
  weight_ = Tensor::empty({head_rows_.back(), hidden}, weight_dtype);
  bias_ = Tensor::empty({head_rows_.back()}, DType::F32);
  keys_.clear();
  allocate_query_rows();
}

void PartialLayer::keep_sequences(const std::vector<int64_t>& keep,
                                  const std::vector<KvStore::LeaderMove>& moves,
                                  const SharedPrefixes& shared) {
  if (batch_ == 0) return;  // a dense layer: nothing built
  if (!keys_.empty()) {
    Tensor keys = Tensor::view(keys_.data(), {batch_, kv_heads_, capacity_, r_}, key_dtype_,
                               Device::Cpu, nullptr);
    compact_batch(keys, keep, moves);
    keys_.resize(static_cast<size_t>(keys.nbytes()));
  }
  batch_ = std::ssize(keep);
  if (!shared_.empty()) shared_ = shared;
  if (query_rows_.defined()) query_rows_ = query_rows_.slice_rows(0, batch_);
}

}  // namespace infinigen
