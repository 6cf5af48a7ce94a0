// kernels/cuda: the gather kernel, one block per copied piece.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/gather.h"

namespace infinigen::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// Block i copies items i, i + gridDim.x, ...; its threads stride over the item's 16-byte words
// (consecutive threads, consecutive words: each warp reads 512 contiguous bytes), or its bytes
// when the item is not 16-byte aligned.
__global__ void copy_items_kernel(const CopyItem* items, int64_t count) {
  for (int64_t i = blockIdx.x; i < count; i += gridDim.x) {
    const CopyItem item = items[i];
    const auto dst = reinterpret_cast<uintptr_t>(item.dst);
    const auto src = reinterpret_cast<uintptr_t>(item.src);
    if (((dst | src | item.bytes) & 15) == 0) {
      const uint64_t words = item.bytes / 16;
      uint4* to = static_cast<uint4*>(item.dst);
      const uint4* from = static_cast<const uint4*>(item.src);
      for (uint64_t w = threadIdx.x; w < words; w += blockDim.x) to[w] = from[w];
    } else {
      char* to = static_cast<char*>(item.dst);
      const char* from = static_cast<const char*>(item.src);
      for (uint64_t b = threadIdx.x; b < item.bytes; b += blockDim.x) to[b] = from[b];
    }
  }
}

}  // namespace

int copy_items(const CopyItem* items, int64_t count, void* stream) {
  if (count <= 0) return cudaSuccess;
  INFINIGEN_LAUNCH(detail::grid_stride_blocks(count, 1), kThreads, 0, detail::as_stream(stream),
                   copy_items_kernel)
  (items, count);
  return cudaGetLastError();
}

}  // namespace infinigen::kernels::cuda
