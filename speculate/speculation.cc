// speculate: partial weights, partial key cache and speculation on the CPU.
#include "speculate/speculation.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/ops.h"
#include "core/trace.h"

namespace infinigen {

void SpeculationOptions::validate() const {
  INFINIGEN_CHECK(alpha >= 0 && !std::isnan(alpha), option("alpha"), " must be >= 0, got ", alpha);
  INFINIGEN_CHECK(partial_ratio > 0 && partial_ratio <= 1, option("partial_ratio"),
                  " must be in (0, 1], got ", partial_ratio);
  INFINIGEN_CHECK(partial_key_dtype == DType::F32 || partial_key_dtype == DType::F16,
                  option("partial_key_dtype"), " must be f32 or f16, got ",
                  dtype_name(partial_key_dtype));
  INFINIGEN_CHECK(max_num_kv >= 0, option("max_num_kv"), " must be >= 0 (0: the default cap), got ",
                  max_num_kv);
  INFINIGEN_CHECK(dense_layers >= 1, option("dense_layers"),
                  " must be at least 1 (layer 0 has no previous layer to speculate from), got ",
                  dense_layers);
}

int64_t SpeculationOptions::fetch_cap(int64_t capacity) const {
  return max_num_kv > 0 ? max_num_kv : std::max<int64_t>(1, capacity / 5);
}

void FetchReplay::validate(int64_t num_layers) const {
  INFINIGEN_CHECK(!fraction.empty() || !rows.empty(),
                  "a dry run of infinigen needs the share of tokens it fetches per layer (a "
                  "measured run's), as nothing is speculated without computing");
  for (double f : fraction) {
    INFINIGEN_CHECK(f >= 0 && f <= 1, "fetched share ", f, " is not in [0, 1]");
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
  double share = 0;
  if (static_cast<int64_t>(fraction.size()) == num_layers) {
    share = fraction[static_cast<size_t>(layer)];
  } else {
    // Relative depth among the speculated layers: the measured model's first dense_layers
    // entries are its dense layers (everything loaded), which say nothing about how much a
    // speculated layer fetches.
    const int64_t measured_dense =
        std::min<int64_t>(dense_layers, static_cast<int64_t>(fraction.size()) - 1);
    const int64_t measured = static_cast<int64_t>(fraction.size()) - measured_dense;
    const double depth = (static_cast<double>(layer - dense_layers) + 0.5) /
                         static_cast<double>(num_layers - dense_layers);
    const int64_t at = std::min<int64_t>(
        measured - 1, static_cast<int64_t>(depth * static_cast<double>(measured)));
    share = fraction[static_cast<size_t>(measured_dense + at)];
  }
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

void PartialLayer::build(const Tensor& queries, const Tensor& keys, const Tensor& q_weight,
                         const Tensor& q_bias, const std::vector<int32_t>& first_valid,
                         int64_t num_heads, int64_t capacity, int64_t r, PartialIndexRule rule,
                         const std::vector<int32_t>* position_tokens, DType key_dtype) {
  INFINIGEN_CHECK(key_dtype == DType::F32 || key_dtype == DType::F16, option("partial_key_dtype"),
                  " must be f32 or f16, got ", dtype_name(key_dtype));
  key_dtype_ = key_dtype;
  batch_ = static_cast<int64_t>(first_valid.size());
  heads_ = num_heads;
  const int64_t D = queries.dim(1), n = queries.dim(0) / batch_;
  head_dim_ = D / num_heads;
  capacity_ = capacity;
  r_ = r;
  if (traced("partial_build", {batch_, heads_, queries.dim(0) / batch_, r_, D}, key_dtype_)) {
    columns_.assign(static_cast<size_t>(heads_ * r_), 0);
    for (int64_t h = 0; h < heads_; ++h) {
      std::iota(columns_.begin() + h * r_, columns_.begin() + (h + 1) * r_, 0);
    }
    weight_ = Tensor::empty({heads_ * r_, D}, DType::F32);
    bias_ = Tensor::empty({heads_ * r_}, DType::F32);
    return;  // a dry run keeps no partial keys
  }
  const float* q = queries.data<float>();
  const float* k = keys.data<float>();

  // Column scores per head over every valid prompt token of every sequence.
  std::vector<double> score(static_cast<size_t>(D), 0.0);
  for (int64_t b = 0; b < batch_; ++b) {
    for (int64_t t = first_valid[static_cast<size_t>(b)]; t < n; ++t) {
      const float* qrow = q + (b * n + t) * D;
      const float* krow = k + (b * n + t) * D;
      for (int64_t c = 0; c < D; ++c) {
        score[static_cast<size_t>(c)] += std::fabs(qrow[c]);
        if (rule == PartialIndexRule::QK) score[static_cast<size_t>(c)] += std::fabs(krow[c]);
      }
    }
  }
  columns_.assign(static_cast<size_t>(heads_ * r_), 0);
  for (int64_t h = 0; h < heads_; ++h) {
    std::vector<int32_t> order(static_cast<size_t>(head_dim_));
    std::iota(order.begin(), order.end(), 0);
    const double* head_score = score.data() + h * head_dim_;
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t c) { return head_score[a] > head_score[c]; });
    std::sort(order.begin(), order.begin() + r_);
    std::copy(order.begin(), order.begin() + r_, columns_.begin() + h * r_);
  }

  // Partial query weights: the chosen rows of W_q (HF layout: rows are output features).
  const Tensor w = q_weight.to_dtype(DType::F32);
  const Tensor bq = q_bias.to_dtype(DType::F32);
  weight_ = Tensor::empty({heads_ * r_, D}, DType::F32);
  bias_ = Tensor::empty({heads_ * r_}, DType::F32);
  for (int64_t h = 0; h < heads_; ++h) {
    for (int64_t j = 0; j < r_; ++j) {
      const int64_t row = h * head_dim_ + columns_[static_cast<size_t>(h * r_ + j)];
      std::copy_n(w.data<float>() + row * D, D, weight_.data<float>() + (h * r_ + j) * D);
      bias_.data<float>()[h * r_ + j] = bq.data<float>()[row];
    }
  }

  // Partial key cache of the prompt tokens the pool holds (padding too when every position is
  // its own token; speculation skips it).
  INFINIGEN_CHECK(position_tokens || n <= capacity_, "partial key cache of ", capacity_,
                  " positions cannot hold ", n, " tokens");
  keys_.assign(static_cast<size_t>(batch_ * heads_ * capacity_ * r_) * dtype_size(key_dtype_), 0);
  std::vector<float> row(static_cast<size_t>(r_));
  for (int64_t b = 0; b < batch_; ++b) {
    for (int64_t h = 0; h < heads_; ++h) {
      for (int64_t p = 0; p < (position_tokens ? capacity_ : n); ++p) {
        const int64_t t =
            position_tokens
                ? (*position_tokens)[static_cast<size_t>((b * heads_ + h) * capacity_ + p)]
                : p;
        if (t < 0) continue;
        INFINIGEN_CHECK(t < n, "partial key cache: token ", t, " of a prompt of ", n);
        const float* krow = k + (b * n + t) * D + h * head_dim_;
        for (int64_t j = 0; j < r_; ++j) row[j] = krow[columns_[h * r_ + j]];
        write_key(key_offset(b, h, p), row.data());
      }
    }
  }
}

void PartialLayer::append(const Tensor& keys, int64_t position,
                          const std::vector<int32_t>* positions) {
  if (traced("partial_append", {batch_, heads_, r_}, key_dtype_)) return;
  const float* k = keys.data<float>();
  const int64_t D = heads_ * head_dim_;
  std::vector<float> row(static_cast<size_t>(r_));
  for (int64_t b = 0; b < batch_; ++b) {
    for (int64_t h = 0; h < heads_; ++h) {
      const int64_t at = positions ? (*positions)[static_cast<size_t>(b * heads_ + h)] : position;
      INFINIGEN_CHECK(at >= 0 && at < capacity_, "partial key cache position ", at, " outside its ",
                      capacity_, " positions");
      for (int64_t j = 0; j < r_; ++j) row[j] = k[b * D + h * head_dim_ + columns_[h * r_ + j]];
      write_key(key_offset(b, h, at), row.data());
    }
  }
}

void PartialLayer::write_key(size_t offset, const float* values) {
  convert_from_f32(values, keys_.data() + offset, key_dtype_, static_cast<size_t>(r_));
}

std::vector<float> PartialLayer::partial_key(int64_t b, int64_t h, int64_t position) const {
  std::vector<float> key(static_cast<size_t>(r_));
  convert_to_f32(keys_.data() + key_offset(b, h, position), key_dtype_, key.data(), key.size());
  return key;
}

PartialLayer::Selection PartialLayer::speculate(const Tensor& x, int64_t used,
                                                const std::vector<int32_t>& first_valid,
                                                const SpeculationOptions& options,
                                                const std::vector<int32_t>* position_tokens,
                                                const std::vector<int32_t>* replay_take) const {
  std::vector<float> logits = estimate_logits(x, used, first_valid, position_tokens);
  if (dry_run()) {
    INFINIGEN_CHECK(replay_take != nullptr, "a dry run of infinigen has no fetched share to replay");
    return replayed(*replay_take, used, first_valid, position_tokens);
  }
  return select(logits, used, options);
}

PartialLayer::Selection PartialLayer::replayed(const std::vector<int32_t>& take, int64_t used,
                                               const std::vector<int32_t>& first_valid,
                                               const std::vector<int32_t>* position_tokens) const {
  Selection sel;
  sel.take.resize(static_cast<size_t>(batch_));
  std::vector<std::vector<int32_t>> valid(static_cast<size_t>(batch_ * heads_));
  for (int64_t row = 0; row < batch_ * heads_; ++row) {
    const int64_t b = row / heads_;
    for (int64_t p = 0; p < used; ++p) {
      const int64_t token =
          position_tokens ? (*position_tokens)[static_cast<size_t>(row * capacity_ + p)] : p;
      if (token >= first_valid[static_cast<size_t>(b)]) {
        valid[static_cast<size_t>(row)].push_back(static_cast<int32_t>(p));
      }
    }
  }
  for (int64_t b = 0; b < batch_; ++b) {
    int64_t fewest = used;
    for (int64_t h = 0; h < heads_; ++h) {
      fewest = std::min<int64_t>(fewest, std::ssize(valid[static_cast<size_t>(b * heads_ + h)]));
    }
    sel.take[static_cast<size_t>(b)] =
        static_cast<int32_t>(std::min<int64_t>(take[static_cast<size_t>(b)], fewest));
    sel.fetch = std::max<int64_t>(sel.fetch, sel.take[static_cast<size_t>(b)]);
    sel.mean_count += static_cast<double>(sel.take[static_cast<size_t>(b)]) /
                      static_cast<double>(batch_);
  }
  sel.fetch = std::max<int64_t>(sel.fetch, 1);
  sel.tokens.assign(static_cast<size_t>(batch_ * heads_ * sel.fetch), 0);
  for (int64_t row = 0; row < batch_ * heads_; ++row) {
    std::copy_n(valid[static_cast<size_t>(row)].begin(), sel.take[static_cast<size_t>(row / heads_)],
                sel.tokens.begin() + row * sel.fetch);
  }
  return sel;
}

std::vector<float> PartialLayer::estimate_logits(
    const Tensor& x, int64_t used, const std::vector<int32_t>& first_valid,
    const std::vector<int32_t>* position_tokens) const {
  INFINIGEN_CHECK(x.dim(0) == batch_ && static_cast<int64_t>(first_valid.size()) == batch_ &&
                      used >= 0 && used <= capacity_,
                  "speculation over ", used, " positions of a batch of ", x.dim(0),
                  " does not fit a partial key cache of ", batch_, " x ", capacity_);
  // Partial queries (B, H * r), scaled like the real ones.
  Tensor pq = Tensor::empty({batch_, heads_ * r_}, DType::F32);
  ops::linear(x, weight_, bias_, pq);
  if (traced("speculate", {batch_, heads_, used, r_}, key_dtype_)) return {};
  const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim_));
  std::vector<float> logits(static_cast<size_t>(batch_ * heads_ * used));
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < batch_; ++b) {
    for (int64_t h = 0; h < heads_; ++h) {
      const float* query = pq.data<float>() + (b * heads_ + h) * r_;
      float* s = logits.data() + (b * heads_ + h) * used;
      std::vector<float> widened(key_dtype_ == DType::F32 ? 0 : static_cast<size_t>(r_));
      for (int64_t p = 0; p < used; ++p) {
        const int64_t token =
            position_tokens
                ? (*position_tokens)[static_cast<size_t>((b * heads_ + h) * capacity_ + p)]
                : p;
        if (token < first_valid[static_cast<size_t>(b)]) {
          s[p] = -INFINITY;
          continue;
        }
        const char* stored = keys_.data() + key_offset(b, h, p);
        const float* key = reinterpret_cast<const float*>(stored);
        if (key_dtype_ != DType::F32) {
          convert_to_f32(stored, key_dtype_, widened.data(), widened.size());
          key = widened.data();
        }
        float dot = 0.0f;
        for (int64_t j = 0; j < r_; ++j) dot += query[j] * key[j];
        s[p] = dot * scale;
      }
    }
  }
  return logits;
}

PartialLayer::Selection PartialLayer::select(const std::vector<float>& logits, int64_t used,
                                             const SpeculationOptions& options) const {
  INFINIGEN_CHECK(options.max_num_kv >= 1, "speculation needs a resolved max_num_kv");
  const int64_t rows = batch_ * heads_;
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
        options.fetch_rule == FetchRule::Batch ? batch_fetch : fetch_size(b * heads_, heads_);
    // Rows of one sequence hold the same number of valid positions (padding is stored, and
    // evicted, alike in every head); the minimum guards the staging layout all the same.
    const int64_t fewest =
        *std::min_element(valid.begin() + b * heads_, valid.begin() + (b + 1) * heads_);
    sel.take[static_cast<size_t>(b)] = static_cast<int32_t>(std::min(wanted, fewest));
    sel.fetch = std::max<int64_t>(sel.fetch, sel.take[static_cast<size_t>(b)]);
  }
  sel.fetch = std::max<int64_t>(sel.fetch, 1);  // the staging keeps a row for every sequence
  sel.tokens.assign(static_cast<size_t>(rows * sel.fetch), 0);
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t take = sel.take[static_cast<size_t>(row / heads_)];
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

}  // namespace infinigen
