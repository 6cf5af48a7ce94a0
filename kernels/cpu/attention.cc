// kernels/cpu: attention on Eigen, parallel over (sequence, head[, query block]).
#include "kernels/cpu/attention.h"

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/cpu/parallel.h"

namespace infinigen::kernels::cpu {
namespace {

using RowMajor = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Strided = Eigen::Map<const RowMajor, 0, Eigen::OuterStride<>>;
using StridedOut = Eigen::Map<RowMajor, 0, Eigen::OuterStride<>>;

// Query rows per prefill task: bounds the score block to 64 x n floats per thread.
constexpr int64_t kQueryBlock = 64;

// Softmax of each row of `scores` in place (max-subtracted, fp32).
void softmax_rows(RowMajor& scores) {
  for (Eigen::Index r = 0; r < scores.rows(); ++r) {
    auto row = scores.row(r);
    const float top = row.maxCoeff();
    row = (row.array() - top).exp();
    row /= row.sum();
  }
}

// ---- attention over the cache, blocked: the decode steps ----
//
// A decode step (and an extension by a few rows) reads each row of a long context once and does
// little with it, so what it costs is reading the rows. Rows are widened to fp32 a block at a time
// into buffers that stay in L1, all query heads of a KV head are scored against a block at once
// (a KV head's rows are read once, not once per query head), and an online softmax carries each
// query's (max, sum, output) across blocks. When there are few (sequence, KV head) pairs, a long
// sequence's rows are split into parts that threads score apart; the parts' softmaxes are merged
// at the end.

constexpr int64_t kRowBlock = 64;      // rows widened at a time: (64, d) fp32, 32 KB at d = 128
constexpr int64_t kRowsPerPart = 512;  // fewest rows a part of a sequence is worth
constexpr int64_t kTasks = 32;         // (sequence, KV head, part) tasks worth making
// K and V rows of one head widened whole above which they no longer stay in cache: 16 MiB (16K
// rows at d = 128; measured on a 2-core EPYC: below it one product over the widened rows is
// faster for multi-head attention, above it the blocks are).
constexpr int64_t kWidenedBytes = int64_t{16} << 20;

// Where the rows of one (sequence, KV head) are: its shared prefix's rows of the group leader's
// slice, then its own from its first valid one, numbered together from 0.
struct CacheRows {
  const void* keys;
  const void* values;
  Element type;
  size_t shared_base, own_base;  // element offsets of row 0 of each run
  int64_t shared, d;

  // Widens rows [r0, r0 + count) of `cache` (keys or values) into dst (count, d).
  void widen_rows(const void* cache, int64_t r0, int64_t count, float* dst) const {
    const int64_t from_shared = std::clamp<int64_t>(shared - r0, 0, count);
    if (from_shared > 0) {
      widen(cache, type, shared_base + static_cast<size_t>(r0 * d), dst,
            static_cast<size_t>(from_shared * d));
    }
    const int64_t own_r0 = std::max<int64_t>(r0 - shared, 0);
    widen(cache, type, own_base + static_cast<size_t>(own_r0 * d), dst + from_shared * d,
          static_cast<size_t>((count - from_shared) * d));
  }
};

// The online softmax state of a part's queries: per query the running max and sum of
// exponentials, and the output before dividing by the sum.
struct PartState {
  float* max;  // (queries)
  float* sum;  // (queries)
  float* acc;  // (queries, d)
};

// Scores the queries Q (queries, d) against rows [r0, r1) of `rows`; query j sees only rows below
// visible[j] (causal). Updates `state`, which starts at (-inf, 0, 0).
void attend_part(const RowMajor& Q, const CacheRows& rows, const int64_t* visible, int64_t r0,
                 int64_t r1, PartState state) {
  thread_local RowMajor keys, values, scores;
  const int64_t queries = Q.rows(), d = Q.cols();
  Eigen::Map<Eigen::VectorXf> max(state.max, queries), sum(state.sum, queries);
  Eigen::Map<RowMajor> acc(state.acc, queries, d);
  for (int64_t b0 = r0; b0 < r1; b0 += kRowBlock) {
    const int64_t count = std::min(kRowBlock, r1 - b0);
    keys.resize(count, d);
    values.resize(count, d);
    rows.widen_rows(rows.keys, b0, count, keys.data());
    rows.widen_rows(rows.values, b0, count, values.data());
    scores.noalias() = Q * keys.transpose();  // (queries, count)
    for (int64_t j = 0; j < queries; ++j) {
      auto row = scores.row(j);
      const int64_t seen = std::clamp<int64_t>(visible[j] - b0, 0, count);
      if (seen == 0) {  // no row of this block is visible to the query
        row.setZero();
        continue;
      }
      const float top = std::max(max(j), row.head(seen).maxCoeff());
      const float correction = std::exp(max(j) - top);  // 0 on the query's first rows
      row.head(seen) = (row.head(seen).array() - top).exp();
      row.tail(count - seen).setZero();
      sum(j) = sum(j) * correction + row.head(seen).sum();
      acc.row(j) *= correction;
      max(j) = top;
    }
    acc.noalias() += scores * values;
  }
}

}  // namespace

void attention_prefill(const float* q, const float* k, const float* v, float* out, int64_t B,
                       int64_t n, int64_t H, int64_t H_kv, int64_t d, const int32_t* first_valid) {
  const int64_t D = H * d, D_kv = H_kv * d, group = H / H_kv;
  const int64_t n_blocks = (n + kQueryBlock - 1) / kQueryBlock;
  const float neg_inf = -std::numeric_limits<float>::infinity();
#pragma omp parallel if (B * H * n * n * d >= kParallelWork)
  {
    RowMajor scores;
#pragma omp for collapse(3) schedule(dynamic)
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t block = 0; block < n_blocks; ++block) {
          const int64_t start = first_valid[b];
          const int64_t i0 = block * kQueryBlock;
          const int64_t i1 = std::min(n, i0 + kQueryBlock);
          const int64_t offset = b * n * D + h * d;                  // (b, token 0, h, 0)
          const int64_t kv_offset = b * n * D_kv + (h / group) * d;  // its KV head
          StridedOut O(out + offset + i0 * D, i1 - i0, d, Eigen::OuterStride<>(D));
          // Rows that are padding attend to nothing.
          const int64_t q0 = std::max(i0, start);
          if (q0 > i0) O.topRows(std::min(q0, i1) - i0).setZero();
          if (q0 >= i1) continue;
          // Keys [start, i1): everything a query of this block may see.
          const Strided Q(q + offset + q0 * D, i1 - q0, d, Eigen::OuterStride<>(D));
          const Strided K(k + kv_offset + start * D_kv, i1 - start, d, Eigen::OuterStride<>(D_kv));
          const Strided V(v + kv_offset + start * D_kv, i1 - start, d, Eigen::OuterStride<>(D_kv));
          scores.noalias() = Q * K.transpose();
          for (int64_t r = 0; r < i1 - q0; ++r) {  // causal: query q0+r sees keys <= q0+r
            const int64_t visible = q0 + r - start + 1;
            scores.row(r).tail(scores.cols() - visible).setConstant(neg_inf);
          }
          softmax_rows(scores);
          O.bottomRows(i1 - q0).noalias() = scores * V;
        }
      }
    }
  }
}

namespace {

// Many queries per KV head (an extension by many rows): each (sequence, head) widens all its rows
// once and scores them 64 queries at a time.
void attention_over_cache_wide(const float* q, const void* k_cache, const void* v_cache,
                               Element cache_type, float* out, int64_t B, int64_t n, int64_t H,
                               int64_t H_kv, int64_t d, int64_t capacity, int64_t length,
                               const int32_t* first_valid, const int32_t* prefix_begin,
                               const int32_t* prefix_source, int64_t prefix_end) {
  const int64_t group = H / H_kv, D = H * d;
  const float neg_inf = -std::numeric_limits<float>::infinity();
#pragma omp parallel if (B * H * n * length * d >= kParallelWork)
  {
    // Per-thread buffers for the life of the thread: widened rows of a long context are big
    // enough for malloc to map and unmap them at every call, and the page faults then cost more
    // than the attention (decode steps slowed as the context grew).
    thread_local std::vector<float> keys, values;
    thread_local RowMajor scores;
#pragma omp for collapse(2) schedule(static)
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < H; ++h) {
        const int64_t start = first_valid[b];
        // Queries before the sequence's first row are padding: zero. Query i sees the rows up to
        // its own, shared + (length - n + i + 1 - start) of them.
        const int64_t first_query = std::clamp<int64_t>(start - (length - n), 0, n);
        StridedOut O(out + (b * n) * D + h * d, n, d, Eigen::OuterStride<>(D));
        O.topRows(first_query).setZero();
        if (first_query == n) continue;  // every query is padding (a prompt's early chunk)
        const int64_t kv_head = h / group;
        // The prefix's rows of its leader's slice, then the sequence's own rows.
        const int64_t from = prefix_end > 0 ? prefix_begin[b] : 0;
        const int64_t source = prefix_end > 0 ? prefix_source[b] : b;
        const int64_t shared = prefix_end - from;
        const int64_t rows = shared + length - start;
        const size_t shared_base =
            static_cast<size_t>(((source * H_kv + kv_head) * capacity + from) * d);
        const size_t base = static_cast<size_t>(((b * H_kv + kv_head) * capacity + start) * d);
        const size_t shared_size = static_cast<size_t>(shared * d);
        keys.resize(static_cast<size_t>(rows * d));
        values.resize(keys.size());
        widen(k_cache, cache_type, shared_base, keys.data(), shared_size);
        widen(v_cache, cache_type, shared_base, values.data(), shared_size);
        widen(k_cache, cache_type, base, keys.data() + shared_size, keys.size() - shared_size);
        widen(v_cache, cache_type, base, values.data() + shared_size, values.size() - shared_size);
        const Eigen::Map<const RowMajor> K(keys.data(), rows, d), V(values.data(), rows, d);
        for (int64_t i0 = first_query; i0 < n; i0 += kQueryBlock) {
          const int64_t i1 = std::min(n, i0 + kQueryBlock);
          const Strided Q(q + (b * n + i0) * D + h * d, i1 - i0, d, Eigen::OuterStride<>(D));
          scores.noalias() = Q * K.transpose();
          for (int64_t i = i0; i < i1; ++i) {
            const int64_t visible = shared + length - n + i + 1 - start;
            scores.row(i - i0).tail(rows - visible).setConstant(neg_inf);
          }
          softmax_rows(scores);
          O.middleRows(i0, i1 - i0).noalias() = scores * V;
        }
      }
    }
  }
}

// Few queries per KV head (decode steps): blocked, parts of long sequences on several threads.
void attention_over_cache_blocked(const float* q, const void* k_cache, const void* v_cache,
                                  Element cache_type, float* out, int64_t B, int64_t n, int64_t H,
                                  int64_t H_kv, int64_t d, int64_t capacity, int64_t length,
                                  const int32_t* first_valid, const int32_t* prefix_begin,
                                  const int32_t* prefix_source, int64_t prefix_end) {
  const int64_t group = H / H_kv, D = H * d;
  // Queries per (sequence, KV head): row hg * n + i is query i of the group's query head hg.
  const int64_t queries = group * n;
  const bool parallel = B * H * n * length * d >= kParallelWork;
  // Parts per sequence: enough for kTasks (sequence, KV head, part) tasks, each of at least
  // kRowsPerPart rows. A function of the shapes alone, never of the thread count (which adapts
  // to the machine's load): the same inputs always give the same bits.
  const int64_t parts = std::clamp<int64_t>(
      std::min((kTasks + B * H_kv - 1) / (B * H_kv), length / kRowsPerPart), 1, kTasks);
  // Each (sequence, KV head, part)'s softmax state: max (queries), sum (queries), acc (queries, d).
  const int64_t state_floats = queries * (d + 2);
  // The calling thread's buffer: the team's threads reach it through `base` (a thread_local
  // named in the loop would be each thread's own).
  thread_local std::vector<float> states;
  states.resize(static_cast<size_t>(B * H_kv * parts * state_floats));
  float* const base = states.data();
  const auto state_of = [=](int64_t b, int64_t g, int64_t part) {
    float* at = base + ((b * H_kv + g) * parts + part) * state_floats;
    return PartState{at, at + queries, at + 2 * queries};
  };
  const float neg_inf = -std::numeric_limits<float>::infinity();

#pragma omp parallel for collapse(3) schedule(static) if (parallel)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t g = 0; g < H_kv; ++g) {
      for (int64_t part = 0; part < parts; ++part) {
        thread_local RowMajor Q;
        thread_local std::vector<int64_t> visible;
        Q.resize(queries, d);
        visible.resize(static_cast<size_t>(queries));
        const int64_t start = first_valid[b];
        const int64_t from = prefix_end > 0 ? prefix_begin[b] : 0;
        const int64_t source = prefix_end > 0 ? prefix_source[b] : b;
        const int64_t shared = prefix_end - from;
        for (int64_t hg = 0; hg < group; ++hg) {
          for (int64_t i = 0; i < n; ++i) {
            const int64_t j = hg * n + i, own = length - n + i;  // the query's own row
            Q.row(j) =
                Eigen::Map<const Eigen::RowVectorXf>(q + (b * n + i) * D + (g * group + hg) * d, d);
            // A padding query sees nothing, not even the prefix.
            visible[static_cast<size_t>(j)] = own < start ? 0 : shared + own + 1 - start;
          }
        }
        const int64_t rows = visible[static_cast<size_t>(queries - 1)];  // the last query's
        const CacheRows cache{k_cache,
                              v_cache,
                              cache_type,
                              static_cast<size_t>(((source * H_kv + g) * capacity + from) * d),
                              static_cast<size_t>(((b * H_kv + g) * capacity + start) * d),
                              shared,
                              d};
        const PartState state = state_of(b, g, part);
        std::fill_n(state.max, queries, neg_inf);
        std::fill_n(state.sum, queries, 0.0f);
        std::fill_n(state.acc, queries * d, 0.0f);
        attend_part(Q, cache, visible.data(), rows * part / parts, rows * (part + 1) / parts,
                    state);
      }
    }
  }

  // Merge each query's parts: weights exp(max_p - top); a query no part saw (padding) is zero.
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t g = 0; g < H_kv; ++g) {
      for (int64_t j = 0; j < queries; ++j) {
        const int64_t hg = j / n, i = j % n;
        Eigen::Map<Eigen::RowVectorXf> o(out + (b * n + i) * D + (g * group + hg) * d, d);
        float top = neg_inf;
        for (int64_t part = 0; part < parts; ++part)
          top = std::max(top, state_of(b, g, part).max[j]);
        if (top == neg_inf) {
          o.setZero();
          continue;
        }
        float total = 0.0f;
        o.setZero();
        for (int64_t part = 0; part < parts; ++part) {
          const PartState state = state_of(b, g, part);
          if (state.max[j] == neg_inf) continue;
          const float weight = std::exp(state.max[j] - top);
          total += weight * state.sum[j];
          o += weight * Eigen::Map<const Eigen::RowVectorXf>(state.acc + j * d, d);
        }
        o /= total;
      }
    }
  }
}

}  // namespace

void attention_decode(const float* q, const void* k_cache, const void* v_cache, Element cache_type,
                      float* out, int64_t B, int64_t n, int64_t H, int64_t H_kv, int64_t d,
                      int64_t capacity, int64_t length, const int32_t* first_valid,
                      const int32_t* prefix_begin, const int32_t* prefix_source,
                      int64_t prefix_end) {
  // Blocked where it reads less or keeps more threads busy: few queries per KV head, and either a
  // KV head read for several query heads, few (sequence, KV head) pairs to share out, or rows too
  // many to widen whole in cache. Otherwise (multi-head attention over a few thousand rows, many
  // pairs) widening each head's rows whole into one matrix-vector product is faster.
  const bool few_queries = (H / H_kv) * n <= kQueryBlock;
  const bool blocked = few_queries && (H > H_kv || B * H_kv < kTasks ||
                                       2 * length * d * int64_t{sizeof(float)} > kWidenedBytes);
  (blocked ? attention_over_cache_blocked : attention_over_cache_wide)(
      q, k_cache, v_cache, cache_type, out, B, n, H, H_kv, d, capacity, length, first_valid,
      prefix_begin, prefix_source, prefix_end);
}

void cache_store(const float* src, void* cache, Element cache_type, int64_t B, int64_t n, int64_t H,
                 int64_t d, int64_t capacity, int64_t offset) {
#pragma omp parallel for collapse(3) schedule(static) if (B * H * n * d >= kParallelWork)
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t t = 0; t < n; ++t) {
        const float* row = src + ((b * n + t) * H + h) * d;
        narrow(row, cache, cache_type,
               static_cast<size_t>(((b * H + h) * capacity + offset + t) * d),
               static_cast<size_t>(d));
      }
    }
  }
}

}  // namespace infinigen::kernels::cpu
