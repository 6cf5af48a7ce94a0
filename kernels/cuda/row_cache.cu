// kernels/cuda: InfiniGen's row cache on the device: matching a selection against it, and
// storing the staged selection into it.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/row_cache.h"

namespace infinigen::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// Thread i takes (b, h) = (i / heads, i % heads): a merge of the two ascending lists.
__global__ void match_cached_rows_kernel(CachedRowMatch m) {
  const DeviceSelection sel = m.selection;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= sel.batch * sel.heads) return;
  const int64_t b = i / sel.heads;
  const int32_t take = sel.take[b], held = m.count[b];
  const int32_t* now = sel.positions + i * sel.stride;
  const int32_t* cached = m.cached_positions + i * m.cache_rows;
  int32_t* sources = m.sources + i * sel.stride;
  int32_t hits = 0, c = 0;
  for (int32_t j = 0; j < take; ++j) {
    while (c < held && cached[c] < now[j]) ++c;
    const bool hit = c < held && cached[c] == now[j];
    sources[j] = hit ? c : -1;
    hits += hit ? 1 : 0;
  }
  m.hits[i] = hits;
}

// Lanes in groups of `per_row` (a row's 16-byte words, at most a warp) each copy one row per
// pass: item i is (kind, b, h, j) with j < stride; rows past take[b] are skipped. The first item
// of each (b, h) also copies its positions, and of each b its count.
__global__ void store_cached_rows_kernel(CachedRowStore s) {
  const DeviceSelection sel = s.selection;
  int32_t fetch = 0;
  for (int64_t b = 0; b < sel.batch; ++b) fetch = max(fetch, sel.take[b]);
  const int64_t words = s.row_bytes / 16;
  const int per_row = static_cast<int>(words < detail::kWarpSize ? words : detail::kWarpSize);
  const int lane = static_cast<int>(threadIdx.x) % detail::kWarpSize;
  const int groups_per_warp = detail::kWarpSize / per_row;
  const int group = lane / per_row, member = lane % per_row;
  if (group >= groups_per_warp) return;
  const int64_t warp =
      (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / detail::kWarpSize;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * blockDim.x / detail::kWarpSize;
  const int64_t items = 2 * sel.batch * sel.heads * sel.stride;
  for (int64_t i = warp * groups_per_warp + group; i < items; i += warps * groups_per_warp) {
    const int64_t j = i % sel.stride;
    const int64_t bh = (i / sel.stride) % (sel.batch * sel.heads);
    const bool value = i >= sel.batch * sel.heads * sel.stride;
    const int64_t b = bh / sel.heads;
    const int32_t take = sel.take[b];
    if (!value && member == 0) {
      if (j < take) s.cached_positions[bh * s.cache_rows + j] = sel.positions[bh * sel.stride + j];
      if (j == 0 && bh % sel.heads == 0) s.count[b] = take;
    }
    if (j >= take) continue;
    const char* staging = static_cast<const char*>(value ? s.staged_values : s.staged_keys);
    const uint4* from =
        reinterpret_cast<const uint4*>(staging + (bh * s.rows + fetch - take + j) * s.row_bytes);
    char* cache = static_cast<char*>(value ? s.cached_values : s.cached_keys);
    uint4* to = reinterpret_cast<uint4*>(cache + (bh * s.cache_rows + j) * s.row_bytes);
    for (int64_t w = member; w < words; w += per_row) to[w] = from[w];
  }
}

}  // namespace

int match_cached_rows(const CachedRowMatch& m, void* stream) {
  const DeviceSelection& sel = m.selection;
  const int64_t rows = sel.batch * sel.heads;
  if (rows <= 0) return cudaSuccess;
  INFINIGEN_LAUNCH(detail::grid_stride_blocks(rows, kThreads), kThreads, 0,
                   detail::as_stream(stream), match_cached_rows_kernel)
  (m);
  return cudaGetLastError();
}

int store_cached_rows(const CachedRowStore& s, void* stream) {
  const DeviceSelection& sel = s.selection;
  if (sel.batch <= 0 || sel.heads <= 0 || sel.stride <= 0) return cudaSuccess;
  if (s.row_bytes <= 0 || s.row_bytes % 16 != 0) return cudaErrorInvalidValue;
  // Rows stay on the device: a grid as wide as the rows, not the link-bound gather's.
  const int64_t groups = 2 * sel.batch * sel.heads * sel.stride;
  INFINIGEN_LAUNCH(detail::grid_stride_blocks(groups, kThreads), kThreads, 0,
                   detail::as_stream(stream), store_cached_rows_kernel)
  (s);
  return cudaGetLastError();
}

}  // namespace infinigen::kernels::cuda
