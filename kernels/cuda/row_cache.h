// kernels/cuda: InfiniGen's row cache on the device (offload/row_cache.h): which selected rows the
// cache holds, and the selection's rows into the cache once they are staged.
#pragma once

#include <cstdint>

#include "kernels/cuda/selection.h"

namespace infinigen::kernels::cuda {

// A selection against the cache: for sequence b and head h, the take[b] ascending pool positions
// of `selection` against the count[b] ascending ones the cache holds,
// cached_positions[(b * heads + h) * cache_rows + c]. sources[(b * heads + h) * stride + j] = the
// cache row c holding position j's row, or -1; hits[b * heads + h] = how many it holds. One
// thread per (b, h) walks both lists (positions never repeat within one).
struct CachedRowMatch {
  DeviceSelection selection;
  const int32_t* cached_positions;  // (batch, heads, cache_rows), device
  const int32_t* count;             // (batch), device
  int64_t cache_rows;
  int32_t* sources;  // (batch, heads, stride), device
  int32_t* hits;     // (batch, heads), device
};
int match_cached_rows(const CachedRowMatch& m, void* stream);

// The staged selection becomes the cache: staging rows [fetch - take[b], fetch) of (b, h) (fetch
// the largest take, found by the kernel) to cache rows [0, take[b]), keys and values, with their
// positions; count[b] = take[b]. take[b] <= cache_rows.
struct CachedRowStore {
  DeviceSelection selection;
  const void* staged_keys;    // (batch, heads, rows, row_bytes), device
  const void* staged_values;  // (batch, heads, rows, row_bytes)
  int64_t rows;
  int64_t row_bytes;          // a multiple of 16
  void* cached_keys;          // (batch, heads, cache_rows, row_bytes), device
  void* cached_values;        // (batch, heads, cache_rows, row_bytes)
  int32_t* cached_positions;  // (batch, heads, cache_rows)
  int32_t* count;             // (batch)
  int64_t cache_rows;
};
int store_cached_rows(const CachedRowStore& s, void* stream);

}  // namespace infinigen::kernels::cuda
