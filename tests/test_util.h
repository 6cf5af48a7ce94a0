// tests: helpers shared by the suites (temporary directories, error comparisons, the CLI).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

namespace infinigen::testing_util {

// A fresh directory under the system temp dir, removed when the object goes out of scope.
class TempDir {
 public:
  explicit TempDir(const std::string& tag);
  ~TempDir();
  const std::filesystem::path& path() const { return path_; }
  std::string str() const { return path_.string(); }

 private:
  std::filesystem::path path_;
};

// ||a - b|| / ||b|| over n values.
double relative_error(const float* a, const float* b, size_t n);

// Runs `call`, expecting an infinigen::Error whose message is one line holding every fragment.
void expect_error(const std::function<void()>& call, const std::vector<std::string>& fragments);

struct CommandResult {
  int exit_code = -1;
  std::string out;
  std::string err;
};
// Runs the infinigen binary with `args` (shell-quoted here), with extra environment assignments
// such as "INFINIGEN_CACHE_DIR=/tmp/x" prepended.
CommandResult run_infinigen(const std::vector<std::string>& args,
                            const std::vector<std::string>& env = {});

// A finished run of the binary with what it cost: wall time and the process's own peak resident
// memory (from wait4, so earlier children do not count).
struct MeasuredCommand : CommandResult {
  double seconds = 0.0;
  double peak_rss_mib = 0.0;
};
// Runs the infinigen binary with `args` (no shell in between), killing it after `timeout_s`
// (exit_code -1 then).
MeasuredCommand run_infinigen_measured(const std::vector<std::string>& args,
                                       double timeout_s = 60.0);

// The infinigen binary running in the background (stdout and stderr captured), for tests that
// signal it. The destructor kills it if it still runs.
class BackgroundInfinigen {
 public:
  explicit BackgroundInfinigen(const std::vector<std::string>& args);
  ~BackgroundInfinigen();
  BackgroundInfinigen(const BackgroundInfinigen&) = delete;
  BackgroundInfinigen& operator=(const BackgroundInfinigen&) = delete;

  // True while the process has not exited.
  bool running();
  // Sends `signal`, waits at most `timeout_s` for the exit, and returns what it printed and its
  // exit code (-1 when it did not exit in time, or died of a signal); `seconds` receives the
  // time from the signal to the exit.
  CommandResult signal_and_wait(int signal, double timeout_s, double* seconds);

 private:
  TempDir capture_;
  int pid_ = -1;
  int status_ = 0;
  bool exited_ = false;
};

// Runs the infinigen binary with `args`, expecting a non-zero exit and exactly one line on
// stderr that holds every fragment.
void expect_one_line_error(const std::vector<std::string>& args,
                           const std::vector<std::string>& fragments);

}  // namespace infinigen::testing_util
