// core: device discovery, device memory and the CUDA/no-CUDA seam.
#include "core/device.h"

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <new>
#include <unordered_set>

#ifdef INFINIGEN_CUDA
#include "kernels/cuda/runtime.h"
#endif

namespace infinigen {
namespace {

constexpr size_t kHostAlignment = 64;

#ifdef INFINIGEN_CUDA
void check_cuda(int code, const char* what) {
  if (code != 0) fail("CUDA ", what, " failed: ", kernels::cuda::error_string(code));
}

// Pointers that pinned_alloc got from cudaHostAlloc; every other pinned pointer came from the
// host allocator. Recorded per pointer so that pinned_free never guesses (a wrong free corrupts
// the heap). Never destroyed, so buffers freed during static destruction are still found.
std::mutex& cuda_pinned_mutex() {
  static auto* mutex = new std::mutex;
  return *mutex;
}
std::unordered_set<void*>& cuda_pinned_pointers() {
  static auto* pointers = new std::unordered_set<void*>;
  return *pointers;
}

struct Discovery {
  int count = 0;
  std::string error;
};

// Asked once: discovery is a driver call, and the answer cannot change during the run.
const Discovery& discovery() {
  static const Discovery result = [] {
    Discovery d;
    int driver = 0, runtime = 0;
    const int code = kernels::cuda::device_count(&d.count, &driver, &runtime);
    if (code == 0) return d;
    const auto version = [](int v) { return cat(v / 1000, ".", v % 1000 / 10); };
    d.error = driver > 0 && driver < runtime
                  ? cat("the NVIDIA driver supports CUDA ", version(driver), " but this build ",
                        "needs CUDA ", version(runtime), " (update the driver)")
                  : cat("CUDA device discovery failed: ", kernels::cuda::error_string(code));
    return d;
  }();
  return result;
}

bool pin_with_cuda() {
  return discovery().count > 0;
}
#endif

std::atomic<bool>& debug_poison_flag() {
  static std::atomic<bool> flag{[] {
    const char* value = std::getenv("INFINIGEN_DEBUG_NAN");
    return value != nullptr && std::strcmp(value, "1") == 0;
  }()};
  return flag;
}

}  // namespace

std::string_view device_name(Device device) {
  return device == Device::Cpu ? "cpu" : "cuda";
}

bool cuda_compiled() {
#ifdef INFINIGEN_CUDA
  return true;
#else
  return false;
#endif
}

std::vector<CudaDeviceInfo> cuda_devices() {
  std::vector<CudaDeviceInfo> devices;
#ifdef INFINIGEN_CUDA
  for (int i = 0; i < discovery().count; ++i) {
    kernels::cuda::DeviceProperties prop{};
    if (kernels::cuda::device_properties(i, &prop) != 0) continue;
    devices.push_back({i, prop.name, prop.total_memory_bytes, prop.major, prop.minor});
  }
#endif
  return devices;
}

std::string cuda_discovery_error() {
#ifdef INFINIGEN_CUDA
  return discovery().error;
#else
  return "";
#endif
}

DeviceRequest parse_device_request(std::string_view text) {
  if (text == "auto") return DeviceRequest::Auto;
  if (text == "cpu") return DeviceRequest::Cpu;
  if (text == "cuda") return DeviceRequest::Cuda;
  fail("--device: unknown device '", text, "' (expected cpu, cuda or auto)");
}

Device resolve_device(DeviceRequest request, bool cuda_runs_job, std::string* reason,
                      std::string_view job) {
  reason->clear();
  if (request == DeviceRequest::Cpu) return Device::Cpu;
  if (request == DeviceRequest::Cuda) {
    if (!cuda_compiled()) throw_cuda_not_compiled();
    if (cuda_devices().empty()) {
      const std::string error = cuda_discovery_error();
      fail("--device cuda: ",
           error.empty() ? "no CUDA device is available on this machine" : error);
    }
    INFINIGEN_CHECK(cuda_runs_job, "--device cuda: the CUDA backend does not run ", job,
                    " yet (use --device cpu)");
    return Device::Cuda;
  }
  if (!cuda_compiled()) return Device::Cpu;
  if (cuda_devices().empty()) {
    if (const std::string error = cuda_discovery_error(); !error.empty()) {
      *reason = error + "; using the CPU";
    }
    return Device::Cpu;
  }
  if (!cuda_runs_job) {
    *reason = cat("a CUDA device is present but the CUDA backend does not run ", job,
                  " yet; using the CPU");
    return Device::Cpu;
  }
  return Device::Cuda;
}

void* device_alloc(Device device, size_t bytes) {
  if (device == Device::Cpu) {
    INFINIGEN_CHECK(bytes <= SIZE_MAX - kHostAlignment, "cannot allocate ", bytes, " bytes");
    const size_t rounded = (bytes + kHostAlignment - 1) / kHostAlignment * kHostAlignment;
    void* p = std::aligned_alloc(kHostAlignment, rounded == 0 ? kHostAlignment : rounded);
    if (p == nullptr) fail("out of host memory allocating ", bytes, " bytes");
    return p;
  }
#ifdef INFINIGEN_CUDA
  void* p = nullptr;
  const int code = kernels::cuda::malloc_device(&p, bytes);
  if (code != 0) {
    fail("CUDA allocation of ", bytes, " bytes failed: ", kernels::cuda::error_string(code));
  }
  return p;
#else
  throw_cuda_not_compiled();
#endif
}

void device_free(Device device, void* pointer) {
  if (device == Device::Cpu) {
    std::free(pointer);
    return;
  }
#ifdef INFINIGEN_CUDA
  kernels::cuda::free_device(pointer);  // errors on free cannot be handled meaningfully
#endif
}

void device_copy(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes) {
  if (bytes == 0) return;
  if (dst_device == Device::Cpu && src_device == Device::Cpu) {
    std::memcpy(dst, src, bytes);
    return;
  }
#ifdef INFINIGEN_CUDA
  const int kind = src_device == Device::Cpu ? 0 : dst_device == Device::Cpu ? 1 : 2;
  check_cuda(kernels::cuda::copy(dst, src, bytes, kind), "copy");
#else
  throw_cuda_not_compiled();
#endif
}

void* pinned_alloc(size_t bytes) {
  // Zero-byte requests still return a distinct pointer, as device_alloc's callers expect.
  const size_t request = bytes == 0 ? 1 : bytes;
  INFINIGEN_CHECK(request <= std::numeric_limits<size_t>::max() - kHostAlignment,
                  "pinned host allocation of ", bytes, " bytes is too large");
#ifdef INFINIGEN_CUDA
  if (pin_with_cuda()) {
    void* p = nullptr;
    const int code = kernels::cuda::host_alloc_pinned(&p, request);
    if (code != 0 || p == nullptr) {
      fail("pinned host allocation of ", bytes,
           " bytes failed: ", kernels::cuda::error_string(code));
    }
    try {
      std::lock_guard lock(cuda_pinned_mutex());
      cuda_pinned_pointers().insert(p);
    } catch (...) {
      kernels::cuda::free_host_pinned(p);
      throw;
    }
    return p;
  }
#endif
  return device_alloc(Device::Cpu, request);
}

void pinned_free(void* pointer) {
  if (pointer == nullptr) return;
#ifdef INFINIGEN_CUDA
  bool from_cuda = false;
  {
    std::lock_guard lock(cuda_pinned_mutex());
    from_cuda = cuda_pinned_pointers().erase(pointer) != 0;
  }
  // Freed outside the lock: cudaFreeHost may wait for the device, and other threads allocate.
  if (from_cuda) {
    kernels::cuda::free_host_pinned(pointer);  // errors on free cannot be handled meaningfully
    return;
  }
#endif
  device_free(Device::Cpu, pointer);
}

bool debug_poison() {
  return debug_poison_flag().load(std::memory_order_relaxed);
}

void set_debug_poison(bool enabled) {
  debug_poison_flag().store(enabled, std::memory_order_relaxed);
}

void throw_cuda_not_compiled() {
  fail("CUDA backend not compiled: rebuild with -DINFINIGEN_CUDA=ON (needs the CUDA toolkit)");
}

void throw_op_not_on_device(std::string_view op, Device device) {
  fail("op '", op, "' has no ", device_name(device), " kernel in this build");
}

}  // namespace infinigen
