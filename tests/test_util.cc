// tests: shared helpers.
#include "tests/test_util.h"

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

#include "core/device.h"
#include "core/error.h"

namespace infinigen::testing_util {

void OptTinyTest::SetUp() {
  source_ = resolve_model("opt-tiny", {});
}

void OptTinyTest::TearDown() {
  set_debug_poison(false);
}

void SmallRunTest::SetUp() {
  OptTinyTest::SetUp();
  source_.config.num_layers = 4;
  request_.prompts = {{2, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20},
                      {2, 500, 600, 700, 800, 900, 1000, 1100, 1200, 1300, 1400, 1500}};
  request_.gen_len = 6;
}

void MixedLengthRunTest::SetUp() {
  OptTinyTest::SetUp();
  request_.prompts = {
      {2, 10, 11, 12, 13}, {2, 500, 600, 700, 800, 900, 1000, 1100, 1200}, {2, 7, 8}};
  request_.gen_len = 6;
}

namespace {

std::string quote(const std::string& arg) {
  std::string out = "'";
  for (char ch : arg) {
    if (ch == '\'') {
      out.append("'\\''");
    } else {
      out.push_back(ch);
    }
  }
  out.push_back('\'');
  return out;
}

std::string slurp(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

// Starts the binary with `args`, stdin from /dev/null and stdout/stderr into the two files;
// the child's pid (-1 when fork failed).
int spawn_infinigen(const std::vector<std::string>& args, const std::string& out,
                    const std::string& err, const ChildOptions& options = {}) {
  std::vector<std::string> argv = {INFINIGEN_BINARY};
  argv.insert(argv.end(), args.begin(), args.end());
  std::fflush(nullptr);
  const int pid = fork();
  if (pid == 0) {
    std::vector<char*> raw;
    for (std::string& a : argv) raw.push_back(a.data());
    raw.push_back(nullptr);
    if (!std::freopen("/dev/null", "r", stdin) || !std::freopen(out.c_str(), "w", stdout) ||
        !std::freopen(err.c_str(), "w", stderr)) {
      _exit(126);
    }
    for (const std::string& assignment : options.env) {
      const size_t equals = assignment.find('=');
      if (equals == std::string::npos ||
          setenv(assignment.substr(0, equals).c_str(), assignment.c_str() + equals + 1, 1) != 0) {
        _exit(126);
      }
    }
    if (options.max_file_bytes > 0) {
      const struct rlimit limit = {options.max_file_bytes, options.max_file_bytes};
      if (setrlimit(RLIMIT_FSIZE, &limit) != 0) {
        _exit(126);
      }
    }
    if (options.max_address_space > 0) {
      const struct rlimit limit = {options.max_address_space, options.max_address_space};
      if (setrlimit(RLIMIT_AS, &limit) != 0) {
        _exit(126);
      }
    }
    execv(raw[0], raw.data());
    _exit(127);
  }
  return pid;
}

// `err` (what `command` wrote on stderr) is exactly one line and holds every fragment.
void expect_one_line_holding(const std::string& err, const std::vector<std::string>& fragments,
                             const std::string& command) {
  EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << command << "\nstderr:\n" << err;
  for (const std::string& fragment : fragments) {
    EXPECT_NE(err.find(fragment), std::string::npos)
        << command << "\nmissing '" << fragment << "' in: " << err;
  }
}

}  // namespace

TempDir::TempDir(const std::string& tag) {
  static std::atomic<int> counter{0};
  path_ =
      std::filesystem::temp_directory_path() /
      ("infinigen-test-" + tag + "-" + std::to_string(getpid()) + "-" + std::to_string(counter++));
  std::filesystem::remove_all(path_);
  std::filesystem::create_directories(path_);
}

TempDir::~TempDir() {
  std::error_code ignored;
  std::filesystem::remove_all(path_, ignored);
}

double relative_error(const float* a, const float* b, size_t n) {
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < n; ++i) {
    diff += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    norm += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(diff) / std::max(std::sqrt(norm), 1e-30);
}

std::string cli_message(const Error& error) {
  return error.render([](std::string_view key) {
    std::string flag = "--" + std::string(key);
    std::replace(flag.begin(), flag.end(), '_', '-');
    return flag;
  });
}

void expect_error(const std::function<void()>& call, const std::vector<std::string>& fragments) {
  try {
    call();
    ADD_FAILURE() << "no error; expected one with '" << fragments.front() << "'";
  } catch (const Error& e) {
    const std::string message = cli_message(e);
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    for (const std::string& fragment : fragments) {
      EXPECT_NE(message.find(fragment), std::string::npos)
          << "missing '" << fragment << "' in: " << message;
    }
  }
}

CommandResult run_infinigen(const std::vector<std::string>& args,
                            const std::vector<std::string>& env) {
  TempDir capture("cli");
  std::string command;
  for (const std::string& assignment : env) command.append(assignment).append(" ");
  command.append(quote(INFINIGEN_BINARY));
  for (const std::string& arg : args) command.append(" ").append(quote(arg));
  const auto out_path = capture.path() / "out", err_path = capture.path() / "err";
  command.append(" </dev/null >").append(quote(out_path.string()));
  command.append(" 2>").append(quote(err_path.string()));
  CommandResult result;
  const int status = std::system(command.c_str());
  result.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  result.out = slurp(out_path);
  result.err = slurp(err_path);
  return result;
}

MeasuredCommand run_infinigen_measured(const std::vector<std::string>& args,
                                       const ChildOptions& options) {
  TempDir capture("measured");
  const auto out_path = capture.path() / "out", err_path = capture.path() / "err";
  const auto start = std::chrono::steady_clock::now();
  const auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  MeasuredCommand result;
  const int pid = spawn_infinigen(
      args, options.stdout_path.empty() ? out_path.string() : options.stdout_path,
      err_path.string(), options);
  EXPECT_GT(pid, 0) << "fork failed";
  if (pid <= 0) return result;
  const double timeout_s = options.timeout_s;
  int status = 0;
  struct rusage usage {};
  bool exited = false;
  while (!(exited = wait4(pid, &status, WNOHANG, &usage) == pid) && elapsed() < timeout_s) {
    usleep(5000);
  }
  result.seconds = elapsed();
  if (!exited) {
    kill(pid, SIGKILL);
    wait4(pid, &status, 0, &usage);
  }
  result.exit_code = exited && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  result.peak_rss_mib = static_cast<double>(usage.ru_maxrss) / 1024.0;  // KiB on Linux
  if (options.stdout_path.empty()) result.out = slurp(out_path);
  result.err = slurp(err_path);
  return result;
}

std::vector<std::pair<std::string, std::string>> suggested_flags(const std::string& refusal) {
  std::vector<std::pair<std::string, std::string>> pairs;
  const size_t at = refusal.find("; try ");
  EXPECT_NE(at, std::string::npos) << refusal;
  if (at == std::string::npos) return pairs;
  std::istringstream flags(refusal.substr(at + 6));
  std::string flag, value;
  while (flags >> flag >> value) pairs.emplace_back(flag, value);
  return pairs;
}

std::vector<std::string> with_suggestion(std::vector<std::string> args,
                                         const std::string& refusal) {
  for (const auto& [flag, value] : suggested_flags(refusal)) {
    bool replaced = false;
    for (size_t i = 0; i + 1 < args.size(); ++i) {
      if (args[i] == flag) {
        args[i + 1] = value;
        replaced = true;
      }
    }
    if (!replaced) {
      args.push_back(flag);
      args.push_back(value);
    }
  }
  return args;
}

std::string command_text(const std::vector<std::string>& args) {
  std::string text = "infinigen";
  for (const std::string& a : args) text += " " + a;
  return text;
}

void expect_one_line_error(const std::vector<std::string>& args,
                           const std::vector<std::string>& fragments) {
  const CommandResult r = run_infinigen(args);
  EXPECT_NE(r.exit_code, 0) << command_text(args);
  expect_one_line_holding(r.err, fragments, command_text(args));
}

MeasuredCommand expect_one_line_failure(const std::vector<std::string>& args,
                                        const ChildOptions& options,
                                        const std::vector<std::string>& fragments) {
  const MeasuredCommand r = run_infinigen_measured(args, options);
  EXPECT_NE(r.exit_code, 0) << command_text(args);
  EXPECT_NE(r.exit_code, -1) << command_text(args) << ": did not finish in " << options.timeout_s
                             << " s";
  expect_one_line_holding(r.err, fragments, command_text(args));
  return r;
}

BackgroundInfinigen::BackgroundInfinigen(const std::vector<std::string>& args)
    : capture_("background") {
  pid_ =
      spawn_infinigen(args, (capture_.path() / "out").string(), (capture_.path() / "err").string());
  EXPECT_GT(pid_, 0) << "fork failed";
}

BackgroundInfinigen::~BackgroundInfinigen() {
  if (pid_ > 0 && !exited_) {
    kill(pid_, SIGKILL);
    waitpid(pid_, &status_, 0);
  }
}

bool BackgroundInfinigen::running() {
  if (pid_ <= 0 || exited_) return false;
  exited_ = waitpid(pid_, &status_, WNOHANG) == pid_;
  return !exited_;
}

CommandResult BackgroundInfinigen::signal_and_wait(int signal, double timeout_s, double* seconds) {
  const auto start = std::chrono::steady_clock::now();
  const auto elapsed = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  };
  if (running()) kill(pid_, signal);
  while (running() && elapsed() < timeout_s) usleep(10000);
  *seconds = elapsed();
  CommandResult result;
  result.exit_code = exited_ && WIFEXITED(status_) ? WEXITSTATUS(status_) : -1;
  result.out = slurp(capture_.path() / "out");
  result.err = slurp(capture_.path() / "err");
  return result;
}

bool gpu_required() {
  const char* value = std::getenv("INFINIGEN_REQUIRE_GPU");
  return value != nullptr && std::string(value) == "1";
}

}  // namespace infinigen::testing_util
