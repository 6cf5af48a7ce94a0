// core: CUDA streams, events and async copies for core/stream.h and the transfer engine, as
// opaque handles (a cudaStream_t or cudaEvent_t as void*). Failures throw the engine's one-line
// Error naming the call. Defined by cuda_stream.cc when the CUDA backend is compiled; without it
// by cuda_stream_none.cc, whose functions throw "CUDA backend not compiled" (nothing asks for a
// CUDA stream in such a build unless a user asks for --device cuda, which is refused earlier).
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/copy_chunk.h"
#include "core/device.h"

namespace infinigen::cuda_stream {

// A stream that does not synchronise with CUDA's legacy default stream.
void* create_stream();
void destroy_stream(void* stream) noexcept;  // after the work enqueued on it has run
void synchronize(void* stream);
// Work enqueued on `stream` after this call starts once `event` has completed (the host does not
// wait).
void wait(void* stream, void* event);

// Events come from a pool and go back to it: recording one per transfer creates none in the
// steady state.
void* acquire_event();
void release_event(void* event) noexcept;
void record(void* event, void* stream);
bool ready(void* event);
void synchronize_event(void* event);
// Seconds from `start` to `end`, both complete.
double elapsed_seconds(void* start, void* end);

// Enqueues a copy of `bytes` on `stream` (host memory must be pinned for it to be asynchronous).
void copy_async(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes,
                void* stream);

// Runs fn(data) on a host thread once the work enqueued on `stream` before it has run; later
// work waits for it (cudaLaunchHostFunc). fn must not call CUDA.
void host_func(void* stream, void (*fn)(void* data), void* data);

// Throws the engine's one-line Error, "CUDA <what> failed: <the code's text>", when `code` (a
// cudaError_t, as kernels/cuda functions return) is not 0.
void check(int code, const char* what);

// Copies the `count` pieces listed at `pieces` (device-readable memory: device or mapped pinned)
// with one kernel on `stream`; a piece's source or destination may be mapped pinned host memory.
void copy_pieces(const CopyChunk* pieces, size_t count, void* stream);

// A selection on the device: kernels/cuda/selection.h's DeviceSelection, field for field.
struct DeviceSelection {
  const int32_t* positions;  // (batch, heads, stride), device
  const int32_t* take;       // (batch), device
  int64_t batch, heads, stride;
};

// The rows a selection on the device picked from a paged pool, gathered into a compact staging
// with one kernel on `stream`: kernels/cuda/gather.h's SelectedRowGather (every field below is
// its field of the same name, documented there).
struct SelectedRows {
  DeviceSelection selection;
  const void* const* key_blocks;    // (batch, max_blocks), device-readable
  const void* const* value_blocks;  // (batch, max_blocks)
  int64_t max_blocks, block_tokens;
  void* staged_keys;    // (batch, heads, rows, row_bytes), device
  void* staged_values;  // (batch, heads, rows, row_bytes)
  int64_t rows, row_bytes;
  // Optional: InfiniGen's row cache, the rows copied from it (null sources: none), by a launch of
  // their own as wide as they are; the pool's rows by the link's few blocks after it.
  const int32_t* sources = nullptr;  // (batch, heads, stride), device
  const void* cached_keys = nullptr;
  const void* cached_values = nullptr;
  int64_t cache_rows = 0;
};
void gather_selected_rows(const SelectedRows& rows, void* stream);

// InfiniGen's row cache on the device (kernels/cuda/row_cache.h, fields of the same names): which
// of a selection's rows the cache holds, with one kernel on `stream`; and the staged selection
// stored into the cache.
struct CachedRows {
  DeviceSelection selection;
  void* cached_keys;          // (batch, heads, cache_rows, row_bytes), device
  void* cached_values;        // (batch, heads, cache_rows, row_bytes)
  int32_t* cached_positions;  // (batch, heads, cache_rows)
  int32_t* count;             // (batch)
  int64_t cache_rows;
};
void match_cached_rows(const CachedRows& cache, int32_t* sources, int32_t* hits, void* stream);
void store_cached_rows(const CachedRows& cache, const void* staged_keys, const void* staged_values,
                       int64_t rows, int64_t row_bytes, void* stream);

}  // namespace infinigen::cuda_stream
