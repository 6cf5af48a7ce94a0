// core: stopping long work when the user asks (SIGINT, SIGTERM).
//
// The CLI installs the handlers; the handler only records the signal. Loops that can run for
// long call check_interrupt() at points where stopping is safe (each half layer of a forward pass,
// each tensor written by make-model or skew), which throws Interrupted; its message says what
// was done so far, and the CLI exits with 128 + the signal number. Unwinding runs the usual
// destructors (transfers drained, staging directories removed), so nothing half-written
// appears under a final name. A second signal while the first is being handled ends the
// process at once with the default action.
#pragma once

#include <string>

#include "core/error.h"

namespace infinigen {

class Interrupted : public Error {
 public:
  Interrupted(int signal, const std::string& message) : Error(message), signal_(signal) {}
  int signal() const { return signal_; }

 private:
  int signal_;
};

// Routes SIGINT and SIGTERM to the interrupt flag and ignores SIGXFSZ, so that a write past
// `ulimit -f` fails like one to a full disk (once per process).
void install_interrupt_handlers();
// The signal received (SIGINT, SIGTERM), or 0.
int interrupt_signal();
// Throws Interrupted ("interrupted by SIGINT") when a signal was received.
void check_interrupt();
// Name of a signal for messages: "SIGINT", "SIGTERM", else "signal N".
std::string signal_name(int signal);

// Runs `work()`; an Interrupted thrown by it is rethrown with context() appended to its message
// (what was done so far, what was not written).
template <typename Work, typename Context>
auto with_interrupt_context(Work&& work, Context&& context) -> decltype(work()) {
  try {
    return work();
  } catch (const Interrupted& e) {
    throw Interrupted(e.signal(), e.message() + context());
  }
}

}  // namespace infinigen
