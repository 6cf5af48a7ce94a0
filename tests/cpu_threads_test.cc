// tests: the CPU backend's team size follows the cores other processes leave free
// (core/cpu_threads.h).
#include "core/cpu_threads.h"

#include <omp.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <thread>
#include <vector>

#include "test_util.h"

namespace infinigen {
namespace {

using namespace std::chrono_literals;

TEST(CpuThreads, FreeCoresRoundedAndAtLeastOne) {
  EXPECT_EQ(free_core_threads(2, 0.0), 2);
  EXPECT_EQ(free_core_threads(2, 0.4), 2);
  EXPECT_EQ(free_core_threads(2, 0.6), 1);
  EXPECT_EQ(free_core_threads(2, 1.0), 1);
  EXPECT_EQ(free_core_threads(2, 2.0), 1);
  EXPECT_EQ(free_core_threads(2, 7.5), 1);
  EXPECT_EQ(free_core_threads(64, 10.2), 54);
  EXPECT_EQ(free_core_threads(8, -0.3), 8);  // rounding of the tick counts
  EXPECT_EQ(free_core_threads(1, 0.0), 1);
}

TEST(CpuThreads, OthersAreTheBusyTimeThisProcessDidNotSpend) {
  // Half a second: 1.5 s busy on the cores, 0.5 s of it this process's: two cores' worth others.
  EXPECT_DOUBLE_EQ(others_busy_cores({10.0, 2.0}, {11.5, 2.5}, 0.5), 2.0);
  // Only this process: nobody else; counters that did not move, or no time: nobody.
  EXPECT_DOUBLE_EQ(others_busy_cores({10.0, 2.0}, {11.0, 3.0}, 0.5), 0.0);
  EXPECT_DOUBLE_EQ(others_busy_cores({10.0, 2.0}, {10.0, 2.0}, 0.5), 0.0);
  EXPECT_DOUBLE_EQ(others_busy_cores({10.0, 2.0}, {11.0, 2.0}, 0.0), 0.0);
  // Tick rounding can make this process's share look larger than the whole: never below zero.
  EXPECT_DOUBLE_EQ(others_busy_cores({10.0, 2.0}, {10.99, 3.0}, 0.5), 0.0);
  // The machine quiet again after the busy processes: the team grows back to every core.
  EXPECT_EQ(free_core_threads(2, others_busy_cores({10.0, 2.0}, {11.02, 3.0}, 0.5)), 2);
}

TEST(CpuThreads, AFixedCountIsKept) {
  configure_cpu_threads(3);
  EXPECT_EQ(omp_get_max_threads(), 3);
  EXPECT_FALSE(cpu_threads().adapts);
  std::this_thread::sleep_for(120ms);
  adapt_cpu_threads();
  EXPECT_EQ(cpu_threads().now, 3);
  EXPECT_EQ(omp_get_max_threads(), 3);
  configure_cpu_threads(0);
}

// Child processes that keep a core busy each until they are killed.
class BusyProcesses {
 public:
  explicit BusyProcesses(int count) {
    for (int i = 0; i < count; ++i) {
      const pid_t pid = fork();
      if (pid == 0) {
        volatile uint64_t spin = 0;
        for (;;) spin = spin + 1;  // a statement, not a value: C++20 allows it
      }
      if (pid > 0) pids_.push_back(pid);
    }
  }
  ~BusyProcesses() { stop(); }
  void stop() {
    for (const pid_t pid : pids_) {
      kill(pid, SIGKILL);
      waitpid(pid, nullptr, 0);
    }
    pids_.clear();
  }
  size_t size() const { return pids_.size(); }

 private:
  std::vector<pid_t> pids_;
};

// Calls adapt_cpu_threads every 20 ms until the team has `threads` members or `limit` passes.
bool team_becomes(int threads, std::chrono::milliseconds limit) {
  const auto end = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < end) {
    adapt_cpu_threads();
    if (cpu_threads().now == threads && omp_get_max_threads() == threads) return true;
    std::this_thread::sleep_for(20ms);
  }
  return false;
}

TEST(CpuThreads, TheTeamShrinksWhileOtherProcessesKeepTheCoresBusy) {
  configure_cpu_threads(0);
  const CpuThreads start = cpu_threads();
  if (!start.adapts) GTEST_SKIP() << "one core, OMP_NUM_THREADS set, or no /proc: nothing adapts";
  // On a quiet machine the team starts at every core and must shrink; on a machine already busy
  // it may start smaller (ABusyStartStartsSmall...), and must still end at one thread.
  EXPECT_LE(start.now, start.most);
  {
    // As many busy processes as cores: whatever else runs, none is left free.
    BusyProcesses busy(start.most);
    ASSERT_EQ(static_cast<int>(busy.size()), start.most);
    EXPECT_TRUE(team_becomes(1, 3000ms)) << "team of " << cpu_threads().now;
  }
  // That it grows back once they are gone depends on what else the machine runs: the arithmetic
  // is checked above (OthersAreTheBusyTimeThisProcessDidNotSpend).
  configure_cpu_threads(0);
}

// Configured on a busy machine, the team starts small but may still grow to every core; it once
// took the count it had just lowered as its most, and never adapted again.
TEST(CpuThreads, ABusyStartStartsSmallAndKeepsEveryCoreItMayGrowTo) {
  if (std::getenv("OMP_NUM_THREADS") != nullptr) GTEST_SKIP() << "OMP_NUM_THREADS fixes the team";
  configure_cpu_threads(0);
  const int cores = cpu_threads().most;
  EXPECT_EQ(cores, omp_get_num_procs());
  if (cores < 2) GTEST_SKIP() << "one core: nothing adapts";
  BusyProcesses busy(cores);
  std::this_thread::sleep_for(200ms);  // every one of them running
  for (int again = 0; again < 2; ++again) {
    configure_cpu_threads(0);
    EXPECT_TRUE(cpu_threads().adapts);
    EXPECT_EQ(cpu_threads().most, cores);
    EXPECT_EQ(cpu_threads().now, 1) << "configured beside " << cores << " busy processes";
    EXPECT_EQ(omp_get_max_threads(), 1);
  }
  configure_cpu_threads(2);
  configure_cpu_threads(0);
  EXPECT_EQ(cpu_threads().most, cores);
  busy.stop();
  configure_cpu_threads(0);
}

TEST(CpuThreads, TheThreadsFlagIsCheckedAndFixesTheTeam) {
  using testing_util::expect_one_line_error;
  using testing_util::run_infinigen;
  for (const char* bad : {"-1", "x", "4097", "2.5"}) {
    expect_one_line_error({"run", "--threads", bad, "--gen-len", "1"},
                          {"--threads: must be a whole number from 0", bad});
  }
  const auto fixed = run_infinigen({"run", "--threads", "1", "--gen-len", "1", "--json"});
  ASSERT_EQ(fixed.exit_code, 0) << fixed.err;
  EXPECT_NE(fixed.out.find("\"threads\": 1,"), std::string::npos) << fixed.out;
  EXPECT_NE(fixed.out.find("\"threads_adapt\": false"), std::string::npos) << fixed.out;
  const auto adaptive = run_infinigen({"run", "--gen-len", "1"});
  ASSERT_EQ(adaptive.exit_code, 0) << adaptive.err;
  if (cpu_threads().adapts) {
    EXPECT_NE(adaptive.out.find("fewer while other processes keep cores busy"), std::string::npos)
        << adaptive.out;
  }
}

}  // namespace
}  // namespace infinigen
