// core: host memory pinned ahead of need. Pinning is slow (cudaHostAlloc ran at 2.9 GB/s on an
// H200 machine, docs/gpu.md), and an offloading run pins its whole KV pool, tens of GB at large
// batches, during the prompt's pass, where it took half of the prefill. A PinAhead started as soon
// as the run's plan is known pins those buffers on a background thread while the weights load,
// and pinned_alloc (core/device.h) hands them out to the requests of that size.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <thread>
#include <vector>

namespace infinigen {

class PinAhead {
 public:
  // Starts pinning `count` buffers of `bytes` each with pinned_alloc. Nothing in a dry run, and
  // nothing when another PinAhead is active (one at a time: the first keeps its buffers).
  PinAhead(size_t count, size_t bytes);
  // Stops the thread after the buffer it is pinning and frees the buffers nobody took.
  ~PinAhead();
  PinAhead(const PinAhead&) = delete;
  PinAhead& operator=(const PinAhead&) = delete;

  // A buffer of `bytes` pinned ahead, waiting for the thread if the next is still on its way; null
  // when this PinAhead pins another size, every buffer has been taken, or pinning failed (the
  // caller then pins its own and reports its own error, e.g. INFINIGEN_PINNED_LIMIT).
  void* take(size_t bytes);
  size_t taken() const;  // buffers handed out so far

 private:
  void pin_all();

  const size_t count_;
  const size_t bytes_;
  mutable std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<void*> ready_;  // pinned, not yet taken
  size_t taken_ = 0;
  bool done_ = false;      // the thread has stopped: all pinned, failed, or asked to stop
  bool stopping_ = false;  // the destructor asks the thread to stop
  bool active_ = false;    // registered as the process's PinAhead
  std::thread thread_;
};

// The buffer of `bytes` an active PinAhead holds for it, or null (pinned_alloc's first step; null
// on the PinAhead's own thread).
void* take_pinned_ahead(size_t bytes);

}  // namespace infinigen
