// offload: the transfer engine, one stream task per gather list, with optional link emulation.
#include "offload/transfer_engine.h"

#include <chrono>
#include <cmath>
#include <cstring>
#include <thread>
#include <utility>

#include "core/error.h"

namespace infinigen {

namespace {

using Clock = std::chrono::steady_clock;

// How long a real link would need for `bytes`: latency + bytes / bandwidth. The two terms are
// independent so a latency-only or bandwidth-only link can be emulated.
Clock::duration link_time(const LinkEmulation& link, uint64_t bytes) {
  double seconds = link.latency_us * 1e-6;
  if (link.gbps > 0.0) seconds += static_cast<double>(bytes) / (link.gbps * 1e9);
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

}  // namespace

uint64_t total_bytes(const std::vector<CopyChunk>& chunks) {
  uint64_t total = 0;
  for (const CopyChunk& chunk : chunks) total += chunk.bytes;
  return total;
}

TransferEngine::TransferEngine(Device device, LinkEmulation link)
    : device_(device),
      link_(link),
      load_stream_("load", Stream::Mode::Worker),
      store_stream_("store", Stream::Mode::Worker) {
  INFINIGEN_CHECK(std::isfinite(link.gbps) && link.gbps >= 0.0, "link emulation: bandwidth ",
                  link.gbps, " GB/s is not a non-negative number");
  INFINIGEN_CHECK(std::isfinite(link.latency_us) && link.latency_us >= 0.0,
                  "link emulation: latency ", link.latency_us, " us is not a non-negative number");
  // Fail here rather than inside the first copy task, where it would surface only at the next
  // synchronize().
  if (device == Device::Cuda && !cuda_compiled() && !dry_run()) throw_cuda_not_compiled();
}

EventPtr TransferEngine::load(std::vector<CopyChunk> chunks, EventPtr after, TransferTag tag) {
  return enqueue(load_stream_, std::move(chunks), std::move(after), true, tag);
}

EventPtr TransferEngine::store(std::vector<CopyChunk> chunks, EventPtr after, TransferTag tag) {
  return enqueue(store_stream_, std::move(chunks), std::move(after), false, tag);
}

void TransferEngine::trace_waits(bool loads, bool stores) const {
  Trace* trace = active_trace();
  if (trace == nullptr) return;
  if (loads) trace->host_waits(last_traced_load_);
  if (stores) trace->host_waits(last_traced_store_);
}

void TransferEngine::synchronize_stores() {
  trace_waits(false, true);
  store_stream_.synchronize();
}

void TransferEngine::synchronize() {
  trace_waits(true, true);
  // Both streams are drained before a failure of either is reported, so no copy is still
  // running on a buffer the caller frees while handling the error.
  std::exception_ptr failure;
  for (Stream* stream : {&load_stream_, &store_stream_}) {
    try {
      stream->synchronize();
    } catch (...) {
      if (!failure) failure = std::current_exception();
    }
  }
  if (failure) std::rethrow_exception(failure);
}

TransferCounters TransferEngine::counters() const {
  std::lock_guard lock(counters_mutex_);
  return counters_;
}

EventPtr TransferEngine::enqueue(Stream& stream, std::vector<CopyChunk> chunks, EventPtr after,
                                 bool to_device, const TransferTag& tag) {
  uint64_t bytes = 0;
  for (const CopyChunk& chunk : chunks) {
    INFINIGEN_CHECK(chunk.bytes == 0 || (chunk.dst != nullptr && chunk.src != nullptr),
                    "transfer on stream '", stream.name(), "': a chunk of ", chunk.bytes,
                    " bytes has a null pointer");
    bytes += chunk.bytes;
  }
  int32_t traced_op = -1;
  if (Trace* trace = active_trace()) {
    traced_op = trace->transfer(to_device ? TracedKind::Load : TracedKind::Store, tag.name,
                                tag.layer, bytes, static_cast<int64_t>(chunks.size()), tag.content,
                                after ? after->traced_op() : -1);
    (to_device ? last_traced_load_ : last_traced_store_) = traced_op;
    if (trace->dry()) {
      std::lock_guard lock(counters_mutex_);
      (to_device ? counters_.h2d_bytes : counters_.d2h_bytes) += bytes;
      (to_device ? counters_.h2d_transfers : counters_.d2h_transfers) += 1;
      auto done = std::make_shared<Event>();
      done->complete();
      done->set_traced_op(traced_op);
      return done;
    }
  }
  if (after) stream.wait(std::move(after));
  const Device dst_device = to_device ? device_ : Device::Cpu;
  const Device src_device = to_device ? Device::Cpu : device_;
  stream.enqueue([this, chunks = std::move(chunks), bytes, to_device, dst_device, src_device] {
    // Emulation is measured from the task's own start, not from enqueue, so time spent queued
    // behind other transfers or waiting on `after` is not counted as link time.
    const Clock::time_point start = Clock::now();
    if (device_ == Device::Cpu) {
      // This thread copies alone, even a gather of thousands of rows: on the CPU backend the
      // device's compute already runs an OpenMP team on every core, and a second team here
      // fights it for them (InfiniGen's decode at batch 9 ran 15% slower with one).
      for (const CopyChunk& chunk : chunks) {
        if (chunk.bytes != 0) std::memcpy(chunk.dst, chunk.src, chunk.bytes);
      }
    } else {
      for (const CopyChunk& chunk : chunks) {
        if (chunk.bytes != 0)
          device_copy(chunk.dst, dst_device, chunk.src, src_device, chunk.bytes);
      }
    }
    if (link_.gbps > 0.0 || link_.latency_us > 0.0) {
      std::this_thread::sleep_until(start + link_time(link_, bytes));
    }
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    std::lock_guard lock(counters_mutex_);
    if (to_device) {
      counters_.h2d_bytes += bytes;
      counters_.h2d_transfers += 1;
      counters_.h2d_busy_seconds += seconds;
    } else {
      counters_.d2h_bytes += bytes;
      counters_.d2h_transfers += 1;
      counters_.d2h_busy_seconds += seconds;
    }
  });
  EventPtr done = stream.record();
  done->set_traced_op(traced_op);
  return done;
}

}  // namespace infinigen
