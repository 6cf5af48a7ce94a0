// core: recording traces.
#include "core/trace.h"

#include <sys/mman.h>

#include <atomic>
#include <utility>

#include "core/error.h"
#include "core/op_profile.h"

namespace infinigen {
namespace {

thread_local Trace* g_active = nullptr;

}  // namespace

int32_t Trace::compute(const char* name, std::array<int64_t, 5> sizes, DType dtype) {
  TracedOp op;
  op.kind = TracedKind::Compute;
  op.name = name;
  op.step = step_;
  op.layer = layer_;
  op.sizes = sizes;
  op.dtype = dtype;
  op.deps = std::move(waits_);
  waits_.clear();
  ops_.push_back(std::move(op));
  last_compute_ = static_cast<int32_t>(ops_.size() - 1);
  return last_compute_;
}

int32_t Trace::transfer(TracedKind kind, const char* name, int64_t layer, uint64_t bytes,
                        int64_t chunks, TransferContent content, int32_t after) {
  TracedOp op;
  op.kind = kind;
  op.name = name;
  op.step = step_;
  op.layer = static_cast<int32_t>(layer);
  op.bytes = bytes;
  op.chunks = chunks;
  op.content = content;
  // Enqueued after the last compute op and after whatever the host waited for since.
  if (last_compute_ >= 0) op.deps.push_back(last_compute_);
  op.deps.insert(op.deps.end(), waits_.begin(), waits_.end());
  if (after >= 0) op.deps.push_back(after);
  ops_.push_back(std::move(op));
  return static_cast<int32_t>(ops_.size() - 1);
}

void Trace::host_waits(int32_t op) {
  if (op >= 0) waits_.push_back(op);
}

Trace* active_trace() { return g_active; }

bool dry_run() { return g_active != nullptr && g_active->dry(); }

TraceScope::TraceScope(Trace& trace) : previous_(g_active) { g_active = &trace; }

TraceScope::~TraceScope() { g_active = previous_; }

void trace_step(int64_t step) {
  if (g_active != nullptr) g_active->set_step(step);
  profile_step(step);
}

bool traced(const char* name, std::array<int64_t, 5> sizes, DType dtype) {
  profile_op(name);
  if (g_active == nullptr) return false;
  g_active->compute(name, sizes, dtype);
  return g_active->dry();
}

namespace {
std::atomic<void*> g_dry_base{nullptr};
}  // namespace

void* dry_address() {
  // Address space with no memory behind it and no access rights: 1 TiB, where a dry tensor's
  // views stay inside it, or as much as an address-space limit (ulimit -v) leaves, down to
  // 64 MiB. Reserving costs no memory; a planning dry run precedes every run.
  static void* const base = [] {
    for (size_t bytes = size_t{1} << 40; bytes >= (size_t{1} << 26); bytes /= 4) {
      void* p =
          mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
      if (p != MAP_FAILED) {
        g_dry_base.store(p);
        return p;
      }
    }
    fail("cannot reserve 64 MiB of address space to plan the run: the process's address-space "
         "limit (ulimit -v) is too low");
  }();
  return base;
}

bool is_dry_address(const void* pointer) noexcept {
  const void* base = g_dry_base.load();
  return base != nullptr && pointer == base;
}

}  // namespace infinigen
