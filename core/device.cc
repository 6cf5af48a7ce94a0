// core: device discovery, device memory and the CUDA/no-CUDA seam.
#include "core/device.h"

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <unordered_map>

#include "core/pin_ahead.h"
#include "core/stream.h"
#include "core/trace.h"

#ifdef INFINIGEN_CUDA
#include "kernels/cuda/runtime.h"
#endif

namespace infinigen {
namespace {

constexpr size_t kHostAlignment = 64;
constexpr double kMiB = 1024.0 * 1024.0;

struct PinnedBlock {
  size_t bytes = 0;
  bool from_cuda = false;
};

// Every live pinned allocation: its size (for the bytes in use) and whether it came from
// cudaHostAlloc rather than the host allocator, so that pinned_free never guesses (a wrong free
// corrupts the heap). Never destroyed, so buffers freed during static destruction are found.
struct PinnedRegistry {
  std::mutex mutex;
  std::unordered_map<void*, PinnedBlock> blocks;
  size_t bytes_in_use = 0;
};
PinnedRegistry& pinned_registry() {
  static auto* registry = new PinnedRegistry;
  return *registry;
}

// INFINIGEN_PINNED_LIMIT: bytes ("268435456", or with a binary suffix: "256M", "2G"), read once.
std::optional<size_t> pinned_limit() {
  static const std::optional<size_t> limit = []() -> std::optional<size_t> {
    const char* text = std::getenv("INFINIGEN_PINNED_LIMIT");
    if (text == nullptr || *text == '\0') return std::nullopt;
    const std::optional<size_t> bytes = parse_byte_size(text);
    INFINIGEN_CHECK(bytes, "INFINIGEN_PINNED_LIMIT: expected a size in bytes such as 268435456 ",
                    "or 256M, got '", text, "'");
    return bytes;
  }();
  return limit;
}

// Returns a pinned block to where it came from.
void release_pinned(void* pointer, const PinnedBlock& block) {
#ifdef INFINIGEN_CUDA
  if (block.from_cuda) {
    kernels::cuda::free_host_pinned(pointer);  // errors on free cannot be handled meaningfully
    return;
  }
#endif
  (void)block;
  std::free(pointer);  // from host_alloc
}

std::string mib(size_t bytes) {
  char text[64];
  std::snprintf(text, sizeof(text), "%.1f MiB", static_cast<double>(bytes) / kMiB);
  return text;
}

#ifdef INFINIGEN_CUDA
void check_cuda(int code, const char* what) {
  if (code != 0) fail("CUDA ", what, " failed: ", kernels::cuda::error_string(code));
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

// allocation_counts(): one counter per AllocationCounts field, constant-initialised (zero) so that
// allocations during static initialisation and destruction count safely.
enum Counter {
  kCpuAllocs,
  kCpuFrees,
  kCudaAllocs,
  kCudaFrees,
  kPinnedAllocs,
  kPinnedFrees,
  kCounters
};
constinit std::atomic<uint64_t> g_counters[kCounters] = {};

void count(Counter counter) {
  g_counters[counter].fetch_add(1, std::memory_order_relaxed);
}

// 64-byte aligned host memory, uncounted: device_alloc(Cpu) and pinned_alloc count their own.
void* host_alloc(size_t bytes) {
  INFINIGEN_CHECK(bytes <= SIZE_MAX - kHostAlignment, "cannot allocate ", bytes, " bytes");
  const size_t rounded = (bytes + kHostAlignment - 1) / kHostAlignment * kHostAlignment;
  void* p = std::aligned_alloc(kHostAlignment, rounded == 0 ? kHostAlignment : rounded);
  if (p == nullptr) fail("out of host memory allocating ", bytes, " bytes");
  return p;
}

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

std::string device_description(Device device) {
  if (device == Device::Cpu) return "cpu";
  const std::vector<CudaDeviceInfo> devices = cuda_devices();
  return devices.empty() ? "cuda" : cat("cuda (", devices.front().name, ")");
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
    devices.push_back(
        {i, prop.name, prop.total_memory_bytes, prop.major, prop.minor, prop.emulated != 0});
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
  fail(option("device"), ": unknown device '", text, "' (expected cpu, cuda or auto)");
}

Device resolve_device(DeviceRequest request, bool cuda_runs_job, std::string* reason,
                      std::string_view job) {
  reason->clear();
  if (request == DeviceRequest::Cpu) return Device::Cpu;
  if (request == DeviceRequest::Cuda) {
    if (!cuda_compiled()) throw_cuda_not_compiled();
    if (cuda_devices().empty()) {
      const std::string error = cuda_discovery_error();
      fail(option("device"),
           " cuda: ", error.empty() ? "no CUDA device is available on this machine" : error);
    }
    INFINIGEN_CHECK(cuda_runs_job, option("device"), " cuda: the CUDA backend does not run ", job,
                    " yet (use ", option("device"), " cpu)");
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
  // The emulated device runs CUDA code at a fraction of the CPU backend's speed: it is there to
  // be asked for (tests, --device cuda), never picked by itself.
  if (cuda_devices().front().emulated) return Device::Cpu;
  return Device::Cuda;
}

void* device_alloc(Device device, size_t bytes) {
  if (dry_run()) return dry_address();
  if (device == Device::Cpu) {
    void* p = host_alloc(bytes);
    count(kCpuAllocs);
    return p;
  }
#ifdef INFINIGEN_CUDA
  void* p = nullptr;
  const int code = kernels::cuda::malloc_device(&p, bytes);
  if (code != 0) {
    fail("CUDA allocation of ", bytes, " bytes failed: ", kernels::cuda::error_string(code));
  }
  count(kCudaAllocs);
  return p;
#else
  throw_cuda_not_compiled();
#endif
}

void device_free(Device device, void* pointer) {
  if (pointer == nullptr || is_dry_address(pointer)) return;
  if (device == Device::Cpu) {
    std::free(pointer);
    count(kCpuFrees);
    return;
  }
#ifdef INFINIGEN_CUDA
  kernels::cuda::free_device(pointer);  // errors on free cannot be handled meaningfully
  count(kCudaFrees);
#endif
}

void device_copy(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes) {
  if (bytes == 0 || dry_run()) return;
  if (dst_device == Device::Cpu && src_device == Device::Cpu) {
    std::memcpy(dst, src, bytes);
    return;
  }
#ifdef INFINIGEN_CUDA
  const int kind = src_device == Device::Cpu ? 0 : dst_device == Device::Cpu ? 1 : 2;
  // Ordered after the ops enqueued on this thread's stream (the data they write or read).
  check_cuda(kernels::cuda::copy(dst, src, bytes, kind, current_cuda_stream()), "copy");
#else
  throw_cuda_not_compiled();
#endif
}

std::optional<size_t> parse_byte_size(std::string_view text) {
  size_t digits = 0;
  while (digits < text.size() && text[digits] >= '0' && text[digits] <= '9') ++digits;
  if (digits == 0 || digits > 19) return std::nullopt;
  const std::string_view suffix = text.substr(digits);
  int shift = 0;
  if (suffix == "K" || suffix == "k") {
    shift = 10;
  } else if (suffix == "M" || suffix == "m") {
    shift = 20;
  } else if (suffix == "G" || suffix == "g") {
    shift = 30;
  } else if (!suffix.empty()) {
    return std::nullopt;
  }
  const uint64_t value = std::stoull(std::string(text.substr(0, digits)));
  if (value > (std::numeric_limits<uint64_t>::max() >> shift)) return std::nullopt;
  return static_cast<size_t>(value << shift);
}

PinnedAllocationError::PinnedAllocationError(const std::string& message, size_t requested,
                                             size_t pinned_before)
    : Error(message), requested_(requested), pinned_before_(pinned_before) {}

void* pinned_alloc(size_t bytes, std::string_view purpose) {
  if (dry_run()) return dry_address();
  // Zero-byte requests still return a distinct pointer, as device_alloc's callers expect.
  const size_t request = bytes == 0 ? 1 : bytes;
  // Pinned (and counted) ahead by a PinAhead of this size, if one is running (core/pin_ahead.h).
  if (void* ahead = take_pinned_ahead(request)) return ahead;
  INFINIGEN_CHECK(request <= std::numeric_limits<size_t>::max() - kHostAlignment,
                  "pinned host allocation of ", bytes, " bytes is too large");
  PinnedRegistry& registry = pinned_registry();
  const size_t before = pinned_bytes_in_use();
  const auto refuse = [&](const std::string& why) {
    throw PinnedAllocationError(cat("could not pin ", mib(request), " of host memory for ", purpose,
                                    " with ", mib(before), " pinned already (", why, ")"),
                                request, before);
  };
  if (const std::optional<size_t> limit = pinned_limit();
      limit && request > *limit - std::min(*limit, before)) {
    refuse(cat("INFINIGEN_PINNED_LIMIT is ", mib(*limit)));
  }
  PinnedBlock block{request, false};
  void* p = nullptr;
#ifdef INFINIGEN_CUDA
  if (pin_with_cuda()) {
    const int code = kernels::cuda::host_alloc_pinned(&p, request);
    if (code != 0 || p == nullptr)
      refuse(cat("cudaHostAlloc: ", kernels::cuda::error_string(code)));
    block.from_cuda = true;
  }
#endif
  if (p == nullptr) {
    try {
      p = host_alloc(request);
    } catch (const Error&) {
      refuse("the host allocator is out of memory");
    }
  }
  try {
    std::lock_guard lock(registry.mutex);
    registry.blocks.emplace(p, block);
    registry.bytes_in_use += request;
  } catch (...) {
    release_pinned(p, block);
    throw;
  }
  count(kPinnedAllocs);
  return p;
}

void pinned_free(void* pointer) {
  if (pointer == nullptr) return;
  PinnedRegistry& registry = pinned_registry();
  PinnedBlock block;
  {
    std::lock_guard lock(registry.mutex);
    const auto found = registry.blocks.find(pointer);
    if (found == registry.blocks.end()) return;  // not ours: never free what we did not allocate
    block = found->second;
    registry.bytes_in_use -= block.bytes;
    registry.blocks.erase(found);
  }
  // Freed outside the lock: cudaFreeHost may wait for the device, and other threads allocate.
  release_pinned(pointer, block);
  count(kPinnedFrees);
}

size_t pinned_bytes_in_use() {
  PinnedRegistry& registry = pinned_registry();
  std::lock_guard lock(registry.mutex);
  return registry.bytes_in_use;
}

AllocationCounts AllocationCounts::since(const AllocationCounts& earlier) const {
  return {cpu_allocs - earlier.cpu_allocs,       cpu_frees - earlier.cpu_frees,
          cuda_allocs - earlier.cuda_allocs,     cuda_frees - earlier.cuda_frees,
          pinned_allocs - earlier.pinned_allocs, pinned_frees - earlier.pinned_frees};
}

AllocationCounts allocation_counts() {
  const auto read = [](Counter c) { return g_counters[c].load(std::memory_order_relaxed); };
  return {read(kCpuAllocs), read(kCpuFrees),     read(kCudaAllocs),
          read(kCudaFrees), read(kPinnedAllocs), read(kPinnedFrees)};
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
