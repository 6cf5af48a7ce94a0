// tests: helpers shared by the suites (fixtures on opt-tiny, requests, temporary directories,
// error comparisons, the CLI).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "core/device.h"
#include "core/error.h"
#include "core/generation.h"
#include "core/model_config.h"
#include "core/model_loader.h"

namespace infinigen::testing_util {

// A generation on opt-tiny's synthetic weights: `source_` holds them, `request_` is left for the
// test (or a fixture below) to fill. A test may switch on the NaN poison of KV that was not
// transferred (set_debug_poison); TearDown switches it off.
class OptTinyTest : public ::testing::Test {
 protected:
  void SetUp() override;
  void TearDown() override;
  ModelSource source_;
  GenerationRequest request_;
};

// A small offloaded run that exercises every policy: opt-tiny cut to 4 layers (InfiniGen's two
// dense layers and two speculated ones), two prompts of 12 tokens, 6 generated.
class SmallRunTest : public OptTinyTest {
 protected:
  void SetUp() override;
};

// A left-padded batch: opt-tiny with prompts of 5, 9 and 3 tokens, 6 generated.
class MixedLengthRunTest : public OptTinyTest {
 protected:
  void SetUp() override;
};

// `batch` prompts of `prompt_len` tokens, `gen_len` generated, with `preset`'s config and the KV
// policy `policy`: the fields a MemoryRequest and a CostModelInput share.
template <typename Request>
Request preset_request(const std::string& preset, int64_t batch, int64_t prompt_len,
                       int64_t gen_len, const std::string& policy) {
  Request request;
  request.config = load_preset(preset);
  request.batch = batch;
  request.prompt_len = prompt_len;
  request.gen_len = gen_len;
  request.options.policy = policy;
  return request;
}

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

// An Error's message with its options spelled as the CLI spells them (--kv-pool-limit), so that
// tests of the library and of the command line expect the same words.
std::string cli_message(const Error& error);

// Runs `call`, expecting an infinigen::Error whose message (as the CLI prints it) is one line
// holding every fragment.
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
// How run_infinigen_measured starts and bounds the child.
struct ChildOptions {
  double timeout_s = 60.0;       // killed after this (exit_code -1 then)
  std::vector<std::string> env;  // "NAME=value" added to the child's environment
  // RLIMIT_FSIZE in the child (0: none). The binary ignores SIGXFSZ, so a write past the limit
  // fails with EFBIG, as one to a full disk fails with ENOSPC.
  size_t max_file_bytes = 0;
  // RLIMIT_AS in the child (0: none): its address space (ulimit -v).
  size_t max_address_space = 0;
  // The child's stdout goes here instead of being captured ("/dev/full": a full device).
  std::string stdout_path;

  ChildOptions& timeout(double seconds) { return timeout_s = seconds, *this; }
  ChildOptions& stdout_to(std::string path) { return stdout_path = std::move(path), *this; }
  ChildOptions& address_space(size_t bytes) { return max_address_space = bytes, *this; }
  ChildOptions& with_env(std::string assignment) { return env.push_back(assignment), *this; }
  ChildOptions& file_limit(size_t bytes) { return max_file_bytes = bytes, *this; }
};
// Runs the infinigen binary with `args` (no shell in between).
MeasuredCommand run_infinigen_measured(const std::vector<std::string>& args,
                                       const ChildOptions& options = {});

// The (flag, value) pairs after "; try " in a planner's `refusal` (a failure when there is none).
std::vector<std::pair<std::string, std::string>> suggested_flags(const std::string& refusal);

// `args` with the flags after "; try " in a planner's `refusal` applied (a flag already present is
// replaced), so that a test can run what was suggested.
std::vector<std::string> with_suggestion(std::vector<std::string> args, const std::string& refusal);

// "infinigen ARGS...", to name a command in failure messages.
std::string command_text(const std::vector<std::string>& args);

// Runs the infinigen binary with `args` under `options`, expecting it to finish with a non-zero
// exit and exactly one line on stderr that holds every fragment. Returns the run.
MeasuredCommand expect_one_line_failure(const std::vector<std::string>& args,
                                        const ChildOptions& options,
                                        const std::vector<std::string>& fragments);

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

// INFINIGEN_REQUIRE_GPU=1: a gpu-labelled test must not skip (the emulated device, a GPU machine).
bool gpu_required();

}  // namespace infinigen::testing_util

// For gpu-labelled tests: skips without a CUDA device (a machine without a GPU or driver), fails
// when one is required (INFINIGEN_REQUIRE_GPU=1) or when a driver is installed but unusable (too
// old for this runtime, say), since skipping then would hide that nothing was tested.
#define INFINIGEN_SKIP_WITHOUT_CUDA_DEVICE()                                                  \
  do {                                                                                        \
    ASSERT_EQ(::infinigen::cuda_discovery_error(), "") << "CUDA is installed but not usable"; \
    if (::infinigen::cuda_devices().empty()) {                                                \
      if (::infinigen::testing_util::gpu_required()) {                                        \
        FAIL() << "INFINIGEN_REQUIRE_GPU=1 but no CUDA device was found";                     \
      }                                                                                       \
      GTEST_SKIP() << "no CUDA device on this machine";                                       \
    }                                                                                         \
  } while (false)
