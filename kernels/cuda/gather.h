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
// pinned) with one kernel on `stream`, a block of threads per item, 16 bytes per thread and step
// when an item's addresses and size allow it. Items must not overlap.
int copy_items(const CopyItem* items, int64_t count, void* stream);

}  // namespace infinigen::kernels::cuda
