// kernels/cpu: attention on Eigen, parallel over (sequence, head[, query block]).
#include "kernels/cpu/attention.h"

#include <Eigen/Core>
#include <algorithm>
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

void attention_decode(const float* q, const void* k_cache, const void* v_cache, Element cache_type,
                      float* out, int64_t B, int64_t n, int64_t H, int64_t H_kv, int64_t d,
                      int64_t capacity, int64_t length, const int32_t* first_valid,
                      const int32_t* prefix_begin, const int32_t* prefix_source,
                      int64_t prefix_end) {
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
