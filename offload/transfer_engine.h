// offload: the transfer engine, host <-> device copies on the load (H2D) and store (D2H) streams.
//
// A transfer is a gather list of chunks moved as one operation (one DMA worth of bytes). Each
// direction has its own stream, as a PCIe link is full duplex. On the CPU backend the copies run
// on the streams' worker threads; link emulation makes a transfer of N bytes take at least
// latency + N / bandwidth, so the CPU backend shows the time a real link would take.
//
// With a trace active (core/trace.h) every transfer is recorded with its tag, what it waits for
// and the compute op it follows; the events it returns carry its op, so host waits on them are
// recorded too. In a dry run nothing is copied and the events are complete at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/device.h"
#include "core/stream.h"
#include "core/trace.h"

namespace infinigen {

struct CopyChunk {
  void* dst;
  const void* src;
  size_t bytes;
};

// Bytes a gather list moves.
uint64_t total_bytes(const std::vector<CopyChunk>& chunks);

// What a transfer is, for traces: its name, the layer it serves (-1: none) and what it carries.
struct TransferTag {
  const char* name = "transfer";
  int64_t layer = -1;
  TransferContent content = TransferContent::KvRange;
};

struct LinkEmulation {
  double gbps = 0.0;        // GB/s (1e9 bytes); 0 = no emulation (copies at memory speed)
  double latency_us = 0.0;  // per transfer
};

struct TransferCounters {
  uint64_t h2d_bytes = 0;
  uint64_t d2h_bytes = 0;
  uint64_t h2d_transfers = 0;
  uint64_t d2h_transfers = 0;
  double h2d_busy_seconds = 0.0;  // time the load stream spent transferring
  double d2h_busy_seconds = 0.0;
};

class TransferEngine {
 public:
  TransferEngine(Device device, LinkEmulation link);

  // Enqueues a host -> device transfer on the load stream, after `after` (if any) completes.
  // Returns the event of its completion. Chunks must stay valid until then.
  EventPtr load(std::vector<CopyChunk> chunks, EventPtr after = nullptr, TransferTag tag = {});
  // Device -> host, on the store stream.
  EventPtr store(std::vector<CopyChunk> chunks, EventPtr after = nullptr, TransferTag tag = {});

  Stream& load_stream() { return load_stream_; }
  Stream& store_stream() { return store_stream_; }
  // Waits for every transfer enqueued so far; rethrows a failed one.
  void synchronize();
  // Waits for every store enqueued so far; rethrows a failed one.
  void synchronize_stores();
  TransferCounters counters() const;  // totals since construction (thread-safe)
  const LinkEmulation& link() const { return link_; }

 private:
  EventPtr enqueue(Stream& stream, std::vector<CopyChunk> chunks, EventPtr after, bool to_device,
                   const TransferTag& tag);
  // Notes in the active trace that the host waits for the last transfer of each stream given.
  void trace_waits(bool loads, bool stores) const;

  Device device_;
  LinkEmulation link_;
  mutable std::mutex counters_mutex_;
  TransferCounters counters_;
  Stream load_stream_;
  Stream store_stream_;
  int32_t last_traced_load_ = -1;  // the active trace's op of the latest load / store
  int32_t last_traced_store_ = -1;
};

}  // namespace infinigen
