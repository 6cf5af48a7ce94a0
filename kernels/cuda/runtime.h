// kernels/cuda: device discovery and raw memory, as plain C++ (no CUDA headers leak out).
//
// Functions return a CUDA error code (0 = success) in the flashinfer style; error_string turns
// one into text. The layer above (core/device.cc) turns failures into exceptions.
#pragma once

#include <cstddef>

namespace infinigen::kernels::cuda {

// Number of usable devices in *count: 0, with success, when no driver is installed or there is
// no GPU. Any other failure (a driver older than this runtime needs, a broken installation) is
// returned as its error code, with the driver's version (e.g. 12040 for 12.4; 0 when unknown)
// in *driver_version and this runtime's in *runtime_version.
int device_count(int* count, int* driver_version, int* runtime_version);

struct DeviceProperties {
  char name[256];
  size_t total_memory_bytes;
  int major;
  int minor;
  int emulated;  // 1 on the emulated device (kernels/cuda/emulation)
};
int device_properties(int index, DeviceProperties* out);

int malloc_device(void** pointer, size_t bytes);
int free_device(void* pointer);
// Page-locked host memory, mapped into the device address space (cudaHostAlloc).
int host_alloc_pinned(void** pointer, size_t bytes);
int free_host_pinned(void* pointer);
// kind: 0 host->device, 1 device->host, 2 device->device.
// A copy ordered after the work already enqueued on `stream` (null: the legacy default stream);
// returns once it is complete.
int copy(void* dst, const void* src, size_t bytes, int kind, void* stream);
// Enqueues the copy on `stream` and returns at once. A host source or destination must be pinned
// (or the copy is synchronous for the host, as CUDA makes pageable copies).
int copy_async(void* dst, const void* src, size_t bytes, int kind, void* stream);

// Streams and events as opaque handles (cudaStream_t, cudaEvent_t).
// A stream that does not synchronise with the legacy default stream (cudaStreamNonBlocking).
int stream_create(void** stream);
int stream_destroy(void* stream);
int stream_synchronize(void* stream);
// Work enqueued on `stream` after this call starts once `event` has completed.
int stream_wait_event(void* stream, void* event);
// An event with timing (for the time between two events).
int event_create(void** event);
int event_destroy(void* event);
int event_record(void* event, void* stream);
// *ready = 1 when every piece of work before the event's record has run, else 0.
int event_query(void* event, int* ready);
int event_synchronize(void* event);
// Milliseconds from `start` to `end`, both complete.
int event_elapsed_ms(void* start, void* end, float* ms);
// fn(data) on a host thread in `stream`'s order (cudaLaunchHostFunc).
int launch_host_func(void* stream, void (*fn)(void* data), void* data);
const char* error_string(int code);

}  // namespace infinigen::kernels::cuda
