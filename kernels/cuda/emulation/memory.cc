// kernels/cuda/emulation: memory. Device allocations and pinned host allocations live in host
// memory but are kept in a registry, apart from memory the device does not know, so that a
// kernel argument, a copy or a cuBLAS matrix in the wrong kind of memory is an error naming the
// call, as it would be (or worse) on a GPU. Fresh device memory is poisoned with NaN (all bits
// set) unless INFINIGEN_CUDA_EMULATION_POISON=0, so that reading what nobody wrote shows.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <shared_mutex>
#include <string>

#include "kernels/cuda/emulation/device_state.h"

namespace infinigen::cuda_emulation {
namespace {

constexpr size_t kAlignment = 256;  // cudaMalloc's guarantee

struct Registry {
  mutable std::shared_mutex mutex;
  std::map<uintptr_t, Allocation> allocations;  // by first byte
  size_t device_bytes = 0;
};
Registry& registry() {
  static auto* state = new Registry;  // never destroyed: frees may come during static destruction
  return *state;
}

const char* kind_name(MemoryKind kind) {
  return kind == MemoryKind::Device ? "device memory" : "pinned host memory";
}

std::optional<Allocation> find_locked(const Registry& r, uintptr_t address) {
  auto it = r.allocations.upper_bound(address);
  if (it == r.allocations.begin()) return std::nullopt;
  --it;
  const Allocation& a = it->second;
  if (address < a.begin + a.bytes || address == a.begin) return a;
  return std::nullopt;
}

void* allocate_aligned(size_t bytes) {
  return std::aligned_alloc(kAlignment, (bytes + kAlignment - 1) / kAlignment * kAlignment);
}

// Registers a fresh device allocation of `bytes` at *pointer, within the device's capacity.
cudaError_t allocate_device(void** pointer, size_t bytes, const char* call) {
  if (pointer == nullptr) return fail(cudaErrorInvalidValue, std::string(call) + ": null pointer");
  *pointer = nullptr;
  if (const cudaError_t s = sticky_error(); s != cudaSuccess) return s;
  if (bytes == 0) return cudaSuccess;
  Registry& r = registry();
  {
    std::unique_lock lock(r.mutex);
    if (bytes > device_memory_bytes() - r.device_bytes) {
      return fail(cudaErrorMemoryAllocation,
                  std::string(call) + " of " + std::to_string(bytes) +
                      " bytes: " + std::to_string(device_memory_bytes() - r.device_bytes) + " of " +
                      std::to_string(device_memory_bytes()) +
                      " bytes free (INFINIGEN_CUDA_EMULATION_MEMORY sets the size)");
    }
    r.device_bytes += bytes;
  }
  void* memory = allocate_aligned(bytes);
  if (memory == nullptr) {
    std::unique_lock lock(r.mutex);
    r.device_bytes -= bytes;
    return fail(cudaErrorMemoryAllocation, std::string(call) + ": host allocation failed");
  }
  if (poison_enabled()) std::memset(memory, 0xff, bytes);
  std::unique_lock lock(r.mutex);
  r.allocations[reinterpret_cast<uintptr_t>(memory)] =
      Allocation{reinterpret_cast<uintptr_t>(memory), bytes, MemoryKind::Device, false};
  *pointer = memory;
  return cudaSuccess;
}

// Removes the allocation that starts at `pointer` if it is of `kind`; the message says why not.
std::optional<Allocation> unregister(void* pointer, MemoryKind kind, const char* call,
                                     cudaError_t* error) {
  Registry& r = registry();
  std::unique_lock lock(r.mutex);
  auto it = r.allocations.find(reinterpret_cast<uintptr_t>(pointer));
  if (it == r.allocations.end() || it->second.kind != kind) {
    lock.unlock();
    *error = fail(cudaErrorInvalidValue, std::string(call) + "(" + describe_pointer(pointer) +
                                             "): not the start of " + kind_name(kind) +
                                             " allocated by this device");
    return std::nullopt;
  }
  Allocation a = it->second;
  r.allocations.erase(it);
  if (kind == MemoryKind::Device) r.device_bytes -= a.bytes;
  return a;
}

std::string pointer_text(const void* pointer) {
  char text[32];
  std::snprintf(text, sizeof(text), "%p", pointer);
  return text;
}

// What a copy endpoint must be for `kind`: device memory or not.
struct Endpoints {
  bool dst_device;
  bool src_device;
};
std::optional<Endpoints> endpoints(cudaMemcpyKind kind, const void* dst, const void* src) {
  const auto is_device = [](const void* p) {
    const std::optional<Allocation> a = find_allocation(p);
    return a && a->kind == MemoryKind::Device;
  };
  switch (kind) {
    case cudaMemcpyHostToHost:
      return Endpoints{false, false};
    case cudaMemcpyHostToDevice:
      return Endpoints{true, false};
    case cudaMemcpyDeviceToHost:
      return Endpoints{false, true};
    case cudaMemcpyDeviceToDevice:
      return Endpoints{true, true};
    case cudaMemcpyDefault:
      return Endpoints{is_device(dst), is_device(src)};
  }
  return std::nullopt;
}

const char* kind_text(cudaMemcpyKind kind) {
  switch (kind) {
    case cudaMemcpyHostToHost:
      return "cudaMemcpyHostToHost";
    case cudaMemcpyHostToDevice:
      return "cudaMemcpyHostToDevice";
    case cudaMemcpyDeviceToHost:
      return "cudaMemcpyDeviceToHost";
    case cudaMemcpyDeviceToDevice:
      return "cudaMemcpyDeviceToDevice";
    case cudaMemcpyDefault:
      return "cudaMemcpyDefault";
  }
  return "an unknown cudaMemcpyKind";
}

// A host endpoint must not be device memory; a device endpoint must lie inside a device
// allocation. A host endpoint inside pinned memory must lie inside it too.
std::optional<std::string> check_endpoint(const void* pointer, size_t bytes, bool device,
                                          const char* what) {
  if (device) return check_range(pointer, bytes, MemoryKind::Device, what);
  const std::optional<Allocation> a = find_allocation(pointer);
  if (a && a->kind == MemoryKind::Device) {
    return std::string(what) + " " + describe_pointer(pointer) + " where host memory is expected";
  }
  if (a) return check_range(pointer, bytes, MemoryKind::PinnedHost, what);
  return std::nullopt;
}

bool is_pinned_or_device(const void* pointer) {
  return find_allocation(pointer).has_value();
}

// Checks a copy and queues it on `handle`; `synchronous` waits for it (cudaMemcpy). A copy to or
// from pageable host memory is synchronous with respect to the host, as CUDA's is, since the
// caller may reuse that memory as soon as the call returns.
cudaError_t copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t handle,
                 bool synchronous, const char* call) {
  if (const cudaError_t s = sticky_error(); s != cudaSuccess) return s;
  if (bytes == 0) return cudaSuccess;
  if (dst == nullptr || src == nullptr) {
    return fail(cudaErrorInvalidValue, std::string(call) + ": null pointer");
  }
  const std::optional<Endpoints> ends = endpoints(kind, dst, src);
  if (!ends) return fail(cudaErrorInvalidMemcpyDirection, std::string(call) + ": bad kind");
  std::string what = std::string(call) + " (" + kind_text(kind) + ") destination";
  if (auto problem = check_endpoint(dst, bytes, ends->dst_device, what.c_str())) {
    return fail(cudaErrorInvalidValue, *problem);
  }
  what = std::string(call) + " (" + kind_text(kind) + ") source";
  if (auto problem = check_endpoint(src, bytes, ends->src_device, what.c_str())) {
    return fail(cudaErrorInvalidValue, *problem);
  }
  const std::shared_ptr<Stream> stream = find_stream(handle);
  if (!stream) return fail(cudaErrorInvalidResourceHandle, std::string(call) + ": unknown stream");
  const bool pageable = !is_pinned_or_device(dst) || !is_pinned_or_device(src);
  const uint64_t done =
      enqueue(stream, Task{[dst, src, bytes] { std::memmove(dst, src, bytes); }, {}, false});
  if (synchronous || pageable) {
    stream->wait_until(done);
    return sticky_error();
  }
  return cudaSuccess;
}

cudaError_t set(void* pointer, int value, size_t bytes, cudaStream_t handle, bool synchronous,
                const char* call) {
  if (const cudaError_t s = sticky_error(); s != cudaSuccess) return s;
  if (bytes == 0) return cudaSuccess;
  if (auto problem = check_range(pointer, bytes, MemoryKind::Device, call)) {
    return fail(cudaErrorInvalidValue, *problem);
  }
  const std::shared_ptr<Stream> stream = find_stream(handle);
  if (!stream) return fail(cudaErrorInvalidResourceHandle, std::string(call) + ": unknown stream");
  const uint64_t done = enqueue(
      stream, Task{[pointer, value, bytes] { std::memset(pointer, value, bytes); }, {}, false});
  if (synchronous) {
    stream->wait_until(done);
    return sticky_error();
  }
  return cudaSuccess;
}

cudaError_t host_alloc(void** pointer, size_t bytes, const char* call) {
  if (pointer == nullptr) return fail(cudaErrorInvalidValue, std::string(call) + ": null pointer");
  *pointer = nullptr;
  if (const cudaError_t s = sticky_error(); s != cudaSuccess) return s;
  if (bytes == 0) return cudaSuccess;
  void* memory = allocate_aligned(bytes);
  if (memory == nullptr) {
    return fail(cudaErrorMemoryAllocation,
                std::string(call) + " of " + std::to_string(bytes) + " bytes failed");
  }
  Registry& r = registry();
  std::unique_lock lock(r.mutex);
  r.allocations[reinterpret_cast<uintptr_t>(memory)] =
      Allocation{reinterpret_cast<uintptr_t>(memory), bytes, MemoryKind::PinnedHost, false};
  *pointer = memory;
  return cudaSuccess;
}

}  // namespace

std::optional<Allocation> find_allocation(const void* pointer) {
  const Registry& r = registry();
  std::shared_lock lock(r.mutex);
  return find_locked(r, reinterpret_cast<uintptr_t>(pointer));
}

std::string describe_pointer(const void* pointer) {
  const std::optional<Allocation> a = find_allocation(pointer);
  if (!a) return pointer_text(pointer) + " (host memory unknown to the device)";
  return pointer_text(pointer) + " (" + kind_name(a->kind) + ", byte " +
         std::to_string(reinterpret_cast<uintptr_t>(pointer) - a->begin) + " of a " +
         std::to_string(a->bytes) + "-byte allocation)";
}

std::optional<std::string> check_range(const void* pointer, size_t bytes, MemoryKind kind,
                                       const char* what) {
  const std::optional<Allocation> a = find_allocation(pointer);
  if (!a || a->kind != kind) {
    return std::string(what) + " is " + describe_pointer(pointer) + ", not " + kind_name(kind);
  }
  const uintptr_t offset = reinterpret_cast<uintptr_t>(pointer) - a->begin;
  if (bytes > a->bytes - offset) {
    return std::string(what) + ": " + std::to_string(bytes) + " bytes from " +
           describe_pointer(pointer) + " run past the allocation's end";
  }
  return std::nullopt;
}

size_t device_bytes_in_use() {
  const Registry& r = registry();
  std::shared_lock lock(r.mutex);
  return r.device_bytes;
}

}  // namespace infinigen::cuda_emulation

namespace emu = infinigen::cuda_emulation;

cudaError_t cudaMalloc(void** pointer, size_t bytes) {
  return emu::allocate_device(pointer, bytes, "cudaMalloc");
}

cudaError_t cudaFree(void* pointer) {
  if (pointer == nullptr) return cudaSuccess;
  emu::synchronize_device();  // cudaFree waits for the device, as on a GPU
  cudaError_t error = cudaSuccess;
  const auto a = emu::unregister(pointer, emu::MemoryKind::Device, "cudaFree", &error);
  if (!a) return error;
  std::free(pointer);
  return emu::sticky_error();
}

cudaError_t cudaMallocAsync(void** pointer, size_t bytes, cudaStream_t stream) {
  if (!emu::find_stream(stream)) {
    return emu::fail(cudaErrorInvalidResourceHandle, "cudaMallocAsync: unknown stream");
  }
  // The memory exists at once; it is only used by work queued after this call on `stream` (or
  // ordered after it), so allocating now is one of the orders a GPU may pick.
  return emu::allocate_device(pointer, bytes, "cudaMallocAsync");
}

cudaError_t cudaFreeAsync(void* pointer, cudaStream_t handle) {
  if (pointer == nullptr) return cudaSuccess;
  const std::shared_ptr<emu::Stream> stream = emu::find_stream(handle);
  if (!stream) return emu::fail(cudaErrorInvalidResourceHandle, "cudaFreeAsync: unknown stream");
  const std::optional<emu::Allocation> a = emu::find_allocation(pointer);
  if (!a || a->kind != emu::MemoryKind::Device ||
      a->begin != reinterpret_cast<uintptr_t>(pointer)) {
    return emu::fail(cudaErrorInvalidValue, "cudaFreeAsync(" + emu::describe_pointer(pointer) +
                                                "): not the start of a device allocation");
  }
  // Freed in stream order: work queued before it on the stream still sees the memory.
  emu::enqueue(stream, emu::Task{[pointer] {
                                   cudaError_t error = cudaSuccess;
                                   if (emu::unregister(pointer, emu::MemoryKind::Device,
                                                       "cudaFreeAsync", &error)) {
                                     std::free(pointer);
                                   }
                                 },
                                 {},
                                 true});
  return cudaSuccess;
}

cudaError_t cudaMallocHost(void** pointer, size_t bytes) {
  return emu::host_alloc(pointer, bytes, "cudaMallocHost");
}

cudaError_t cudaHostAlloc(void** pointer, size_t bytes, unsigned int) {
  // Every pinned allocation is mapped (unified addressing): its device pointer is itself.
  return emu::host_alloc(pointer, bytes, "cudaHostAlloc");
}

cudaError_t cudaFreeHost(void* pointer) {
  if (pointer == nullptr) return cudaSuccess;
  emu::synchronize_device();
  cudaError_t error = cudaSuccess;
  const auto a = emu::unregister(pointer, emu::MemoryKind::PinnedHost, "cudaFreeHost", &error);
  if (!a) return error;
  if (a->user_registered) {
    return emu::fail(cudaErrorInvalidValue,
                     "cudaFreeHost: memory registered with cudaHostRegister is not the device's");
  }
  std::free(pointer);
  return cudaSuccess;
}

cudaError_t cudaHostRegister(void* pointer, size_t bytes, unsigned int) {
  if (pointer == nullptr || bytes == 0) {
    return emu::fail(cudaErrorInvalidValue, "cudaHostRegister: empty range");
  }
  if (emu::find_allocation(pointer) ||
      emu::find_allocation(static_cast<char*>(pointer) + bytes - 1)) {
    return emu::fail(cudaErrorHostMemoryAlreadyRegistered,
                     "cudaHostRegister(" + emu::describe_pointer(pointer) + ")");
  }
  emu::Registry& r = emu::registry();
  std::unique_lock lock(r.mutex);
  r.allocations[reinterpret_cast<uintptr_t>(pointer)] = emu::Allocation{
      reinterpret_cast<uintptr_t>(pointer), bytes, emu::MemoryKind::PinnedHost, true};
  return cudaSuccess;
}

cudaError_t cudaHostUnregister(void* pointer) {
  emu::Registry& r = emu::registry();
  std::unique_lock lock(r.mutex);
  auto it = r.allocations.find(reinterpret_cast<uintptr_t>(pointer));
  if (it == r.allocations.end() || !it->second.user_registered) {
    lock.unlock();
    return emu::fail(cudaErrorHostMemoryNotRegistered,
                     "cudaHostUnregister(" + emu::describe_pointer(pointer) + ")");
  }
  r.allocations.erase(it);
  return cudaSuccess;
}

cudaError_t cudaHostGetDevicePointer(void** device_pointer, void* host_pointer, unsigned int) {
  const std::optional<emu::Allocation> a = emu::find_allocation(host_pointer);
  if (device_pointer == nullptr || !a || a->kind != emu::MemoryKind::PinnedHost) {
    return emu::fail(cudaErrorInvalidValue, "cudaHostGetDevicePointer(" +
                                                emu::describe_pointer(host_pointer) +
                                                "): not pinned host memory");
  }
  *device_pointer = host_pointer;
  return cudaSuccess;
}

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attributes, const void* pointer) {
  if (attributes == nullptr) return emu::fail(cudaErrorInvalidValue, "cudaPointerGetAttributes");
  const std::optional<emu::Allocation> a = emu::find_allocation(pointer);
  void* p = const_cast<void*>(pointer);
  if (!a) {
    *attributes = cudaPointerAttributes{cudaMemoryTypeUnregistered, -2, nullptr, nullptr};
  } else if (a->kind == emu::MemoryKind::Device) {
    *attributes = cudaPointerAttributes{cudaMemoryTypeDevice, 0, p, nullptr};
  } else {
    *attributes = cudaPointerAttributes{cudaMemoryTypeHost, 0, p, p};
  }
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  return emu::copy(dst, src, bytes, kind, nullptr, true, "cudaMemcpy");
}

cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream) {
  return emu::copy(dst, src, bytes, kind, stream, false, "cudaMemcpyAsync");
}

cudaError_t cudaMemcpy2DAsync(void* dst, size_t dst_pitch, const void* src, size_t src_pitch,
                              size_t width, size_t height, cudaMemcpyKind kind,
                              cudaStream_t stream) {
  if (height == 0 || width == 0) return cudaSuccess;
  if (width > dst_pitch || width > src_pitch) {
    return emu::fail(cudaErrorInvalidValue, "cudaMemcpy2DAsync: width exceeds a pitch");
  }
  // Each row is one checked copy, queued in order on the stream.
  for (size_t row = 0; row < height; ++row) {
    const cudaError_t error = emu::copy(static_cast<char*>(dst) + row * dst_pitch,
                                        static_cast<const char*>(src) + row * src_pitch, width,
                                        kind, stream, false, "cudaMemcpy2DAsync");
    if (error != cudaSuccess) return error;
  }
  return cudaSuccess;
}

cudaError_t cudaMemset(void* pointer, int value, size_t bytes) {
  return emu::set(pointer, value, bytes, nullptr, true, "cudaMemset");
}

cudaError_t cudaMemsetAsync(void* pointer, int value, size_t bytes, cudaStream_t stream) {
  return emu::set(pointer, value, bytes, stream, false, "cudaMemsetAsync");
}
