// core: the interrupt flag and its signal handlers.
#include "core/interrupt.h"

#include <csignal>

namespace infinigen {
namespace {

volatile std::sig_atomic_t g_signal = 0;

extern "C" void on_signal(int signal) {
  if (g_signal != 0) {
    // The first request is still being honoured: the user insists, stop now.
    std::signal(signal, SIG_DFL);
    std::raise(signal);
    return;
  }
  g_signal = signal;
}

}  // namespace

void install_interrupt_handlers() {
  struct sigaction action {};
  action.sa_handler = on_signal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
  // A write past the file-size limit (ulimit -f) then fails with EFBIG, which the writers report
  // and clean up after, instead of the process dying half-way through a file.
  std::signal(SIGXFSZ, SIG_IGN);
}

int interrupt_signal() {
  return g_signal;
}

void check_interrupt() {
  if (const int signal = g_signal; signal != 0) {
    throw Interrupted(signal, "interrupted by " + signal_name(signal));
  }
}

std::string signal_name(int signal) {
  if (signal == SIGINT) return "SIGINT";
  if (signal == SIGTERM) return "SIGTERM";
  return "signal " + std::to_string(signal);
}

}  // namespace infinigen
