// core: CUDA streams, events and async copies on the kernels/cuda runtime wrappers.
#include "core/cuda_stream.h"

#include <cstddef>
#include <mutex>
#include <vector>

#include "core/error.h"
#include "kernels/cuda/gather.h"
#include "kernels/cuda/row_cache.h"
#include "kernels/cuda/runtime.h"

namespace infinigen::cuda_stream {
namespace {

namespace runtime = kernels::cuda;

static_assert(sizeof(CopyChunk) == sizeof(kernels::cuda::CopyItem) &&
                  offsetof(CopyChunk, dst) == offsetof(kernels::cuda::CopyItem, dst) &&
                  offsetof(CopyChunk, src) == offsetof(kernels::cuda::CopyItem, src) &&
                  offsetof(CopyChunk, bytes) == offsetof(kernels::cuda::CopyItem, bytes),
              "a gather list of CopyChunks is read by the gather kernel as CopyItems");

kernels::cuda::DeviceSelection kernel_selection(const DeviceSelection& s) {
  return {s.positions, s.take, s.batch, s.heads, s.stride};
}

// Events no Event holds now, for reuse. Never destroyed: events released during static
// destruction still find it.
struct EventPool {
  std::mutex mutex;
  std::vector<void*> free;
};
EventPool& event_pool() {
  static auto* pool = new EventPool;
  return *pool;
}

}  // namespace

void check(int code, const char* what) {
  if (code != 0) fail("CUDA ", what, " failed: ", runtime::error_string(code));
}

void* create_stream() {
  void* stream = nullptr;
  check(runtime::stream_create(&stream), "stream creation");
  return stream;
}

void destroy_stream(void* stream) noexcept {
  runtime::stream_synchronize(stream);  // nothing to report: the owner synchronised already
  runtime::stream_destroy(stream);
}

void synchronize(void* stream) {
  check(runtime::stream_synchronize(stream), "stream synchronisation");
}

void wait(void* stream, void* event) {
  check(runtime::stream_wait_event(stream, event), "stream wait on an event");
}

void* acquire_event() {
  EventPool& pool = event_pool();
  {
    std::lock_guard lock(pool.mutex);
    if (!pool.free.empty()) {
      void* event = pool.free.back();
      pool.free.pop_back();
      return event;
    }
  }
  void* event = nullptr;
  check(runtime::event_create(&event), "event creation");
  return event;
}

void release_event(void* event) noexcept {
  EventPool& pool = event_pool();
  try {
    std::lock_guard lock(pool.mutex);
    pool.free.push_back(event);
  } catch (...) {
    runtime::event_destroy(event);
  }
}

void record(void* event, void* stream) {
  check(runtime::event_record(event, stream), "event record");
}

bool ready(void* event) {
  int done = 0;
  check(runtime::event_query(event, &done), "event query");
  return done != 0;
}

void synchronize_event(void* event) {
  check(runtime::event_synchronize(event), "event synchronisation");
}

double elapsed_seconds(void* start, void* end) {
  float ms = 0.0f;
  check(runtime::event_elapsed_ms(start, end, &ms), "event timing");
  return static_cast<double>(ms) * 1e-3;
}

void copy_async(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes,
                void* stream) {
  INFINIGEN_CHECK(dst_device == Device::Cuda || src_device == Device::Cuda,
                  "an asynchronous CUDA copy between two host buffers");
  const int kind = src_device == Device::Cpu ? 0 : dst_device == Device::Cpu ? 1 : 2;
  check(runtime::copy_async(dst, src, bytes, kind, stream), "asynchronous copy");
}

void host_func(void* stream, void (*fn)(void* data), void* data) {
  check(runtime::launch_host_func(stream, fn, data), "host function launch");
}

void copy_pieces(const CopyChunk* pieces, size_t count, void* stream) {
  check(kernels::cuda::copy_items(reinterpret_cast<const kernels::cuda::CopyItem*>(pieces),
                                  static_cast<int64_t>(count), stream),
        "gather kernel");
}

void gather_selected_rows(const SelectedRows& r, void* stream) {
  const kernels::cuda::SelectedRowGather g{kernel_selection(r.selection),
                                           r.key_blocks,
                                           r.value_blocks,
                                           r.max_blocks,
                                           r.block_tokens,
                                           r.staged_keys,
                                           r.staged_values,
                                           r.rows,
                                           r.row_bytes,
                                           r.sources,
                                           r.cached_keys,
                                           r.cached_values,
                                           r.cache_rows};
  if (g.sources == nullptr) {
    check(kernels::cuda::gather_selected_rows(g, stream), "selected-row gather kernel");
    return;
  }
  // The row cache's rows by a grid as wide as them, then the pool's by the link's few blocks.
  using kernels::cuda::SelectedRowSource;
  check(kernels::cuda::gather_selected_rows(g, stream, 0, SelectedRowSource::RowCache),
        "selected-row gather kernel (row cache)");
  check(kernels::cuda::gather_selected_rows(g, stream, 0, SelectedRowSource::Pool),
        "selected-row gather kernel");
}

void match_cached_rows(const CachedRows& c, int32_t* sources, int32_t* hits, void* stream) {
  const kernels::cuda::CachedRowMatch m{
      kernel_selection(c.selection), c.cached_positions, c.count, c.cache_rows, sources, hits};
  check(kernels::cuda::match_cached_rows(m, stream), "row cache match kernel");
}

void store_cached_rows(const CachedRows& c, const void* staged_keys, const void* staged_values,
                       int64_t rows, int64_t row_bytes, void* stream) {
  const kernels::cuda::CachedRowStore s{kernel_selection(c.selection),
                                        staged_keys,
                                        staged_values,
                                        rows,
                                        row_bytes,
                                        c.cached_keys,
                                        c.cached_values,
                                        c.cached_positions,
                                        c.count,
                                        c.cache_rows};
  check(kernels::cuda::store_cached_rows(s, stream), "row cache store kernel");
}

}  // namespace infinigen::cuda_stream
