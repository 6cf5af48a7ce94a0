// core: the devices the engine runs on, discovery, and the dispatch macro.
//
// Ops are implemented per device (kernels/cpu, kernels/cuda) and chosen at run time by the
// switch in core/ops.cc. Builds without CUDA still know Device::Cuda; asking for it throws
// "CUDA backend not compiled". core/device.cc is the only place in core that tests INFINIGEN_CUDA.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.h"

namespace infinigen {

enum class Device { Cpu, Cuda };

std::string_view device_name(Device device);
// What a run on `device` runs on, for reports: "cpu", or "cuda" with the device's name
// ("cuda (CUDA emulated on the CPU, sm_86 limits)" on the emulated device).
std::string device_description(Device device);

struct CudaDeviceInfo {
  int index = 0;
  std::string name;
  size_t total_memory_bytes = 0;
  int compute_capability_major = 0;
  int compute_capability_minor = 0;
  bool emulated = false;  // the emulated device (an INFINIGEN_CUDA=EMULATE build): CPU speed
};

// True when this binary contains the CUDA backend.
bool cuda_compiled();
// The CUDA devices that can be used now: empty without the backend, a driver or a GPU, or when
// discovery failed (cuda_discovery_error says why).
std::vector<CudaDeviceInfo> cuda_devices();
// Why the CUDA devices cannot be used although the backend is compiled and a driver is
// installed, e.g. "the NVIDIA driver supports CUDA 12.4 but this build needs 13.0 (update the
// driver)"; empty when discovery worked or there is simply no driver or GPU.
std::string cuda_discovery_error();

// What the user asked for on the command line.
enum class DeviceRequest { Auto, Cpu, Cuda };
DeviceRequest parse_device_request(std::string_view text);

// Resolves a request to a device. `auto` picks the CPU unless a usable CUDA device is present
// and `cuda_runs_job` says the CUDA backend implements every step of `job` (e.g. "--policy h2o");
// `reason` receives a sentence explaining a fallback (empty when there is none).
Device resolve_device(DeviceRequest request, bool cuda_runs_job, std::string* reason,
                      std::string_view job = "this job");

// Raw memory on a device. Allocation failures throw Error naming the device and the size.
// In a dry run (core/trace.h) allocations return dry_address() and copies do nothing.
void* device_alloc(Device device, size_t bytes);
void device_free(Device device, void* pointer);
// Synchronous copy between any two devices; on CUDA it is ordered after the work enqueued on this
// thread's current stream (core/stream.h), so it sees what those ops wrote.
void device_copy(void* dst, Device dst_device, const void* src, Device src_device, size_t bytes);

// Host memory that transfers to the device read directly: page-locked (cudaHostAlloc) when a
// CUDA device is in use, ordinary 64-byte aligned memory otherwise. `purpose` names what it holds
// ("a KV pool block") in the error. Throws PinnedAllocationError when none can be had.
//
// INFINIGEN_PINNED_LIMIT (bytes, or with a K/M/G suffix) caps the bytes pinned at once, as a
// driver or another process would; the memory planner is not told, so the cap exercises what
// happens when memory that the plan counted on cannot be had.
void* pinned_alloc(size_t bytes, std::string_view purpose);
void pinned_free(void* pointer);
size_t pinned_bytes_in_use();  // live bytes from pinned_alloc

// Calls of the functions above that allocated or freed memory since the process started, from
// every thread: device_alloc and device_free per device, pinned_alloc and pinned_free (whose
// memory is counted there only, not again as a CPU device allocation). Dry runs, null pointers
// and pointers that are not ours count nothing. Each count is one relaxed atomic add, cheap
// enough for every allocation; the difference of two snapshots is what happened between them
// (offload/offload_stats.h counts a decode step's this way: it should be zero).
struct AllocationCounts {
  uint64_t cpu_allocs = 0;
  uint64_t cpu_frees = 0;
  uint64_t cuda_allocs = 0;
  uint64_t cuda_frees = 0;
  uint64_t pinned_allocs = 0;
  uint64_t pinned_frees = 0;

  uint64_t allocs() const { return cpu_allocs + cuda_allocs + pinned_allocs; }
  uint64_t frees() const { return cpu_frees + cuda_frees + pinned_frees; }
  // Each count of `*this` less `earlier`'s (a snapshot taken before it).
  AllocationCounts since(const AllocationCounts& earlier) const;
};
AllocationCounts allocation_counts();

class PinnedAllocationError : public Error {
 public:
  PinnedAllocationError(const std::string& message, size_t requested, size_t pinned_before);
  size_t requested() const { return requested_; }
  size_t pinned_before() const { return pinned_before_; }  // bytes pinned when it failed

 private:
  size_t requested_;
  size_t pinned_before_;
};

// "268435456", "256M", "2G" (binary suffixes K, M, G) in bytes; nullopt for anything else.
std::optional<size_t> parse_byte_size(std::string_view text);

// Debug mode for catching reads of data that was never written or transferred: every device
// buffer is filled with NaN when allocated and staging buffers are refilled before reuse.
// On when INFINIGEN_DEBUG_NAN=1 at start-up, or after set_debug_poison(true).
bool debug_poison();
void set_debug_poison(bool enabled);

[[noreturn]] void throw_cuda_not_compiled();
// Throws the error for an op that has no kernel on `device` (yet).
[[noreturn]] void throw_op_not_on_device(std::string_view op, Device device);

}  // namespace infinigen
