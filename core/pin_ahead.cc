// core: pinning host memory ahead of need on a background thread.
#include "core/pin_ahead.h"

#include <atomic>

#include "core/device.h"
#include "core/trace.h"

namespace infinigen {
namespace {

std::atomic<PinAhead*> g_active{nullptr};
// Set on a PinAhead's thread: its own pinned_alloc calls must pin, not take from it.
thread_local bool t_pinning_ahead = false;

}  // namespace

PinAhead::PinAhead(size_t count, size_t bytes) : count_(count), bytes_(bytes) {
  if (count == 0 || dry_run()) {
    done_ = true;
    return;
  }
  PinAhead* none = nullptr;
  active_ = g_active.compare_exchange_strong(none, this);
  if (!active_) {
    done_ = true;
    return;
  }
  thread_ = std::thread([this] { pin_all(); });
}

PinAhead::~PinAhead() {
  if (active_) g_active.store(nullptr);
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  if (thread_.joinable()) thread_.join();
  for (void* buffer : ready_) pinned_free(buffer);
}

void PinAhead::pin_all() {
  t_pinning_ahead = true;
  for (size_t i = 0; i < count_; ++i) {
    {
      std::lock_guard lock(mutex_);
      if (stopping_) break;
    }
    void* buffer = nullptr;
    try {
      buffer = pinned_alloc(bytes_, "a KV pool block pinned ahead");
    } catch (...) {
      break;  // the caller pins its own and gets the error in its words
    }
    std::lock_guard lock(mutex_);
    ready_.push_back(buffer);
    changed_.notify_all();
  }
  std::lock_guard lock(mutex_);
  done_ = true;
  changed_.notify_all();
}

void* PinAhead::take(size_t bytes) {
  if (bytes != bytes_) return nullptr;
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [this] { return !ready_.empty() || done_; });
  if (ready_.empty()) return nullptr;
  void* buffer = ready_.back();
  ready_.pop_back();
  ++taken_;
  return buffer;
}

size_t PinAhead::taken() const {
  std::lock_guard lock(mutex_);
  return taken_;
}

void* take_pinned_ahead(size_t bytes) {
  if (t_pinning_ahead) return nullptr;
  PinAhead* active = g_active.load();
  return active != nullptr ? active->take(bytes) : nullptr;
}

}  // namespace infinigen
