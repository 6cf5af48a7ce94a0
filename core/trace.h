// core: a trace of a run, op by op: every op the forward pass and the KV policy run (its name and
// sizes), every transfer (its bytes, what it carries, the layer it serves, what it waits for) and
// every wait of the host thread. The cost model (predict/) turns a trace into its schedule, so
// what it prices is what the runtime did, not a description kept beside it.
//
// A trace is recorded by the thread that installs it (TraceScope): the host thread that runs the
// ops and enqueues the transfers. A dry trace records without computing: tensors have shapes but
// no memory (their addresses lie in a reserved range that faults on any access), ops and copies
// only record themselves, and host work of the policies (speculation, scoring) records itself
// instead of running. A dry run of OPT-13B at batch 20 therefore takes seconds and no memory,
// and gives the schedule the real run would have, which tests check on small models.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "core/dtype.h"

namespace infinigen {

// Read: a session's history read from the disk into host memory (offload/session.h).
enum class TracedKind : uint8_t { Compute, Load, Store, Read };

// What a transfer carries, as the cost model prices it.
enum class TransferContent : uint8_t {
  KvRange,  // runs of consecutive KV rows (a layer's whole KV, a block, a kept range)
  KvRows,   // KV rows picked one by one (InfiniGen's selection): a gather
  Weights,  // a layer's streamed weights
};

struct TracedOp {
  TracedKind kind = TracedKind::Compute;
  const char* name = "";  // a static string: the op ("linear") or the transfer ("kv_load")
  int32_t step = 0;       // 0: the prefill, then each decode step
  int32_t layer = -1;     // -1: no layer's (embedding, LM head, sampling)
  // Compute: the op's sizes and element type, as core/ops.h (and the policies' host work) name
  // them, e.g. linear {rows, out_features, in_features} with the weights' dtype.
  std::array<int64_t, 5> sizes{};
  DType dtype = DType::F32;
  // Transfers.
  uint64_t bytes = 0;
  int64_t chunks = 0;  // pieces of its gather list
  TransferContent content = TransferContent::KvRange;
  std::vector<int32_t> deps;  // ops that finish first (the previous op of its lane aside)
};

class Trace {
 public:
  explicit Trace(bool dry) : dry_(dry) {}

  bool dry() const { return dry_; }
  const std::vector<TracedOp>& ops() const { return ops_; }

  void set_step(int64_t step) { step_ = static_cast<int32_t>(step); }
  void set_layer(int64_t layer) { layer_ = static_cast<int32_t>(layer); }

  // A compute op of the current step and layer; the host waits noted since the previous compute
  // op become its dependencies. Returns its index.
  int32_t compute(const char* name, std::array<int64_t, 5> sizes, DType dtype);
  // A transfer enqueued now (after the last compute op and the host's waits since) on the lane
  // of `kind`, ordered after op `after` (-1: none).
  int32_t transfer(TracedKind kind, const char* name, int64_t layer, uint64_t bytes, int64_t chunks,
                   TransferContent content, int32_t after);
  // The host thread waits for op `op` (-1: nothing).
  void host_waits(int32_t op);
  // KV bytes the run's host pool held at its end (recorded by the runtime; 0: no pool).
  uint64_t host_kv_bytes() const { return host_kv_bytes_; }
  void set_host_kv_bytes(uint64_t bytes) { host_kv_bytes_ = bytes; }

 private:
  bool dry_;
  uint64_t host_kv_bytes_ = 0;
  int32_t step_ = 0;
  int32_t layer_ = -1;
  int32_t last_compute_ = -1;
  std::vector<int32_t> waits_;
  std::vector<TracedOp> ops_;
};

// The trace the calling thread records into, or null.
Trace* active_trace();
// Whether the calling thread records a dry trace (nothing is computed, copied or allocated).
bool dry_run();

// Installs `trace` for the calling thread for the scope's lifetime.
class TraceScope {
 public:
  explicit TraceScope(Trace& trace);
  ~TraceScope();
  TraceScope(const TraceScope&) = delete;
  TraceScope& operator=(const TraceScope&) = delete;

 private:
  Trace* previous_;
};

// The step (0: the prefill) and the layer (-1: none) that ops recorded from now on belong to,
// when a trace is active.
// Also where an op profile (core/op_profile.h) starts its step.
void trace_step(int64_t step);
inline void trace_layer(int64_t layer) {
  if (Trace* trace = active_trace()) trace->set_layer(layer);
}

// Records a compute op into the active trace, if any. Returns true when the caller must not
// compute it (a dry run).
bool traced(const char* name, std::array<int64_t, 5> sizes, DType dtype = DType::F32);
// The same, with the sizes computed by `sizes()` only when a trace records them (where they cost
// a pass over the batch).
template <typename Sizes>
bool traced_lazily(const char* name, Sizes sizes, DType dtype = DType::F32) {
  return traced(name, active_trace() != nullptr ? sizes() : std::array<int64_t, 5>{}, dtype);
}

// Where a dry allocation of any size points: an address range reserved without access rights,
// so that a dry run that reads or writes data faults at once instead of computing garbage.
void* dry_address();
// Whether `pointer` is dry_address(), without reserving it (for frees, which must not throw).
bool is_dry_address(const void* pointer) noexcept;

}  // namespace infinigen
