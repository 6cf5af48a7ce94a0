// kernels/cuda: the gather kernel: many pieces, one launch, a small persistent grid.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/gather.h"

namespace infinigen::kernels::cuda {
namespace {

using detail::kFullMask;
using detail::kWarpSize;

constexpr int kThreads = 512;
constexpr int kUnroll = 4;  // 16-byte words each lane has in flight before it stores

// A warp copies `words` 16-byte words from `from` to `to`, kUnroll words per lane in flight.
__device__ __forceinline__ void copy_words(uint4* to, const uint4* from, uint64_t words, int lane) {
  uint64_t w = lane;
  for (; w + (kUnroll - 1) * kWarpSize < words; w += kUnroll * kWarpSize) {
    uint4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = from[w + u * kWarpSize];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) to[w + u * kWarpSize] = v[u];
  }
  for (; w < words; w += kWarpSize) to[w] = from[w];
}

// Each warp takes `group` (at most 32) consecutive items at a time (lane i reads item i's
// descriptor: one coalesced read, a single trip over the link when the list is in mapped host
// memory), then copies them:
// - when the 32 are aligned and of one size s of at most 512 bytes dividing 512 (KV rows: 256
//   bytes for head_dim 128 in fp16), as one flat run of words, 512 / s items per warp-wide pass
//   and kUnroll passes in flight;
// - otherwise one item after another, the warp striding over its words (or bytes, unaligned).
// Warps stride over the list, so the grid can be much smaller than the list: it occupies only
// `gridDim.x` blocks' worth of multiprocessors, and kernels running beside it keep the rest.
// `group` is smaller than 32 when the list is short (a few hundred chunks of tens of kilobytes:
// int4's codes and scales, h2o's rows), so that every warp of the grid has items to copy.
__global__ void copy_items_kernel(const CopyItem* items, int64_t count, int group) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / kWarpSize;
  for (int64_t base = warp * group; base < count; base += warps * group) {
    const int n = static_cast<int>(count - base < group ? count - base : group);
    CopyItem mine{nullptr, nullptr, 0};
    if (lane < n) mine = items[base + lane];
    const auto dst_bits = reinterpret_cast<unsigned long long>(mine.dst);
    const auto src_bits = reinterpret_cast<unsigned long long>(mine.src);
    const unsigned long long size = mine.bytes;
    const unsigned long long first_size = __shfl_sync(kFullMask, size, 0);
    const bool fits = lane >= n || (size == first_size && ((dst_bits | src_bits) & 15) == 0);
    const bool uniform = __all_sync(kFullMask, fits) && first_size % 16 == 0 && first_size != 0 &&
                         first_size <= 512 && 512 % first_size == 0;
    if (uniform) {
      // Lane l copies word (l % per_item) of item (pass * per_pass + l / per_item).
      const int per_item = static_cast<int>(first_size / 16);
      const int per_pass = kWarpSize / per_item;
      const int slot = lane / per_item, word = lane % per_item;
      const int passes = (n + per_pass - 1) / per_pass;
      for (int pass = 0; pass < passes; pass += kUnroll) {
        uint4 v[kUnroll];
        uint4* to[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int item = (pass + u) * per_pass + slot;
          const int source = item < n ? item : 0;
          const auto d = __shfl_sync(kFullMask, dst_bits, source);
          const auto s = __shfl_sync(kFullMask, src_bits, source);
          to[u] = item < n ? reinterpret_cast<uint4*>(d) + word : nullptr;
          if (to[u] != nullptr) v[u] = reinterpret_cast<const uint4*>(s)[word];
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          if (to[u] != nullptr) *to[u] = v[u];
        }
      }
      continue;
    }
    for (int k = 0; k < n; ++k) {
      const auto d = __shfl_sync(kFullMask, dst_bits, k);
      const auto s = __shfl_sync(kFullMask, src_bits, k);
      const auto bytes = __shfl_sync(kFullMask, size, k);
      if (((d | s | bytes) & 15) == 0) {
        copy_words(reinterpret_cast<uint4*>(d), reinterpret_cast<const uint4*>(s), bytes / 16,
                   lane);
      } else {
        char* to = reinterpret_cast<char*>(d);
        const char* from = reinterpret_cast<const char*>(s);
        for (uint64_t b = lane; b < bytes; b += kWarpSize) to[b] = from[b];
      }
    }
  }
}

// Lanes in groups of `per_row` (a row's 16-byte words, at most a warp) each copy kUnroll rows
// per pass, every load in flight before the first store: item i is (kind, b, h, j) with
// j < stride; rows past take[b], and rows `source` leaves to another launch, are skipped.
__global__ void gather_selected_rows_kernel(SelectedRowGather g, SelectedRowSource source) {
  const DeviceSelection sel = g.selection;
  int32_t fetch = 0;
  for (int64_t b = 0; b < sel.batch; ++b) fetch = max(fetch, sel.take[b]);
  const int64_t words = g.row_bytes / 16;
  const int per_row = static_cast<int>(words < kWarpSize ? words : kWarpSize);
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int groups_per_warp = kWarpSize / per_row;
  const int group = lane / per_row, member = lane % per_row;
  if (group >= groups_per_warp) return;  // lanes left over when per_row does not divide 32
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / kWarpSize;
  const int64_t items = 2 * sel.batch * sel.heads * sel.stride;
  const int64_t step = warps * groups_per_warp;
  // Item i's source and destination rows; null `from` where this launch copies nothing.
  const auto locate = [&](int64_t i, const uint4*& from, uint4*& to) {
    from = nullptr;
    if (i >= items) return;
    const int64_t j = i % sel.stride;
    const int64_t bh = (i / sel.stride) % (sel.batch * sel.heads);
    const bool value = i >= sel.batch * sel.heads * sel.stride;
    const int64_t b = bh / sel.heads, h = bh % sel.heads;
    const int32_t take = sel.take[b];
    if (j >= take) return;
    const int32_t c = g.sources != nullptr ? g.sources[bh * sel.stride + j] : -1;
    if ((c >= 0 && source == SelectedRowSource::Pool) ||
        (c < 0 && source == SelectedRowSource::RowCache)) {
      return;
    }
    if (c >= 0) {  // held by the row cache: a copy on the device
      const char* cache = static_cast<const char*>(value ? g.cached_values : g.cached_keys);
      from = reinterpret_cast<const uint4*>(cache + (bh * g.cache_rows + c) * g.row_bytes);
    } else {
      const int64_t t = sel.positions[bh * sel.stride + j];
      const char* block = static_cast<const char*>(
          (value ? g.value_blocks : g.key_blocks)[b * g.max_blocks + t / g.block_tokens]);
      from = reinterpret_cast<const uint4*>(block + (h * g.block_tokens + t % g.block_tokens) *
                                                        g.row_bytes);
    }
    char* staging = static_cast<char*>(value ? g.staged_values : g.staged_keys);
    to = reinterpret_cast<uint4*>(staging + (bh * g.rows + fetch - take + j) * g.row_bytes);
  };
  for (int64_t first = warp * groups_per_warp + group; first < items; first += kUnroll * step) {
    const uint4* from[kUnroll];
    uint4* to[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) locate(first + u * step, from[u], to[u]);
    for (int64_t w = member; w < words; w += per_row) {
      uint4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (from[u] != nullptr) v[u] = from[u][w];
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (from[u] != nullptr) to[u][w] = v[u];
      }
    }
  }
}

// The default grid. The link, not the GPU, sets how many reads must be in flight: on an H200 with
// PCIe 5 (docs/gpu.md), 8 blocks of 512 threads gathered 256-byte rows at 45 GB/s, as fast as
// 1056 blocks, and slowed a decode layer's GEMMs running beside them by 14% where a grid of
// every multiprocessor slowed them by 48%.
constexpr int kDefaultBlocks = 8;

}  // namespace

int gather_selected_rows(const SelectedRowGather& g, void* stream, int blocks,
                         SelectedRowSource source) {
  const DeviceSelection& sel = g.selection;
  if (sel.batch <= 0 || sel.heads <= 0 || sel.stride <= 0) return cudaSuccess;
  if (g.row_bytes <= 0 || g.row_bytes % 16 != 0) return cudaErrorInvalidValue;
  if (source == SelectedRowSource::RowCache && g.sources == nullptr) return cudaSuccess;
  if (blocks <= 0) {
    // The cache's rows: enough threads for every row's words, kUnroll rows a thread.
    const int64_t items = 2 * sel.batch * sel.heads * sel.stride;
    const int64_t words = g.row_bytes / 16;
    blocks = source == SelectedRowSource::RowCache
                 ? static_cast<int>(detail::grid_stride_blocks(
                       (items * (words < kWarpSize ? words : kWarpSize) + kUnroll - 1) / kUnroll,
                       kThreads))
                 : kDefaultBlocks;
  }
  INFINIGEN_LAUNCH(static_cast<unsigned>(blocks), kThreads, 0, detail::as_stream(stream),
                   gather_selected_rows_kernel)
  (g, source);
  return cudaGetLastError();
}

int copy_items(const CopyItem* items, int64_t count, void* stream, int blocks) {
  if (count <= 0) return cudaSuccess;
  if (blocks <= 0) blocks = kDefaultBlocks;
  // At least one item per warp; then as many per warp as the grid needs, up to 32.
  constexpr int64_t kWarpsPerBlock = kThreads / kWarpSize;
  const int64_t needed = (count + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const int64_t grid = needed < blocks ? needed : blocks;
  const int64_t per_warp = (count + grid * kWarpsPerBlock - 1) / (grid * kWarpsPerBlock);
  const int group = static_cast<int>(per_warp < kWarpSize ? per_warp : kWarpSize);
  INFINIGEN_LAUNCH(static_cast<unsigned>(grid), kThreads, 0, detail::as_stream(stream),
                   copy_items_kernel)
  (items, count, group);
  return cudaGetLastError();
}

}  // namespace infinigen::kernels::cuda
