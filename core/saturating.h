// core: byte counts that saturate instead of wrapping, for plans of sizes a user typed (a batch
// of 10^9 must be refused as too large, not wrap round to something that fits).
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <limits>

namespace infinigen {

inline constexpr size_t kSaturatedBytes = std::numeric_limits<size_t>::max();

// The product of `factors`, or kSaturatedBytes when it does not fit in size_t. Negative factors
// are a caller's bug and count as zero.
inline size_t saturating_product(std::initializer_list<int64_t> factors) {
  size_t product = 1;
  for (int64_t factor : factors) {
    const size_t f = factor > 0 ? static_cast<size_t>(factor) : 0;
    if (__builtin_mul_overflow(product, f, &product)) return kSaturatedBytes;
  }
  return product;
}

// The sum of `terms`, or kSaturatedBytes when it does not fit in size_t.
inline size_t saturating_sum(std::initializer_list<size_t> terms) {
  size_t sum = 0;
  for (size_t term : terms) {
    if (__builtin_add_overflow(sum, term, &sum)) return kSaturatedBytes;
  }
  return sum;
}

}  // namespace infinigen
