// offload: the transfer engine: the layer pipeline's streams, and host <-> device copies on the
// load (H2D) and store (D2H) ones.
//
// Three streams (core/stream.h): compute, where the model's ops run; load; store. A transfer is
// a gather list of chunks moved as one operation. Each direction has its own stream, as a PCIe
// link is full duplex.
// - CPU backend: compute is inline (the caller's thread), the copies run on the transfer streams'
//   worker threads; link emulation makes a transfer of N bytes take at least latency +
//   N / bandwidth, so the CPU backend shows the time a real link would take.
// - CUDA: three non-blocking CUDA streams; a transfer is timed by a pair of device events. A
//   few large chunks (weights) go as one cudaMemcpyAsync each; a gather of many small ones (KV
//   rows and block runs) goes the way GatherMode says, a constant number of operations per
//   transfer whatever its chunk count. Every transfer is ordered after the compute work
//   enqueued before it (it reads what compute wrote, or overwrites what compute read), and
//   compute waits for a transfer with compute_waits(): a device-side wait, the host runs on.
// The same pipeline code drives both: only the streams differ.
//
// With a trace active (core/trace.h) every transfer is recorded with its tag, what it waits for
// and the compute op it follows; the events it returns carry its op, so host waits on them are
// recorded too. In a dry run nothing is copied and the events are complete at once.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "core/copy_chunk.h"
#include "core/device.h"
#include "core/stream.h"
#include "core/trace.h"

namespace infinigen {

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
// The slowest link and the longest latency an emulation accepts (OffloadOptions::validate).
inline constexpr double kMinEmulatedGbps = 1e-3;
inline constexpr double kMaxEmulatedLatencyUs = 1e6;

// How a CUDA transfer of many small chunks crosses the link (--gather).
enum class GatherMode {
  // Host threads pack the chunks into pinned staging, one cudaMemcpyAsync moves it, and a kernel
  // places the pieces on the device (stores: the reverse).
  Host,
  // A kernel reads (or, for stores, writes) the chunks straight from the mapped pinned pool: no
  // packing pass over host memory, the link carries only the rows.
  Device,
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
  TransferEngine(Device device, LinkEmulation link, GatherMode gather = GatherMode::Device);
  ~TransferEngine();

  // Enqueues a host -> device transfer on the load stream, after `after` (if any) completes.
  // Returns the event of its completion. Chunks must stay valid until then.
  EventPtr load(std::vector<CopyChunk> chunks, EventPtr after = nullptr, TransferTag tag = {});
  // Device -> host, on the store stream.
  EventPtr store(std::vector<CopyChunk> chunks, EventPtr after = nullptr, TransferTag tag = {});

  // A transfer that a kernel of the caller's makes, for what a chunk list cannot say because the
  // rows are known only on the device (h2o's store to the row its eviction chose; InfiniGen's
  // gather of the rows its speculation selected). `launch(stream)` enqueues the kernel on
  // `stream`, the load stream (load_by_kernel: host -> device) or the store stream
  // (store_by_kernel: device -> host), and returns 0 or a CUDA error code (kernels/cuda's
  // convention; an exception it throws is reported the same way). The kernel reads or writes
  // mapped pinned host memory (pinned_alloc) directly, as the device gather does. It is called
  // before the function returns, on the calling thread, with `stream` current (so the ops of
  // core/ops.h launch on it); what it captures need not outlive the call, the memory its kernel
  // touches must until the returned event completes.
  //
  // Everything else is as for a chunk list: the transfer waits for `after` (if any) and for the
  // compute enqueued before it; it counts `bytes` and one transfer in the counters, and its
  // device time (a pair of events around the launch) in the stream's busy time; with a trace
  // active it is recorded with its tag as a transfer of `bytes` in `rows` pieces (a chunk list's
  // chunks), so its price (predict/) is a gather's. Returns the event of its completion. In a dry
  // run nothing is launched and the event is complete at once. CUDA only: on the CPU backend,
  // whose transfers are host copies on worker threads, it fails.
  using KernelLaunch = std::function<int(void* stream)>;
  EventPtr load_by_kernel(const KernelLaunch& launch, uint64_t bytes, int64_t rows,
                          EventPtr after = nullptr, TransferTag tag = {});
  EventPtr store_by_kernel(const KernelLaunch& launch, uint64_t bytes, int64_t rows,
                           EventPtr after = nullptr, TransferTag tag = {});

  Stream& load_stream() { return load_stream_; }
  Stream& store_stream() { return store_stream_; }
  // Where the model's ops run. Ops launch on the current CUDA stream of their thread: make this
  // one current (CudaStreamScope(compute_stream().cuda_handle())) for a run.
  Stream& compute_stream() { return compute_stream_; }

  // Orders the compute stream after `event` (a transfer whose bytes the next ops read), adding
  // the time compute stalled on it to each of `stall` (seconds). On the CPU backend compute is
  // the caller, which blocks and measures at once; on CUDA the device waits, and the stall (from
  // the device's clocks: how long after compute reached the wait the transfer ended) is added by
  // settle_stalls().
  void compute_waits(EventPtr event, std::vector<double*> stall);
  // Adds the stalls of every compute_waits() so far, blocking until their events complete; call
  // it before the counters `stall` points into move (the next step's statistics open).
  void settle_stalls();
  // Sizes the CUDA gathers' persistent buffers for transfers of up to `chunks` pieces and `bytes`
  // in each direction, so that no later transfer allocates (a transfer beyond them grows them,
  // after draining its stream). Nothing on the CPU backend.
  void reserve_gathers(size_t chunks, size_t bytes);
  // Waits for every transfer enqueued so far; rethrows a failed one.
  void synchronize();
  // Waits for every store enqueued so far; rethrows a failed one.
  void synchronize_stores();
  TransferCounters counters() const;  // totals since construction (thread-safe)
  const LinkEmulation& link() const { return link_; }

 private:
  EventPtr enqueue(Stream& stream, std::vector<CopyChunk> chunks, EventPtr after, bool to_device,
                   const TransferTag& tag);
  EventPtr enqueue_kernel(Stream& stream, const KernelLaunch& launch, uint64_t bytes, int64_t rows,
                          EventPtr after, bool to_device, const TransferTag& tag);
  // Records a transfer of `bytes` in `pieces` in the active trace (if any); its op, or -1.
  int32_t trace_transfer(bool to_device, const TransferTag& tag, uint64_t bytes, int64_t pieces,
                         const EventPtr& after);
  // A dry run's transfer: counted, and complete at once.
  EventPtr dry_transfer(bool to_device, uint64_t bytes, int32_t traced_op);
  // Ends a CUDA transfer started at `start` on `stream`: its completion event, its bytes and
  // device time in the counters.
  EventPtr end_cuda_transfer(Stream& stream, EventPtr start, bool to_device, uint64_t bytes,
                             int32_t traced_op);
  // Adds to the counters the device time of the CUDA transfers that have completed.
  void settle_transfer_times() const;

  // The persistent buffers of one direction's CUDA gathers, used in that stream's order.
  struct GatherBuffers {
    // Mapped pinned: the gather kernel's lists, kListSlots of piece_capacity pieces. The device
    // gather's caller writes slot i (in turn) once the kernel that read it last has run
    // (list_read[i]): no host function on the stream, which would hold the link idle while it
    // wrote the list. The host gather's host functions use slot 0.
    static constexpr size_t kListSlots = 4;
    CopyChunk* pieces = nullptr;
    size_t piece_capacity = 0;
    std::array<EventPtr, kListSlots> list_read;
    size_t next_list = 0;
    char* packed = nullptr;   // pinned (GatherMode::Host): the chunks back to back
    char* landing = nullptr;  // device (GatherMode::Host): the packed bytes on the device
    size_t byte_capacity = 0;
  };
  // Grows `buffers` to `chunks` pieces and `bytes` packed bytes, after draining `stream`.
  void grow_gather(GatherBuffers& buffers, Stream& stream, size_t chunks, size_t bytes);
  // Enqueues a gather of `chunks` on the CUDA `stream` (GatherMode).
  void enqueue_gather(Stream& stream, GatherBuffers& buffers, std::vector<CopyChunk> chunks,
                      uint64_t bytes, bool to_device);
  // Notes in the active trace that the host waits for the last transfer of each stream given.
  void trace_waits(bool loads, bool stores) const;

  // A CUDA transfer's start and end on its stream, for its device time.
  struct TimedTransfer {
    EventPtr start, end;
    bool to_device;
  };
  // A compute wait on CUDA: compute reached `reached`, then waited for `awaited`.
  struct PendingStall {
    EventPtr reached, awaited;
    std::vector<double*> stall;
  };

  Device device_;
  LinkEmulation link_;
  GatherMode gather_;
  bool cuda_;  // the streams are CUDA streams (a CUDA device, not a dry run)
  mutable std::mutex counters_mutex_;
  mutable TransferCounters counters_;
  mutable std::vector<TimedTransfer> timed_;  // CUDA transfers not yet in the counters' times
  std::vector<PendingStall> stalls_;
  GatherBuffers load_gather_, store_gather_;
  Stream compute_stream_;
  Stream load_stream_;
  Stream store_stream_;
  int32_t last_traced_load_ = -1;  // the active trace's op of the latest load / store
  int32_t last_traced_store_ = -1;
};

}  // namespace infinigen
