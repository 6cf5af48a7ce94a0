// kernels/cuda: device discovery and raw memory on the CUDA runtime.
#include <cuda_runtime.h>

#include <cstring>

#include "kernels/cuda/runtime.h"

namespace infinigen::kernels::cuda {

int device_count(int* count, int* driver_version, int* runtime_version) {
  *count = 0;
  *driver_version = 0;
  *runtime_version = 0;
  cudaDriverGetVersion(driver_version);  // 0 when no driver is installed
  cudaRuntimeGetVersion(runtime_version);
  const cudaError_t status = cudaGetDeviceCount(count);
  if (status == cudaSuccess) return 0;
  cudaGetLastError();  // clear the sticky error
  *count = 0;
  // No GPU, or no driver at all (the runtime then reports an insufficient driver of version 0):
  // a machine without CUDA, not a failure.
  if (status == cudaErrorNoDevice) return 0;
  if (status == cudaErrorInsufficientDriver && *driver_version == 0) return 0;
  return status;
}

int device_properties(int index, DeviceProperties* out) {
  cudaDeviceProp prop;
  const cudaError_t status = cudaGetDeviceProperties(&prop, index);
  if (status != cudaSuccess) return status;
  std::strncpy(out->name, prop.name, sizeof(out->name) - 1);
  out->name[sizeof(out->name) - 1] = '\0';
  out->total_memory_bytes = prop.totalGlobalMem;
  out->major = prop.major;
  out->minor = prop.minor;
#ifdef INFINIGEN_CUDA_EMULATION
  out->emulated = 1;
#else
  out->emulated = 0;
#endif
  return cudaSuccess;
}

int malloc_device(void** pointer, size_t bytes) {
  return cudaMalloc(pointer, bytes);
}

int free_device(void* pointer) {
  return cudaFree(pointer);
}

int host_alloc_pinned(void** pointer, size_t bytes) {
  // Mapped so that a kernel can gather rows straight from host memory; portable so that every
  // device sees it as pinned.
  return cudaHostAlloc(pointer, bytes, cudaHostAllocMapped | cudaHostAllocPortable);
}

int free_host_pinned(void* pointer) {
  return cudaFreeHost(pointer);
}

int copy(void* dst, const void* src, size_t bytes, int kind) {
  const cudaMemcpyKind kinds[] = {cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost,
                                  cudaMemcpyDeviceToDevice};
  return cudaMemcpy(dst, src, bytes, kinds[kind]);
}

const char* error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

}  // namespace infinigen::kernels::cuda
