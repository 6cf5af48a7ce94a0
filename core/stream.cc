// core: streams and events on the CPU backend (a worker thread per stream, or inline).
//
// Failure semantics: the first exception thrown by a task poisons its stream for good. Later
// tasks are skipped, every event recorded afterwards completes with that exception, and every
// later `synchronize()` rethrows it again (not only the first one), so no caller can mistake a
// stream that lost work for a healthy one. A stream is not reset; make a new one.
#include "core/stream.h"

#include <chrono>
#include <utility>

#include "core/cuda_stream.h"
#include "core/error.h"
#include "core/op_profile.h"
#include "core/trace.h"

namespace infinigen {
namespace {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// Seconds the task running on this thread spent blocked in `Stream::wait`, which run() subtracts
// from busy time. Thread-local because inline streams run tasks on the caller's thread, where a
// task may itself enqueue onto another inline stream (run() saves and restores it around a task).
thread_local double t_waited_seconds = 0.0;

thread_local void* t_cuda_stream = nullptr;

}  // namespace

void* current_cuda_stream() {
  return t_cuda_stream;
}

CudaStreamScope::CudaStreamScope(void* stream) : previous_(std::exchange(t_cuda_stream, stream)) {}

CudaStreamScope::~CudaStreamScope() {
  t_cuda_stream = previous_;
}

Event::~Event() {
  if (cuda_event_ != nullptr) cuda_stream::release_event(cuda_event_);
}

void Event::wait() const {
  if (Trace* trace = active_trace()) trace->host_waits(traced_op_);
  profile_host_wait();
  if (cuda_event_ != nullptr) {
    cuda_stream::synchronize_event(cuda_event_);
    return;
  }
  std::unique_lock lock(mutex_);
  done_.wait(lock, [this] { return ready_; });
  if (failure_) std::rethrow_exception(failure_);
}

bool Event::ready() const {
  if (cuda_event_ != nullptr) return cuda_stream::ready(cuda_event_);
  std::lock_guard lock(mutex_);
  return ready_;
}

void Event::complete(std::exception_ptr failure) {
  INFINIGEN_CHECK(cuda_event_ == nullptr, "a CUDA event completes on the device, not by complete()");
  {
    std::lock_guard lock(mutex_);
    if (ready_) return;  // the first completion wins; waiters may already have seen it
    ready_ = true;
    failure_ = std::move(failure);
    completed_at_ = now_seconds();
  }
  done_.notify_all();
}

double Event::completed_at() const {
  std::lock_guard lock(mutex_);
  return completed_at_;
}

EventPtr completed_event() {
  static const EventPtr event = [] {
    auto e = std::make_shared<Event>();
    e->complete();
    return e;
  }();
  return event;
}

Stream::Stream(std::string name, Mode mode) : name_(std::move(name)), mode_(mode) {
  if (mode_ == Mode::Worker) worker_ = std::thread([this] { worker_loop(); });
  if (mode_ == Mode::Cuda) cuda_stream_ = cuda_stream::create_stream();
}

Stream::~Stream() {
  if (cuda_stream_ != nullptr) cuda_stream::destroy_stream(cuda_stream_);
  if (!worker_.joinable()) return;
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  has_work_.notify_one();
  worker_.join();  // the loop drains the queue first; tasks never let an exception escape
}

void Stream::enqueue(std::function<void()> task) {
  if (mode_ == Mode::Inline) {
    run(task);
    return;
  }
  if (mode_ == Mode::Cuda) {
    CudaStreamScope scope(cuda_stream_);  // what the task issues goes to this stream
    run(task);
    return;
  }
  // Wrapped in run() here rather than in the worker loop so that record()'s markers, which must
  // run even on a poisoned stream, can share the queue unwrapped.
  {
    std::lock_guard lock(mutex_);
    queue_.push_back([this, task = std::move(task)]() mutable { run(task); });
  }
  has_work_.notify_one();
}

EventPtr Stream::record() {
  if (mode_ == Mode::Cuda) {
    {
      std::lock_guard lock(mutex_);
      if (failure_) {  // the work before this point was skipped: the event carries the failure
        auto failed = std::make_shared<Event>();
        failed->complete(failure_);
        return failed;
      }
    }
    auto event = std::make_shared<Event>(cuda_stream::acquire_event());
    cuda_stream::record(event->cuda_event(), cuda_stream_);
    return event;
  }
  auto event = std::make_shared<Event>();
  if (mode_ == Mode::Inline) {
    std::lock_guard lock(mutex_);
    event->complete(failure_);
    return event;
  }
  // The marker is not wrapped in run(): it must complete the event even when the stream is
  // poisoned, and it reads the failure on the worker, after every task before it has run.
  {
    std::lock_guard lock(mutex_);
    queue_.push_back([this, event] {
      std::exception_ptr failure;
      {
        std::lock_guard inner(mutex_);
        failure = failure_;
      }
      event->complete(std::move(failure));
    });
  }
  has_work_.notify_one();
  return event;
}

void Stream::wait(EventPtr event) {
  if (!event) return;
  if (mode_ == Mode::Cuda && event->cuda_event() != nullptr) {
    cuda_stream::wait(cuda_stream_, event->cuda_event());  // the device waits, not the host
    return;
  }
  // A host event (or a host stream): a task that blocks until it completes, which on an inline
  // or Cuda stream is the caller, at once.
  enqueue([event = std::move(event)] {
    const double start = now_seconds();
    try {
      event->wait();
    } catch (...) {
      t_waited_seconds += now_seconds() - start;
      throw;  // the other stream's failure becomes this stream's failure
    }
    t_waited_seconds += now_seconds() - start;
  });
}

void Stream::synchronize() {
  INFINIGEN_CHECK(worker_.get_id() != std::this_thread::get_id(), "stream '", name_,
                  "': synchronize() called from one of its own tasks would never return");
  if (mode_ == Mode::Cuda) {
    profile_host_wait();
    cuda_stream::synchronize(cuda_stream_);
    std::lock_guard lock(mutex_);
    if (failure_) std::rethrow_exception(failure_);
    return;
  }
  record()->wait();
}

double Stream::busy_seconds() const {
  std::lock_guard lock(mutex_);
  return busy_seconds_;
}

void Stream::worker_loop() {
  for (;;) {
    std::function<void()> task;
    {
      std::unique_lock lock(mutex_);
      has_work_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and everything queued has run
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();  // a run() wrapper or a record() marker: neither lets an exception out
  }
}

void Stream::run(std::function<void()>& task) {
  {
    std::lock_guard lock(mutex_);
    if (failure_) return;
  }
  const double saved_waited = std::exchange(t_waited_seconds, 0.0);
  const double start = now_seconds();
  std::exception_ptr failure;
  try {
    task();
  } catch (...) {
    failure = std::current_exception();
  }
  const double elapsed = now_seconds() - start;
  const double waited = std::exchange(t_waited_seconds, saved_waited);
  std::lock_guard lock(mutex_);
  busy_seconds_ += elapsed > waited ? elapsed - waited : 0.0;
  if (failure && !failure_) failure_ = std::move(failure);
}

}  // namespace infinigen
