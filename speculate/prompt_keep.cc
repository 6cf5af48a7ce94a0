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
  return keep_extension_tokens({}, queries, q_stride, group, keys, k_stride, first, n, d, 0,
                               capacity, alpha, policy);
}

PromptKeep keep_extension_tokens(const HeldEntries& held, const float* queries, int64_t q_stride,
                                 int64_t group, const float* keys, int64_t k_stride, int64_t first,
                                 int64_t n, int64_t d, int64_t position0, int64_t capacity,
                                 double alpha, EvictionPolicy policy) {
  const int64_t m = std::ssize(held.tokens);
  INFINIGEN_CHECK(first >= 0 && first <= n && capacity >= 1 && d >= 1 && group >= 1 &&
                      q_stride >= group * d && k_stride >= d && std::ssize(held.fetches) == m &&
                      std::ssize(held.last_fetch) == m && std::ssize(held.keys) == m * d,
                  "keep_prompt_tokens: bad shape");
  const int64_t v = n - first, all = m + v;
  using RowMatrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using Rows = Eigen::Map<const RowMatrix, 0, Eigen::OuterStride<>>;
  // The candidates' keys (all, d): the held entries' then the pass's, in age order.
  RowMatrix joined;
  if (m > 0) {
    joined.resize(all, d);
    joined.topRows(m) = Eigen::Map<const RowMatrix>(held.keys.data(), m, d);
    joined.bottomRows(v) = Rows(keys + first * k_stride, v, d, Eigen::OuterStride<>(k_stride));
  }
  const Rows k = m > 0 ? Rows(joined.data(), all, d, Eigen::OuterStride<>(d))
                       : Rows(keys + first * k_stride, v, d, Eigen::OuterStride<>(k_stride));
  // Candidate c's token: a held one's, or the pass's row first + c - m.
  const auto token = [&](int64_t c) -> int64_t {
    return c < m ? held.tokens[static_cast<size_t>(c)] : position0 + first + c - m;
  };

  // Fetch counts and last fetches, a block of query rows at a time (logits (rows, cols)); a
  // position's fetches are the union over the group's heads.
  std::vector<int64_t> fetches(held.fetches), last(held.last_fetch);
  fetches.resize(static_cast<size_t>(all), 0);
  last.resize(static_cast<size_t>(all), -1);
  constexpr int64_t kBlock = 256;
  RowMatrix logits;
  std::vector<char> fetched;
  for (int64_t i0 = 0; i0 < v; i0 += kBlock) {
    const int64_t rows = std::min(kBlock, v - i0);
    const int64_t cols = m + i0 + rows;  // row i sees the held entries and tokens [0, i]
    fetched.assign(static_cast<size_t>(rows * cols), 0);
    for (int64_t j = 0; j < group; ++j) {
      const Rows q(queries + j * d + (first + i0) * q_stride, rows, d,
                   Eigen::OuterStride<>(q_stride));
      logits.noalias() = q * k.topRows(cols).transpose();
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t seen = m + i0 + r + 1;
        const float* row = logits.data() + r * cols;
        const float top = *std::max_element(row, row + seen);
        for (int64_t t = 0; t < seen; ++t) {
          if (row[t] > top - alpha) fetched[static_cast<size_t>(r * cols + t)] = 1;
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t t = 0; t < m + i0 + r + 1; ++t) {
        if (!fetched[static_cast<size_t>(r * cols + t)]) continue;
        ++fetches[static_cast<size_t>(t)];
        last[static_cast<size_t>(t)] = position0 + first + i0 + r;
      }
    }
  }

  std::vector<int32_t> kept(static_cast<size_t>(all));
  std::iota(kept.begin(), kept.end(), 0);  // candidate indices, oldest first
  if (all > capacity) {
    const int64_t candidates = std::max<int64_t>(1, capacity / 2);
    const int64_t older = all - (capacity - candidates);  // tokens outside the protected half
    // Rank the older tokens, highest first; ties to the newer token.
    const auto score = [&](int32_t c) -> int64_t {
      switch (policy) {
        case EvictionPolicy::Counter:
          return fetches[static_cast<size_t>(c)];
        case EvictionPolicy::Lru:
          return std::max<int64_t>(last[static_cast<size_t>(c)], token(c));
        case EvictionPolicy::Fifo:
          return c;
      }
      return c;
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
  for (int32_t c : kept) {
    keep.tokens.push_back(static_cast<int32_t>(token(c)));
    keep.fetches.push_back(fetches[static_cast<size_t>(c)]);
    keep.last_fetch.push_back(last[static_cast<size_t>(c)]);
  }
  return keep;
}

}  // namespace infinigen
