// kernels/cuda/emulation: the device itself: what discovery reports (one device, named as the
// emulation, with the limits of the paper's GPU, an sm_86 RTX A6000), kernel launches checked
// against those limits, and device-wide synchronisation.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <string>

#include "kernels/cuda/emulation/device_state.h"

namespace infinigen::cuda_emulation {
namespace {

constexpr size_t kDefaultMemoryBytes = size_t{8} << 30;

// "8589934592", "8G", "512M": bytes, or 0 when the text is not such a size.
size_t parse_bytes(const char* text) {
  char* end = nullptr;
  const unsigned long long value = std::strtoull(text, &end, 10);
  if (end == text) return 0;
  switch (*end) {
    case '\0':
      return value;
    case 'K':
      return value << 10;
    case 'M':
      return value << 20;
    case 'G':
      return value << 30;
    default:
      return 0;
  }
}

struct KernelAttributes {
  std::mutex mutex;
  std::map<const void*, size_t> max_dynamic_shared;  // set by cudaFuncSetAttribute
};
KernelAttributes& kernel_attributes() {
  static auto* state = new KernelAttributes;
  return *state;
}

std::string dims(dim3 d) {
  char text[64];
  std::snprintf(text, sizeof(text), "(%u, %u, %u)", d.x, d.y, d.z);
  return text;
}

}  // namespace

size_t device_memory_bytes() {
  static const size_t bytes = [] {
    const char* text = std::getenv("INFINIGEN_CUDA_EMULATION_MEMORY");
    const size_t parsed = text != nullptr ? parse_bytes(text) : 0;
    return parsed > 0 ? parsed : kDefaultMemoryBytes;
  }();
  return bytes;
}

bool poison_enabled() {
  static const bool enabled = [] {
    const char* text = std::getenv("INFINIGEN_CUDA_EMULATION_POISON");
    return text == nullptr || std::strcmp(text, "0") != 0;
  }();
  return enabled;
}

size_t max_dynamic_shared_bytes(const void* kernel) {
  KernelAttributes& a = kernel_attributes();
  std::lock_guard<std::mutex> lock(a.mutex);
  auto it = a.max_dynamic_shared.find(kernel);
  return it == a.max_dynamic_shared.end() ? kSharedMemoryPerBlock : it->second;
}

cudaError_t submit_kernel(KernelLaunch launch) {
  if (const cudaError_t s = sticky_error(); s != cudaSuccess) return s;
  const std::string where = describe_site(launch.site);
  const dim3 b = launch.block, g = launch.grid;
  const unsigned long long threads = static_cast<unsigned long long>(b.x) * b.y * b.z;
  if (b.x == 0 || b.y == 0 || b.z == 0 || b.x > 1024 || b.y > 1024 || b.z > 64 || threads > 1024) {
    return fail(cudaErrorInvalidConfiguration,
                where + ": block " + dims(b) + " (at most 1024 threads, z at most 64)");
  }
  if (g.x == 0 || g.y == 0 || g.z == 0 || g.x > 0x7fffffffu || g.y > 65535 || g.z > 65535) {
    return fail(cudaErrorInvalidConfiguration,
                where + ": grid " + dims(g) + " (x up to 2^31 - 1, y and z up to 65535)");
  }
  const size_t shared_limit = max_dynamic_shared_bytes(launch.kernel);
  if (launch.shared_bytes > shared_limit) {
    return fail(cudaErrorInvalidValue,
                where + ": " + std::to_string(launch.shared_bytes) +
                    " bytes of dynamic shared memory, over the kernel's limit of " +
                    std::to_string(shared_limit) +
                    " (above 48 KiB a kernel must opt in with cudaFuncSetAttribute("
                    "cudaFuncAttributeMaxDynamicSharedMemorySize))");
  }
  const std::shared_ptr<Stream> stream = find_stream(launch.stream);
  if (!stream) return fail(cudaErrorInvalidResourceHandle, where + ": unknown stream");
  enqueue(stream, Task{[launch = std::move(launch)] { run_kernel(launch); }, {}, false});
  return cudaSuccess;
}

}  // namespace infinigen::cuda_emulation

namespace emu = infinigen::cuda_emulation;

cudaError_t cudaGetDeviceCount(int* count) {
  if (count == nullptr) return emu::fail(cudaErrorInvalidValue, "cudaGetDeviceCount: null");
  *count = 1;
  return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  if (prop == nullptr) return emu::fail(cudaErrorInvalidValue, "cudaGetDeviceProperties: null");
  if (device != 0) return emu::fail(cudaErrorInvalidDevice, "the emulation has one device, 0");
  std::memset(prop, 0, sizeof(*prop));
  std::strncpy(prop->name, "CUDA emulated on the CPU, sm_86 limits", sizeof(prop->name) - 1);
  prop->totalGlobalMem = emu::device_memory_bytes();
  prop->sharedMemPerBlock = emu::kSharedMemoryPerBlock;
  prop->sharedMemPerBlockOptin = emu::kSharedMemoryPerBlockOptin;
  prop->regsPerBlock = 65536;
  prop->warpSize = 32;
  prop->maxThreadsPerBlock = 1024;
  prop->maxThreadsDim[0] = 1024;
  prop->maxThreadsDim[1] = 1024;
  prop->maxThreadsDim[2] = 64;
  prop->maxGridSize[0] = 0x7fffffff;
  prop->maxGridSize[1] = 65535;
  prop->maxGridSize[2] = 65535;
  prop->major = 8;
  prop->minor = 6;
  prop->multiProcessorCount = 1;
  prop->asyncEngineCount = 2;
  prop->canMapHostMemory = 1;
  prop->unifiedAddressing = 1;
  prop->concurrentKernels = 1;
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  return device == 0 ? cudaSuccess
                     : emu::fail(cudaErrorInvalidDevice, "the emulation has one device, 0");
}

cudaError_t cudaGetDevice(int* device) {
  if (device == nullptr) return emu::fail(cudaErrorInvalidValue, "cudaGetDevice: null");
  *device = 0;
  return cudaSuccess;
}

cudaError_t cudaDriverGetVersion(int* version) {
  if (version == nullptr) return emu::fail(cudaErrorInvalidValue, "cudaDriverGetVersion: null");
  *version = CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t cudaRuntimeGetVersion(int* version) {
  if (version == nullptr) return emu::fail(cudaErrorInvalidValue, "cudaRuntimeGetVersion: null");
  *version = CUDART_VERSION;
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize() {
  emu::synchronize_device();
  return emu::sticky_error();
}

cudaError_t cudaDeviceReset() {
  // Clears a sticky error so that a process can go on (tests of faults); unlike a GPU's reset
  // it keeps allocations, streams and events.
  emu::synchronize_device();
  emu::clear_sticky_error();
  return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
  if (free_bytes == nullptr || total_bytes == nullptr) {
    return emu::fail(cudaErrorInvalidValue, "cudaMemGetInfo: null");
  }
  *total_bytes = emu::device_memory_bytes();
  *free_bytes = *total_bytes - emu::device_bytes_in_use();
  return cudaSuccess;
}

cudaError_t cudaFuncSetAttribute(const void* kernel, cudaFuncAttribute attribute, int value) {
  if (kernel == nullptr) return emu::fail(cudaErrorInvalidValue, "cudaFuncSetAttribute: null");
  if (attribute == cudaFuncAttributePreferredSharedMemoryCarveout) return cudaSuccess;
  if (attribute != cudaFuncAttributeMaxDynamicSharedMemorySize) {
    return emu::fail(cudaErrorInvalidValue, "cudaFuncSetAttribute: unsupported attribute");
  }
  if (value < 0 || static_cast<size_t>(value) > emu::kSharedMemoryPerBlockOptin) {
    return emu::fail(cudaErrorInvalidValue,
                     "cudaFuncSetAttribute: " + std::to_string(value) +
                         " bytes of dynamic shared memory, over the device's " +
                         std::to_string(emu::kSharedMemoryPerBlockOptin));
  }
  emu::KernelAttributes& a = emu::kernel_attributes();
  std::lock_guard<std::mutex> lock(a.mutex);
  a.max_dynamic_shared[kernel] = static_cast<size_t>(value);
  return cudaSuccess;
}
