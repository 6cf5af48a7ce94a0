// kernels/cuda/emulation: streams and events. Each stream is an ordered queue run by its own
// worker thread, so that work queued on two streams really runs at the same time and a missing
// dependency between them shows as wrong data, as it would on a GPU. A task waits for the
// dependencies it was queued with: an event's position on another stream (cudaStreamWaitEvent),
// and the legacy default stream's implicit ordering with blocking streams (work on the null
// stream waits for all blocking streams, and work on a blocking stream waits for the null
// stream). An event is a position on a stream: "recorded" once the stream has run up to it.
#include <chrono>
#include <map>
#include <mutex>
#include <string>

#include "kernels/cuda/emulation/device_state.h"

struct CUstream_st {};  // the handle's type; a handle is the address of its Stream
struct CUevent_st {};

namespace infinigen::cuda_emulation {
namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

struct EventState {
  unsigned flags = 0;
  std::shared_ptr<Stream> stream;  // empty until recorded
  uint64_t sequence = 0;
  std::shared_ptr<std::atomic<int64_t>> time_ns;  // set when the stream reaches the record
};

struct Streams {
  std::mutex mutex;
  std::shared_ptr<Stream> legacy;
  std::map<cudaStream_t, std::shared_ptr<Stream>> streams;
  std::map<cudaEvent_t, std::shared_ptr<EventState>> events;
};
Streams& streams() {
  static auto* state = new Streams;  // never destroyed, with the workers it owns
  return *state;
}

std::shared_ptr<Stream> legacy_locked(Streams& s) {
  if (!s.legacy) s.legacy = std::make_shared<Stream>(cudaStreamDefault, true);
  return s.legacy;
}

std::shared_ptr<EventState> find_event(cudaEvent_t handle) {
  Streams& s = streams();
  std::lock_guard<std::mutex> lock(s.mutex);
  auto it = s.events.find(handle);
  return it == s.events.end() ? nullptr : it->second;
}

cudaError_t check_sticky() {
  return sticky_error();
}

}  // namespace

Stream::Stream(unsigned flags, bool legacy)
    : flags_(flags), legacy_(legacy), worker_([this] { run(); }) {}

Stream::~Stream() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  // The last reference may go with a task on this very worker (a wait on its own event).
  if (worker_.get_id() == std::this_thread::get_id()) {
    worker_.detach();
  } else {
    worker_.join();
  }
}

uint64_t Stream::submit(Task task) {
  std::lock_guard<std::mutex> lock(mutex_);
  queue_.push_back(std::move(task));
  changed_.notify_all();
  return ++submitted_;
}

uint64_t Stream::submitted() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return submitted_;
}

bool Stream::reached(uint64_t sequence) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return completed_ >= sequence;
}

void Stream::wait_until(uint64_t sequence) const {
  std::unique_lock<std::mutex> lock(mutex_);
  changed_.wait(lock, [&] { return completed_ >= sequence; });
}

void Stream::run() {
  for (;;) {
    Task task;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      changed_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and everything queued has run
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    for (const Dependency& d : task.waits) d.stream->wait_until(d.sequence);
    if (task.runs_after_fault || sticky_error() == cudaSuccess) {
      try {
        task.work();
      } catch (const DeviceFault& fault) {
        set_sticky_error(fault.code, fault.message);
      } catch (const std::exception& e) {
        set_sticky_error(cudaErrorUnknown, std::string("device work threw: ") + e.what());
      }
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++completed_;
    }
    changed_.notify_all();
  }
}

std::shared_ptr<Stream> find_stream(cudaStream_t handle) {
  Streams& s = streams();
  std::lock_guard<std::mutex> lock(s.mutex);
  // The per-thread default stream is served by the legacy one: stricter ordering, same results.
  if (handle == nullptr || handle == cudaStreamLegacy || handle == cudaStreamPerThread) {
    return legacy_locked(s);
  }
  auto it = s.streams.find(handle);
  return it == s.streams.end() ? nullptr : it->second;
}

uint64_t enqueue(const std::shared_ptr<Stream>& stream, Task task) {
  Streams& s = streams();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (stream->legacy()) {
    for (const auto& [handle, other] : s.streams) {
      if (other->blocking()) task.waits.push_back({other, other->submitted()});
    }
  } else if (stream->blocking()) {
    const std::shared_ptr<Stream> legacy = legacy_locked(s);
    task.waits.push_back({legacy, legacy->submitted()});
  }
  return stream->submit(std::move(task));
}

void synchronize_device() {
  std::vector<std::pair<std::shared_ptr<Stream>, uint64_t>> positions;
  {
    Streams& s = streams();
    std::lock_guard<std::mutex> lock(s.mutex);
    positions.emplace_back(legacy_locked(s), 0);
    for (const auto& [handle, stream] : s.streams) positions.emplace_back(stream, 0);
    for (auto& [stream, position] : positions) position = stream->submitted();
  }
  for (const auto& [stream, position] : positions) stream->wait_until(position);
}

}  // namespace infinigen::cuda_emulation

namespace emu = infinigen::cuda_emulation;

cudaError_t cudaStreamCreate(cudaStream_t* stream) {
  return cudaStreamCreateWithFlags(stream, cudaStreamDefault);
}

cudaError_t cudaStreamCreateWithFlags(cudaStream_t* handle, unsigned int flags) {
  if (handle == nullptr || (flags & ~1u) != 0) {
    return emu::fail(cudaErrorInvalidValue, "cudaStreamCreateWithFlags: bad arguments");
  }
  if (const cudaError_t s = emu::check_sticky(); s != cudaSuccess) return s;
  auto stream = std::make_shared<emu::Stream>(flags, false);
  *handle = reinterpret_cast<cudaStream_t>(stream.get());
  emu::Streams& s = emu::streams();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.streams[*handle] = std::move(stream);
  return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t handle) {
  std::shared_ptr<emu::Stream> stream;
  {
    emu::Streams& s = emu::streams();
    std::lock_guard<std::mutex> lock(s.mutex);
    auto it = s.streams.find(handle);
    if (it == s.streams.end()) {
      return emu::fail(cudaErrorInvalidResourceHandle, "cudaStreamDestroy: unknown stream");
    }
    stream = std::move(it->second);
    s.streams.erase(it);
  }
  // Work already queued still runs (the last reference, in a task waiting on it or here, joins
  // the worker once it has drained the queue).
  stream->drain();
  return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t handle) {
  const std::shared_ptr<emu::Stream> stream = emu::find_stream(handle);
  if (!stream) {
    return emu::fail(cudaErrorInvalidResourceHandle, "cudaStreamSynchronize: unknown stream");
  }
  stream->drain();
  return emu::sticky_error();
}

cudaError_t cudaStreamQuery(cudaStream_t handle) {
  const std::shared_ptr<emu::Stream> stream = emu::find_stream(handle);
  if (!stream) return emu::fail(cudaErrorInvalidResourceHandle, "cudaStreamQuery: unknown stream");
  if (const cudaError_t s = emu::sticky_error(); s != cudaSuccess) return s;
  return stream->reached(stream->submitted()) ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaStreamWaitEvent(cudaStream_t handle, cudaEvent_t event, unsigned int) {
  const std::shared_ptr<emu::Stream> stream = emu::find_stream(handle);
  if (!stream) {
    return emu::fail(cudaErrorInvalidResourceHandle, "cudaStreamWaitEvent: unknown stream");
  }
  const std::shared_ptr<emu::EventState> state = emu::find_event(event);
  if (!state)
    return emu::fail(cudaErrorInvalidResourceHandle, "cudaStreamWaitEvent: unknown event");
  if (!state->stream) return cudaSuccess;  // never recorded: nothing to wait for, as in CUDA
  emu::enqueue(stream, emu::Task{[] {}, {{state->stream, state->sequence}}, true});
  return cudaSuccess;
}

cudaError_t cudaLaunchHostFunc(cudaStream_t handle, cudaHostFn_t fn, void* user_data) {
  const std::shared_ptr<emu::Stream> stream = emu::find_stream(handle);
  if (!stream || fn == nullptr) {
    return emu::fail(cudaErrorInvalidResourceHandle, "cudaLaunchHostFunc: unknown stream");
  }
  if (const cudaError_t s = emu::check_sticky(); s != cudaSuccess) return s;
  emu::enqueue(stream, emu::Task{[fn, user_data] { fn(user_data); }, {}, false});
  return cudaSuccess;
}

cudaError_t cudaStreamAddCallback(cudaStream_t handle, cudaStreamCallback_t callback,
                                  void* user_data, unsigned int) {
  const std::shared_ptr<emu::Stream> stream = emu::find_stream(handle);
  if (!stream || callback == nullptr) {
    return emu::fail(cudaErrorInvalidResourceHandle, "cudaStreamAddCallback: unknown stream");
  }
  // Called even after a fault, with the error, as CUDA does.
  emu::enqueue(stream, emu::Task{[handle, callback, user_data] {
                                   callback(handle, emu::sticky_error(), user_data);
                                 },
                                 {},
                                 true});
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* event) {
  return cudaEventCreateWithFlags(event, cudaEventDefault);
}

cudaError_t cudaEventCreateWithFlags(cudaEvent_t* handle, unsigned int flags) {
  if (handle == nullptr || (flags & ~3u) != 0) {
    return emu::fail(cudaErrorInvalidValue, "cudaEventCreateWithFlags: bad arguments");
  }
  auto state = std::make_shared<emu::EventState>();
  state->flags = flags;
  *handle = reinterpret_cast<cudaEvent_t>(state.get());
  emu::Streams& s = emu::streams();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.events[*handle] = std::move(state);
  return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t handle) {
  emu::Streams& s = emu::streams();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.events.erase(handle) == 0) {
    return emu::fail(cudaErrorInvalidResourceHandle, "cudaEventDestroy: unknown event");
  }
  return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t handle) {
  const std::shared_ptr<emu::EventState> state = emu::find_event(event);
  if (!state) return emu::fail(cudaErrorInvalidResourceHandle, "cudaEventRecord: unknown event");
  const std::shared_ptr<emu::Stream> stream = emu::find_stream(handle);
  if (!stream) return emu::fail(cudaErrorInvalidResourceHandle, "cudaEventRecord: unknown stream");
  auto time = std::make_shared<std::atomic<int64_t>>(0);
  const uint64_t sequence =
      emu::enqueue(stream, emu::Task{[time] { time->store(emu::now_ns()); }, {}, true});
  emu::Streams& s = emu::streams();
  std::lock_guard<std::mutex> lock(s.mutex);
  state->stream = stream;
  state->sequence = sequence;
  state->time_ns = std::move(time);
  return cudaSuccess;
}

namespace {

struct Recorded {
  std::shared_ptr<emu::Stream> stream;
  uint64_t sequence = 0;
  std::shared_ptr<std::atomic<int64_t>> time_ns;
  unsigned flags = 0;
};
std::optional<Recorded> recorded(cudaEvent_t event) {
  const std::shared_ptr<emu::EventState> state = emu::find_event(event);
  if (!state) return std::nullopt;
  std::lock_guard<std::mutex> lock(emu::streams().mutex);
  return Recorded{state->stream, state->sequence, state->time_ns, state->flags};
}

}  // namespace

cudaError_t cudaEventQuery(cudaEvent_t event) {
  const std::optional<Recorded> r = recorded(event);
  if (!r) return emu::fail(cudaErrorInvalidResourceHandle, "cudaEventQuery: unknown event");
  if (const cudaError_t s = emu::sticky_error(); s != cudaSuccess) return s;
  if (!r->stream) return cudaSuccess;
  return r->stream->reached(r->sequence) ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  const std::optional<Recorded> r = recorded(event);
  if (!r) return emu::fail(cudaErrorInvalidResourceHandle, "cudaEventSynchronize: unknown event");
  if (r->stream) r->stream->wait_until(r->sequence);
  return emu::sticky_error();
}

cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) {
  const std::optional<Recorded> a = recorded(start), b = recorded(end);
  if (ms == nullptr || !a || !b) {
    return emu::fail(cudaErrorInvalidResourceHandle, "cudaEventElapsedTime: unknown event");
  }
  if ((a->flags | b->flags) & cudaEventDisableTiming) {
    return emu::fail(cudaErrorInvalidResourceHandle,
                     "cudaEventElapsedTime: an event was created with cudaEventDisableTiming");
  }
  if (!a->stream || !b->stream) {
    return emu::fail(cudaErrorInvalidResourceHandle,
                     "cudaEventElapsedTime: an event was never recorded");
  }
  if (!a->stream->reached(a->sequence) || !b->stream->reached(b->sequence))
    return cudaErrorNotReady;
  *ms = static_cast<float>(static_cast<double>(b->time_ns->load() - a->time_ns->load()) / 1e6);
  return emu::sticky_error();
}
