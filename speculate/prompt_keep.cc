// speculate: the prompt tokens a capped pool keeps.
#include "speculate/prompt_keep.h"

#include <Eigen/Core>
#include <algorithm>
#include <numeric>

#include "core/error.h"

namespace infinigen {

PromptKeep keep_prompt_tokens(const float* queries, int64_t q_stride, int64_t group,
                              const float* keys, int64_t k_stride, int64_t first, int64_t n,
                              int64_t d, int64_t capacity, double alpha, EvictionPolicy policy) {
  INFINIGEN_CHECK(first >= 0 && first <= n && capacity >= 1 && d >= 1 && group >= 1 &&
                      q_stride >= group * d && k_stride >= d,
                  "keep_prompt_tokens: bad shape");
  const int64_t v = n - first;
  using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using Rows = Eigen::Map<const RowMatrix, 0, Eigen::OuterStride<>>;
  const Rows k(keys + first * k_stride, v, d, Eigen::OuterStride<>(k_stride));

  // Fetch counts and last fetches, a block of query rows at a time (logits (rows, v)); a
  // position's fetches are the union over the group's heads.
  std::vector<int64_t> fetches(static_cast<size_t>(v), 0), last(static_cast<size_t>(v), -1);
  constexpr int64_t kBlock = 256;
  RowMatrix logits;
  std::vector<char> fetched;
  for (int64_t i0 = 0; i0 < v; i0 += kBlock) {
    const int64_t rows = std::min(kBlock, v - i0);
    const int64_t cols = i0 + rows;  // row i sees tokens [0, i]
    fetched.assign(static_cast<size_t>(rows * cols), 0);
    for (int64_t j = 0; j < group; ++j) {
      const Rows q(queries + j * d + (first + i0) * q_stride, rows, d,
                   Eigen::OuterStride<>(q_stride));
      logits.noalias() = q * k.topRows(cols).transpose();
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = i0 + r;
        const float* row = logits.data() + r * cols;
        const float top = *std::max_element(row, row + i + 1);
        for (int64_t t = 0; t <= i; ++t) {
          if (row[t] > top - alpha) fetched[static_cast<size_t>(r * cols + t)] = 1;
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t t = 0; t <= i0 + r; ++t) {
        if (!fetched[static_cast<size_t>(r * cols + t)]) continue;
        ++fetches[static_cast<size_t>(t)];
        last[static_cast<size_t>(t)] = first + i0 + r;
      }
    }
  }

  std::vector<int32_t> kept(static_cast<size_t>(v));
  std::iota(kept.begin(), kept.end(), 0);  // relative to `first`
  if (v > capacity) {
    const int64_t candidates = std::max<int64_t>(1, capacity / 2);
    const int64_t older = v - (capacity - candidates);  // tokens outside the protected half
    // Rank the older tokens, highest first; ties to the newer token.
    const auto score = [&](int32_t t) -> int64_t {
      switch (policy) {
        case EvictionPolicy::Counter:
          return fetches[static_cast<size_t>(t)];
        case EvictionPolicy::Lru:
          return std::max<int64_t>(last[static_cast<size_t>(t)], first + t);
        case EvictionPolicy::Fifo:
          return t;
      }
      return t;
    };
    std::nth_element(kept.begin(), kept.begin() + (candidates - 1), kept.begin() + older,
                     [&](int32_t a, int32_t b) {
                       const int64_t sa = score(a), sb = score(b);
                       return sa > sb || (sa == sb && a > b);
                     });
    std::copy(kept.begin() + older, kept.end(), kept.begin() + candidates);
    kept.resize(static_cast<size_t>(capacity));
    std::sort(kept.begin(), kept.end());
  }
  PromptKeep keep;
  for (int32_t t : kept) {
    keep.tokens.push_back(static_cast<int32_t>(first + t));
    keep.fetches.push_back(fetches[static_cast<size_t>(t)]);
    keep.last_fetch.push_back(last[static_cast<size_t>(t)]);
  }
  return keep;
}

}  // namespace infinigen
