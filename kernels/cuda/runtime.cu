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

namespace {

cudaMemcpyKind copy_kind(int kind) {
  const cudaMemcpyKind kinds[] = {cudaMemcpyHostToDevice, cudaMemcpyDeviceToHost,
                                  cudaMemcpyDeviceToDevice};
  return kinds[kind];
}

}  // namespace

int copy(void* dst, const void* src, size_t bytes, int kind, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  if (const cudaError_t status = cudaMemcpyAsync(dst, src, bytes, copy_kind(kind), s);
      status != cudaSuccess) {
    return status;
  }
  return cudaStreamSynchronize(s);
}

int copy_async(void* dst, const void* src, size_t bytes, int kind, void* stream) {
  return cudaMemcpyAsync(dst, src, bytes, copy_kind(kind), static_cast<cudaStream_t>(stream));
}

int stream_create(void** stream) {
  cudaStream_t created = nullptr;
  const cudaError_t status = cudaStreamCreateWithFlags(&created, cudaStreamNonBlocking);
  *stream = created;
  return status;
}

int stream_destroy(void* stream) {
  return cudaStreamDestroy(static_cast<cudaStream_t>(stream));
}

int stream_synchronize(void* stream) {
  return cudaStreamSynchronize(static_cast<cudaStream_t>(stream));
}

int stream_wait_event(void* stream, void* event) {
  return cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), static_cast<cudaEvent_t>(event),
                             0);
}

int event_create(void** event) {
  cudaEvent_t created = nullptr;
  const cudaError_t status = cudaEventCreate(&created);
  *event = created;
  return status;
}

int event_destroy(void* event) {
  return cudaEventDestroy(static_cast<cudaEvent_t>(event));
}

int event_record(void* event, void* stream) {
  return cudaEventRecord(static_cast<cudaEvent_t>(event), static_cast<cudaStream_t>(stream));
}

int event_query(void* event, int* ready) {
  const cudaError_t status = cudaEventQuery(static_cast<cudaEvent_t>(event));
  *ready = status == cudaSuccess ? 1 : 0;
  return status == cudaErrorNotReady ? cudaSuccess : status;
}

int event_synchronize(void* event) {
  return cudaEventSynchronize(static_cast<cudaEvent_t>(event));
}

int event_elapsed_ms(void* start, void* end, float* ms) {
  return cudaEventElapsedTime(ms, static_cast<cudaEvent_t>(start), static_cast<cudaEvent_t>(end));
}

int launch_host_func(void* stream, void (*fn)(void* data), void* data) {
  return cudaLaunchHostFunc(static_cast<cudaStream_t>(stream), fn, data);
}

const char* error_string(int code) {
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

}  // namespace infinigen::kernels::cuda
