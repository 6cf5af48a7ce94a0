// kernels/cuda/emulation: the emulated device's state, shared by its source files (not by the
// .cu sources, which see only include/). One device: its memory registry, its streams and events,
// and its errors.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "cuda_emulation/api.h"
#include "cuda_emulation/launch.h"

namespace infinigen::cuda_emulation {

// ---- errors ----

// A fault while the device runs work (a kernel, a cuBLAS call, a copy): thrown on the stream's
// worker, made sticky there, as a GPU's context is lost after such a fault.
struct DeviceFault {
  cudaError_t code;
  std::string message;
};

// Records `code` as this host thread's last error with its explanation (printed on stderr, and
// returned by cudaGetErrorString for that code), and returns it.
cudaError_t fail(cudaError_t code, const std::string& message);
// The sticky error (cudaSuccess while none): every later call reports it.
cudaError_t sticky_error();
void set_sticky_error(cudaError_t code, const std::string& message);
void clear_sticky_error();
// "kernel 'name' (file.cu:123)"
std::string describe_site(const LaunchSite& site);

// ---- memory ----

enum class MemoryKind { Device, PinnedHost };

struct Allocation {
  uintptr_t begin = 0;
  size_t bytes = 0;
  MemoryKind kind = MemoryKind::Device;
  bool user_registered = false;  // cudaHostRegister: the memory is not ours to free
};

// The allocation holding `pointer`, if the device knows it.
std::optional<Allocation> find_allocation(const void* pointer);
// Where `pointer` points, for messages: "device memory (byte 16 of a 256-byte allocation)",
// "pinned host memory ...", "host memory unknown to the device".
std::string describe_pointer(const void* pointer);
// Checks that [pointer, pointer + bytes) lies inside one allocation of `kind`; the error text
// names `what` (e.g. "cudaMemcpy destination").
std::optional<std::string> check_range(const void* pointer, size_t bytes, MemoryKind kind,
                                       const char* what);
size_t device_bytes_in_use();

// ---- streams ----

class Stream;

struct Dependency {
  std::shared_ptr<Stream> stream;
  uint64_t sequence;  // done when the stream has completed this many tasks
};

struct Task {
  std::function<void()> work;  // may throw DeviceFault
  std::vector<Dependency> waits;
  bool runs_after_fault = false;  // bookkeeping (event times, frees) that must happen anyway
};

// An in-order queue of device work run by its own worker thread, as a GPU stream runs
// asynchronously to the host.
class Stream {
 public:
  Stream(unsigned flags, bool legacy);
  ~Stream();
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  bool legacy() const { return legacy_; }
  // A blocking stream orders itself with the legacy default stream (cudaStreamDefault).
  bool blocking() const { return !legacy_ && (flags_ & cudaStreamNonBlocking) == 0; }
  uint64_t submit(Task task);  // returns the sequence number at which the task is done
  uint64_t submitted() const;
  bool reached(uint64_t sequence) const;
  void wait_until(uint64_t sequence) const;
  void drain() const { wait_until(submitted()); }

 private:
  void run();

  const unsigned flags_;
  const bool legacy_;
  mutable std::mutex mutex_;
  mutable std::condition_variable changed_;
  std::deque<Task> queue_;
  uint64_t submitted_ = 0;
  uint64_t completed_ = 0;
  bool stopping_ = false;
  std::thread worker_;
};

// The stream a handle names (nullptr and cudaStreamLegacy: the legacy default stream); empty
// for a handle that names no live stream.
std::shared_ptr<Stream> find_stream(cudaStream_t handle);
// Queues `task` on `stream` with the legacy default stream's implicit ordering added.
uint64_t enqueue(const std::shared_ptr<Stream>& stream, Task task);
// Waits until every stream has finished what was queued so far.
void synchronize_device();

// ---- kernels ----

// Runs every block of a launch on the calling thread (a stream's worker).
void run_kernel(const KernelLaunch& launch);
// The dynamic shared memory limit of a kernel (48 KiB unless raised by cudaFuncSetAttribute).
size_t max_dynamic_shared_bytes(const void* kernel);

// ---- the device's description ----

inline constexpr size_t kSharedMemoryPerBlock = 48 * 1024;
inline constexpr size_t kSharedMemoryPerBlockOptin = 99 * 1024;  // sm_86, as the RTX A6000
size_t device_memory_bytes();  // INFINIGEN_CUDA_EMULATION_MEMORY, 8 GiB by default
bool poison_enabled();         // INFINIGEN_CUDA_EMULATION_POISON=0 turns NaN poisoning off

}  // namespace infinigen::cuda_emulation
