// core: where a run's time goes, op by op (`infinigen run --profile-ops`): the time from the start
// of each op the forward pass and the KV policy run (every op that core/trace.h records) to the
// start of the next one, summed by op name, for the prefill and for the decode steps.
//
// On a CUDA device the starts are events recorded on the compute stream (ops enqueued on a side
// stream, a store's, are not charged: the transfer engine times those), so an op's time is what
// the device spent on it plus any idle time before the next op reached the device:
// a host wait (the host thread blocking on the device: a selection's counts, a load) is an entry
// of its own, "(host wait)", which holds the device's idle time while the host turned around. On
// the CPU backend the starts are the host clock and an op's time is its run time; a host wait's
// entry holds the wait. Nothing is recorded in a dry run (the planning pass before a run).
//
// Recording costs an event per op (a few microseconds of host time each) and one wait for the
// device at the end of each step, which the decode loop does anyway to sample.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace infinigen {

class OpProfile {
 public:
  // An op's time summed over the prefill (step 0) or over every decode step.
  struct Entry {
    std::string name;
    int64_t calls = 0;
    double seconds = 0.0;
  };
  struct Phase {
    int64_t steps = 0;            // passes through the model (1 for the prefill)
    std::vector<Entry> entries;   // by seconds, the largest first
    double seconds() const;       // the sum of the entries
  };

  OpProfile() = default;
  ~OpProfile();
  OpProfile(const OpProfile&) = delete;
  OpProfile& operator=(const OpProfile&) = delete;

  // An op named `name` (a static string) is enqueued now on the calling thread's CUDA stream
  // (core/stream.h's current_cuda_stream; none on the CPU backend): charged when that is the
  // stream the steps started on (the compute stream), not when it is a side stream.
  void op(const char* name);
  // The host thread is about to wait (for the device, or a transfer).
  void host_wait();
  // Step `step` starts (0: the prefill): the op before ends here, the marks so far are settled.
  // What follows until its first op is "(step start)" (on the CPU, the host's work between
  // steps).
  void start_step(int64_t step);
  // The steps are over: what runs after them (the stores' last waits, a session's save) is not
  // counted.
  void end_steps();
  // Settles the last step: call once the run is over, before prefill() and decode(). The run's
  // last op, whose end no mark follows, is not counted.
  void finish();

  Phase prefill() const { return phase(0); }
  Phase decode() const { return phase(1); }

 private:
  using Clock = std::chrono::steady_clock;
  struct Mark {
    const char* name;
    int32_t phase;  // 0: prefill, 1: decode, kOutside
    void* event;    // an event recorded on stream_, or null (the host clock)
    Clock::time_point host;
  };
  static constexpr int32_t kOutside = -1;  // before the prefill, after the last step
  void mark(const char* name);  // on stream_ (or the host clock), whatever the current stream
  void settle(bool keep_last);
  Phase phase(int32_t which) const;

  int32_t phase_ = kOutside;
  void* stream_ = nullptr;  // the compute stream: current at the first step's start
  std::vector<int64_t> steps_ = {0, 0};
  std::vector<Mark> marks_;  // since the last settle; the first is the previous settle's last
  std::map<std::pair<int32_t, std::string>, Entry> totals_;
};

// The profile the calling thread records into, or null.
OpProfile* active_op_profile();

// Installs `profile` for the calling thread for the scope's lifetime.
class OpProfileScope {
 public:
  explicit OpProfileScope(OpProfile& profile);
  ~OpProfileScope();
  OpProfileScope(const OpProfileScope&) = delete;
  OpProfileScope& operator=(const OpProfileScope&) = delete;

 private:
  OpProfile* previous_;
};

// The hooks that core/trace.cc and core/stream.cc call: cheap when no profile is installed.
void profile_op(const char* name);
void profile_host_wait();
void profile_step(int64_t step);
void profile_steps_end();

}  // namespace infinigen
