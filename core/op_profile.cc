// core: the op profile of a run.
#include "core/op_profile.h"

#include <algorithm>

#include "core/cuda_stream.h"
#include "core/stream.h"
#include "core/trace.h"

namespace infinigen {
namespace {

thread_local OpProfile* g_profile = nullptr;

constexpr const char* kHostWait = "(host wait)";

}  // namespace

double OpProfile::Phase::seconds() const {
  double sum = 0.0;
  for (const Entry& e : entries) sum += e.seconds;
  return sum;
}

OpProfile::~OpProfile() {
  for (const Mark& m : marks_) {
    if (m.event != nullptr) cuda_stream::release_event(m.event);
  }
}

void OpProfile::op(const char* name) {
  // An op enqueued on another stream (a store's) runs beside the one timed: not charged.
  if (current_cuda_stream() == stream_) mark(name);
}

void OpProfile::mark(const char* name) {
  Mark m{name, phase_, nullptr, Clock::now()};
  if (stream_ != nullptr) {
    m.event = cuda_stream::acquire_event();
    try {
      cuda_stream::record(m.event, stream_);
    } catch (...) {
      cuda_stream::release_event(m.event);
      throw;
    }
  }
  marks_.push_back(m);
}

void OpProfile::host_wait() {
  mark(kHostWait);
}

void OpProfile::start_step(int64_t step) {
  if (phase_ == kOutside) stream_ = current_cuda_stream();
  phase_ = step == 0 ? 0 : 1;
  ++steps_[static_cast<size_t>(phase_)];
  mark("(step start)");
  settle(/*keep_last=*/true);
}

void OpProfile::end_steps() {
  phase_ = kOutside;
  mark("(after the steps)");
  settle(/*keep_last=*/true);
}

void OpProfile::finish() { settle(/*keep_last=*/false); }

void OpProfile::settle(bool keep_last) {
  for (size_t i = 0; i + 1 < marks_.size(); ++i) {
    const Mark& from = marks_[i];
    const Mark& to = marks_[i + 1];
    double seconds = std::chrono::duration<double>(to.host - from.host).count();
    if (from.event != nullptr || to.event != nullptr) {
      // The marks before the first step's start have no event: nothing to compare them with.
      if (from.event == nullptr || to.event == nullptr) continue;
      cuda_stream::synchronize_event(to.event);  // one stream: `from` has completed too
      seconds = cuda_stream::elapsed_seconds(from.event, to.event);
    }
    if (from.phase == kOutside) continue;
    Entry& entry = totals_[{from.phase, from.name}];
    entry.name = from.name;
    entry.calls += 1;
    entry.seconds += seconds;
  }
  const size_t kept = keep_last && !marks_.empty() ? 1 : 0;
  for (size_t i = 0; i + kept < marks_.size(); ++i) {
    if (marks_[i].event != nullptr) cuda_stream::release_event(marks_[i].event);
  }
  marks_.erase(marks_.begin(), marks_.end() - static_cast<std::ptrdiff_t>(kept));
}

OpProfile::Phase OpProfile::phase(int32_t which) const {
  Phase p;
  p.steps = steps_[static_cast<size_t>(which)];
  for (const auto& [key, entry] : totals_) {
    if (key.first == which) p.entries.push_back(entry);
  }
  std::sort(p.entries.begin(), p.entries.end(),
            [](const Entry& a, const Entry& b) { return a.seconds > b.seconds; });
  return p;
}

OpProfile* active_op_profile() { return g_profile; }

OpProfileScope::OpProfileScope(OpProfile& profile) : previous_(g_profile) { g_profile = &profile; }

OpProfileScope::~OpProfileScope() { g_profile = previous_; }

void profile_op(const char* name) {
  if (g_profile != nullptr && !dry_run()) g_profile->op(name);
}

void profile_host_wait() {
  if (g_profile != nullptr && !dry_run()) g_profile->host_wait();
}

void profile_step(int64_t step) {
  if (g_profile != nullptr && !dry_run()) g_profile->start_step(step);
}

void profile_steps_end() {
  if (g_profile != nullptr && !dry_run()) g_profile->end_steps();
}

}  // namespace infinigen
