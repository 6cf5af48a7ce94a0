// kernels/cuda: many small copies in one launch, the gathers of the KV loads and stores.
#pragma once

#include <cstdint>

#include "kernels/cuda/selection.h"

namespace infinigen::kernels::cuda {

// One piece of a gather: `bytes` from `src` to `dst`. Either side may be device memory or mapped
// pinned host memory (cudaHostAllocMapped: its host address is valid on the device), which the
// kernel then reads or writes over the link.
struct CopyItem {
  void* dst;
  const void* src;
  uint64_t bytes;
};

// Copies every item of `items` (count of them, in device-readable memory: device or mapped
// pinned) with one kernel on `stream`: a warp per item (half or less of one for rows of 256 bytes
// and less), 16 bytes per lane when an item's addresses and size allow it. Items must not
// overlap. The grid is `blocks` blocks (0: the default, 8), whatever `count`: a gather beside
// the layer's compute leaves it most of the device.
int copy_items(const CopyItem* items, int64_t count, void* stream, int blocks = 0);

// The rows a selection picked, read from a paged pool straight into a compact staging, with the
// selection on the device (InfiniGen's loads: the indices never visit the host). For sequence b
// and head h, the take[b] pool positions of `selection` land in staging rows [fetch - take[b],
// fetch) of (b, h), in order, where fetch is the largest take (the kernel finds it: the host need
// not know it). Pool position t of (b, h) is row (h, t % block_tokens) of block t / block_tokens of
// sequence b: tables[b * max_blocks + i] is the address of sequence b's logical block i, (heads,
// block_tokens, row bytes), null where nothing is stored (never selected). Keys and values are
// gathered alike.
struct SelectedRowGather {
  DeviceSelection selection;
  const void* const* key_blocks;    // (batch, max_blocks): device-readable (device or mapped)
  const void* const* value_blocks;  // (batch, max_blocks)
  int64_t max_blocks;
  int64_t block_tokens;
  void* staged_keys;    // (batch, heads, rows, row_bytes) on the device
  void* staged_values;  // (batch, heads, rows, row_bytes)
  int64_t rows;         // staging rows per (b, h): at least the largest take
  int64_t row_bytes;    // a multiple of 16
  // Optional, InfiniGen's row cache (kernels/cuda/row_cache.h; null sources: none): a position
  // with sources[(b * heads + h) * stride + j] = c >= 0 is copied from cache row c of (b, h),
  // (batch, heads, cache_rows, row_bytes) on the device, instead of read from the pool.
  const int32_t* sources = nullptr;  // (batch, heads, stride), device
  const void* cached_keys = nullptr;
  const void* cached_values = nullptr;
  int64_t cache_rows = 0;
};

// Which of a selection's rows a launch copies. The rows of the pool cross the link, which a few
// blocks keep busy (more would only take multiprocessors from the compute beside them); the rows
// of the row cache stay on the device, where a few blocks would copy them at a small share of
// the device's bandwidth (on an H100, 8 blocks copying cached rows made InfiniGen's loads take
// 1.2 ms a layer for 5.6 MB over the link: docs/gpu.md).
enum class SelectedRowSource : int32_t { Any, Pool, RowCache };

// The rows of `g` that `source` names, with one kernel on `stream`, on `blocks` blocks (0: the
// default: as copy_items for the pool's rows, one block per 512 rows of the cache's).
int gather_selected_rows(const SelectedRowGather& g, void* stream, int blocks = 0,
                         SelectedRowSource source = SelectedRowSource::Any);

}  // namespace infinigen::kernels::cuda
