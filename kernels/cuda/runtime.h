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
int copy(void* dst, const void* src, size_t bytes, int kind);
const char* error_string(int code);

}  // namespace infinigen::kernels::cuda
