// core: the CPU backend's OpenMP team size (core/cpu_threads.h).
#include "core/cpu_threads.h"

#include <omp.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace infinigen {

namespace {

using Clock = std::chrono::steady_clock;
constexpr auto kInterval = std::chrono::milliseconds(100);

// The CPUs of this process's affinity mask; empty when it cannot be read.
std::vector<int> allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  std::vector<int> cpus;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return cpus;
  for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu) {
    if (CPU_ISSET(cpu, &set)) cpus.push_back(cpu);
  }
  return cpus;
}

// The busy time of the allowed CPUs from /proc/stat's "cpuN user nice system idle iowait irq
// softirq steal" lines (guest time is inside user time; steal counts as busy: another guest had
// the core), and this process's from /proc/self/stat, both in clock ticks. False when /proc is
// not there (the team then keeps every core).
bool read_cpu_times(const std::vector<int>& cpus, double tick_seconds, CpuTimes& times) {
  std::ifstream stat("/proc/stat");
  std::ifstream self("/proc/self/stat");
  if (!stat || !self) return false;
  uint64_t busy = 0;
  std::string line;
  size_t found = 0;
  while (std::getline(stat, line) && line.rfind("cpu", 0) == 0) {
    if (line.size() < 4 || line[3] < '0' || line[3] > '9') continue;  // the "cpu" total
    std::istringstream fields(line.substr(3));
    int cpu = -1;
    uint64_t user = 0, nice = 0, system = 0, idle = 0, iowait = 0, irq = 0, softirq = 0, steal = 0;
    fields >> cpu >> user >> nice >> system >> idle >> iowait >> irq >> softirq >> steal;
    if (!fields || !std::binary_search(cpus.begin(), cpus.end(), cpu)) continue;
    busy += user + nice + system + irq + softirq + steal;
    ++found;
  }
  // /proc/self/stat: "pid (comm) state ..." with utime and stime the 12th and 13th fields after
  // the command's closing parenthesis (which the command itself may contain).
  std::string text((std::istreambuf_iterator<char>(self)), std::istreambuf_iterator<char>());
  const size_t close = text.rfind(')');
  if (close == std::string::npos || found == 0) return false;
  std::istringstream fields(text.substr(close + 1));
  std::string field;
  uint64_t utime = 0, stime = 0;
  for (int i = 1; i <= 13 && fields >> field; ++i) {
    if (i == 12) utime = std::strtoull(field.c_str(), nullptr, 10);
    if (i == 13) stime = std::strtoull(field.c_str(), nullptr, 10);
  }
  if (!fields) return false;
  times.busy = static_cast<double>(busy) * tick_seconds;
  times.self = static_cast<double>(utime + stime) * tick_seconds;
  return true;
}

// This process's threads that are running or runnable now (state R in /proc/self/task/*/stat).
int own_runnable_threads() {
  int running = 0;
  std::error_code error;
  for (const auto& task : std::filesystem::directory_iterator("/proc/self/task", error)) {
    std::ifstream stat(task.path() / "stat");
    std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
    const size_t close = text.rfind(')');
    if (close != std::string::npos && close + 2 < text.size() && text[close + 2] == 'R') ++running;
  }
  return running;
}

// Threads of other processes runnable now, before the first interval can be measured: the
// kernel's count of runnable threads (/proc/loadavg's "running/total") less this process's, the
// least of a few looks 200 us apart (a thread that runs for a moment is not a busy process).
int others_runnable_now() {
  int least = -1;
  for (int look = 0; look < 5; ++look) {
    if (look > 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
    std::ifstream loadavg("/proc/loadavg");
    double one = 0, five = 0, fifteen = 0;
    int runnable = 0;
    char slash = 0;
    if (!(loadavg >> one >> five >> fifteen >> runnable >> slash) || slash != '/') return 0;
    const int others = std::max(0, runnable - own_runnable_threads());
    least = least < 0 ? others : std::min(least, others);
  }
  return std::max(least, 0);
}

struct Team {
  std::mutex mutex;  // adapt_cpu_threads from one thread at a time; the others skip
  // OpenMP's thread count before this file set any (OMP_NUM_THREADS, else the CPUs this process
  // may use): what the team comes back to, however it was sized since.
  int initial = omp_get_max_threads();
  bool configured = false;  // by configure_cpu_threads, else with the default on first use
  bool adapt = false;
  int cores = 1;    // the most threads: the allowed cores, or the fixed count
  int threads = 1;  // the team size now
  std::vector<int> cpus;
  CpuTimes last;
  Clock::time_point last_time;
  double tick_seconds = 0.01;
};

// Sizes the team to the cores other processes leave free and starts measuring; leaves it as it
// is when /proc cannot be read.
void start_adapting(Team& t) {
  t.cpus = allowed_cpus();
  const long ticks = sysconf(_SC_CLK_TCK);
  if (t.cpus.empty() || ticks <= 0) return;
  t.tick_seconds = 1.0 / static_cast<double>(ticks);
  if (!read_cpu_times(t.cpus, t.tick_seconds, t.last)) return;
  t.cores = std::min<int>(t.cores, static_cast<int>(t.cpus.size()));
  t.adapt = t.cores > 1;
  // Until the first interval: the cores less the other processes' threads runnable now.
  t.threads = t.adapt ? free_core_threads(t.cores, others_runnable_now()) : t.cores;
  t.last_time = Clock::now();
}

// Fixed at `fixed` threads, or (0) OMP_NUM_THREADS when it is set, else adapting from now on.
void configure(Team& t, int fixed) {
  t.configured = true;
  t.adapt = false;
  t.cores = t.threads = fixed > 0 ? fixed : t.initial;
  if (fixed == 0 && std::getenv("OMP_NUM_THREADS") == nullptr) start_adapting(t);
  omp_set_num_threads(t.threads);
}

// The process's team, never destroyed: forward passes may run during exit.
Team& team() {
  static Team* t = new Team;
  return *t;
}

// A team configure_cpu_threads has not configured gets the default on first use (a program that
// never calls it, a test), measuring from then; the caller holds the mutex.
void configure_once(Team& t) {
  if (!t.configured) configure(t, 0);
}

}  // namespace

double others_busy_cores(const CpuTimes& earlier, const CpuTimes& later, double seconds) {
  if (seconds <= 0) return 0;
  const double others = (later.busy - earlier.busy) - (later.self - earlier.self);
  return std::max(0.0, others / seconds);
}

int free_core_threads(int cores, double others_busy) {
  const double free = static_cast<double>(cores) - std::max(0.0, others_busy);
  return static_cast<int>(std::clamp<long>(std::lround(free), 1, std::max(cores, 1)));
}

void configure_cpu_threads(int fixed) {
  Team& t = team();
  const std::lock_guard<std::mutex> lock(t.mutex);
  configure(t, fixed);
}

void adapt_cpu_threads() {
  Team& t = team();
  const std::unique_lock<std::mutex> lock(t.mutex, std::try_to_lock);
  if (!lock.owns_lock()) return;
  configure_once(t);
  if (!t.adapt) return;
  const Clock::time_point now = Clock::now();
  if (now - t.last_time < kInterval) return;
  CpuTimes times;
  if (!read_cpu_times(t.cpus, t.tick_seconds, times)) return;
  const double others =
      others_busy_cores(t.last, times, std::chrono::duration<double>(now - t.last_time).count());
  t.last = times;
  t.last_time = now;
  const int threads = free_core_threads(t.cores, others);
  if (threads != t.threads) {
    t.threads = threads;
    omp_set_num_threads(threads);
  }
}

CpuThreads cpu_threads() {
  Team& t = team();
  const std::lock_guard<std::mutex> lock(t.mutex);
  configure_once(t);
  return {t.threads, t.cores, t.adapt};
}

}  // namespace infinigen
