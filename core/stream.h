// core: streams and events, the ordering primitives of the layer pipeline.
//
// A Stream runs tasks in the order they were enqueued; an Event marks a point in a stream and
// completes when every task enqueued before it has run. `Stream::wait(event)` orders later tasks
// of one stream after a point of another, without blocking the host, so loads, stores and compute
// overlap and only real dependencies serialise them (no device-wide synchronisation).
//
// Three kinds of stream run the same pipeline code:
// - Worker (CPU backend): a worker thread with a FIFO queue (the load and store streams);
// - Inline (CPU backend): tasks run on the calling thread at enqueue time (the compute stream,
//   whose kernels already use OpenMP); waiting on an event blocks the caller;
// - Cuda: a non-blocking cudaStream_t. A task runs on the calling thread at enqueue time with the
//   stream current (core/stream.h's current_cuda_stream), so the kernels and async copies it
//   issues are queued on the device stream; record() records a device event and wait() makes the
//   device stream wait for one, so the host never blocks on them.
// A task that throws poisons its stream: the exception is rethrown to the host by the next
// `synchronize()` or `Event::wait()` that depends on it, never lost and never a crash.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace infinigen {

class Event {
 public:
  Event() = default;
  // An event recorded on a Cuda stream: it completes when the device reaches it. Takes the CUDA
  // event (from cuda_stream::acquire_event) and gives it back when destroyed.
  explicit Event(void* cuda_event) : cuda_event_(cuda_event) {}
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  // Blocks the calling thread until the event completes; rethrows a failure of the task stream
  // it was recorded on.
  void wait() const;
  bool ready() const;
  // Completes a host event (failure = the exception of a task before it, or null).
  void complete(std::exception_ptr failure = nullptr);
  // Seconds since the steady clock's epoch at completion (0 before, and for a CUDA event, whose
  // times are the device's: cuda_stream::elapsed_seconds); for statistics.
  double completed_at() const;
  // The CUDA event of an event recorded on a Cuda stream; null for a host event.
  void* cuda_event() const { return cuda_event_; }
  // The op of a trace (core/trace.h) whose end this event marks, or -1; waiting on the event
  // from the thread that records the trace notes the dependency.
  int32_t traced_op() const { return traced_op_; }
  void set_traced_op(int32_t op) { traced_op_ = op; }

 private:
  mutable std::mutex mutex_;
  mutable std::condition_variable done_;
  bool ready_ = false;
  std::exception_ptr failure_;
  double completed_at_ = 0.0;
  int32_t traced_op_ = -1;
  void* cuda_event_ = nullptr;
};

using EventPtr = std::shared_ptr<Event>;

// The CUDA stream (a cudaStream_t, type-erased) on which the ops called on this thread launch
// their kernels: the compute stream of the run in progress, or null (CUDA's legacy default
// stream) outside one. Host code reads it; only the CUDA backend dereferences it.
void* current_cuda_stream();

// Makes `stream` the current CUDA stream of this thread until the scope ends (then restores the
// previous one).
class CudaStreamScope {
 public:
  explicit CudaStreamScope(void* stream);
  ~CudaStreamScope();
  CudaStreamScope(const CudaStreamScope&) = delete;
  CudaStreamScope& operator=(const CudaStreamScope&) = delete;

 private:
  void* previous_;
};

// An event that is already complete (for "no dependency").
EventPtr completed_event();

class Stream {
 public:
  enum class Mode { Worker, Inline, Cuda };
  explicit Stream(std::string name, Mode mode = Mode::Worker);
  ~Stream();  // runs what is queued, then joins the worker (or lets the device stream drain)
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  const std::string& name() const { return name_; }
  Mode mode() const { return mode_; }
  // The cudaStream_t of a Cuda stream; null for the others.
  void* cuda_handle() const { return cuda_stream_; }
  void enqueue(std::function<void()> task);
  // An event completed once every task enqueued so far has run.
  EventPtr record();
  // Tasks enqueued after this call start only once `event` is complete.
  void wait(EventPtr event);
  // Blocks until every task enqueued so far has run; rethrows the first task failure.
  void synchronize();
  // Wall-clock seconds spent running tasks (waits excluded), since construction. For a Cuda
  // stream, the host's time issuing them (the device's time is measured with events).
  double busy_seconds() const;

 private:
  void worker_loop();
  void run(std::function<void()>& task);

  std::string name_;
  Mode mode_;
  mutable std::mutex mutex_;
  std::condition_variable has_work_;
  std::deque<std::function<void()>> queue_;
  bool stopping_ = false;
  std::exception_ptr failure_;  // first failure; later tasks are skipped
  double busy_seconds_ = 0.0;
  std::thread worker_;
  void* cuda_stream_ = nullptr;  // Mode::Cuda
};

}  // namespace infinigen
