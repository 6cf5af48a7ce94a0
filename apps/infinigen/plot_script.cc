// apps/infinigen: the command line as typed, and plots drawn by the scripts in tools/.
#include "apps/infinigen/plot_script.h"

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <vector>

#include "core/error.h"
#include "core/output_directory.h"

namespace infinigen::cli {

namespace fs = std::filesystem;

// The command as typed (from /proc/self/cmdline), recorded in the results.
std::string this_command_line() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  std::string line = "infinigen";
  bool first = true;
  for (std::string arg; std::getline(in, arg, '\0');) {
    if (!first) line += " " + arg;
    first = false;
  }
  return line;
}

namespace {

// Runs argv[0] with the arguments, waits, and returns its exit status (-1 if it could not run).
// With `quiet`, its output goes to /dev/null.
int run_process(const std::vector<std::string>& argv, bool quiet) {
  std::vector<char*> args;
  for (const std::string& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  std::fflush(nullptr);
  const pid_t pid = fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    if (quiet) {
      const int null = open("/dev/null", O_WRONLY);
      if (null >= 0) {
        dup2(null, STDOUT_FILENO);
        dup2(null, STDERR_FILENO);
      }
    }
    execvp(args[0], args.data());
    _exit(127);
  }
  int status = 0;
  if (waitpid(pid, &status, 0) < 0) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// A Python that can import matplotlib: $INFINIGEN_PYTHON, else python3 on PATH, else the
// system's /usr/bin/python3 (where Debian's python3-matplotlib lives).
std::string find_plot_python() {
  std::vector<std::string> candidates;
  if (const char* env = std::getenv("INFINIGEN_PYTHON"); env && *env) candidates.push_back(env);
  candidates.push_back("python3");
  candidates.push_back("/usr/bin/python3");
  for (const std::string& python : candidates) {
    if (run_process({python, "-c", "import matplotlib"}, true) == 0) return python;
  }
  return "";
}

// tools/`name` next to an installed binary (share/infinigen/tools), else in the source
// tree this binary was built from.
std::string find_plot_script(const std::string& name) {
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  std::vector<fs::path> candidates;
  if (!ec) candidates.push_back(exe.parent_path().parent_path() / "share/infinigen/tools");
  candidates.push_back(fs::path(INFINIGEN_SOURCE_DIR) / "tools");
  for (const fs::path& dir : candidates) {
    if (fs::is_regular_file(dir / name)) return (dir / name).string();
  }
  return "";
}

}  // namespace

void plot(const std::string& script_name, const fs::path& json_path, const fs::path& png_path) {
  const std::string python = find_plot_python();
  INFINIGEN_CHECK(!python.empty(), "wrote ", json_path.string(), " and its CSV, but no Python ",
                  "with matplotlib was found for the plot (install python3-matplotlib, set ",
                  "INFINIGEN_PYTHON, or pass --no-plot)");
  const std::string script = find_plot_script(script_name);
  INFINIGEN_CHECK(!script.empty(), "wrote ", json_path.string(), " and its CSV, but tools/",
                  script_name, " was not found (pass --no-plot)");
  // The script writes a hidden sibling, renamed once complete (no half-drawn PNG).
  const fs::path staging = staging_path(png_path);
  const int status = run_process({python, script, json_path.string(), staging.string()}, false);
  if (status != 0) {
    std::error_code ignored;
    fs::remove(staging, ignored);
  }
  INFINIGEN_CHECK(status == 0, "wrote ", json_path.string(), " and its CSV, but ", script,
                  " failed (exit status ", status, ")");
  replace_file(staging, png_path);
}

}  // namespace infinigen::cli
