// kernels/cuda: many small copies in one launch, the gathers of the KV loads and stores.
#pragma once

#include <cstdint>

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

}  // namespace infinigen::kernels::cuda
