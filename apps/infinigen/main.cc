// apps/infinigen: entry point. Parses the command line, runs one subcommand, and turns every
// failure into one line on stderr and a non-zero exit status.
#include <CLI/CLI.hpp>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <iostream>
#include <map>
#include <new>
#include <string>

#include "apps/infinigen/commands.h"
#include "apps/infinigen/option_flags.h"
#include "apps/infinigen/parse_errors.h"
#include "apps/infinigen/yaml_config.h"
#include "core/error.h"
#include "core/interrupt.h"

namespace {

// Whatever a command printed reached stdout, or the exit says it did not: a full disk or a closed
// pipe fails the flush (and earlier writes leave the stream's error flag), which is one line and
// exit status 1 instead of a success whose output is lost.
int checked_exit(int code) {
  errno = 0;
  std::cout.flush();  // CLI11's help and some reports use the stream
  const bool failed = std::cout.fail() || std::fflush(stdout) != 0 || std::ferror(stdout);
  if (failed && code == 0) {
    const int error = errno;
    std::fprintf(stderr, "infinigen: error: cannot write the output to stdout (%s)\n",
                 error != 0 ? std::strerror(error) : "write error");
    return 1;
  }
  return code;
}

int run_cli(int argc, char** argv) {
  using namespace infinigen;
  CLI::App app("infinigen: offloaded LLM inference with speculative KV prefetch (InfiniGen)",
               "infinigen");
  app.require_subcommand(0, 1);
  app.set_version_flag("--version", "infinigen 0.1.0");
  app.fallthrough();  // `infinigen run --config x.yaml`: --config belongs to the root
  cli::add_yaml_config_option(app);
  std::map<const CLI::App*, cli::Command> commands;
  const auto add = [&](const char* name, const char* description,
                       cli::Command (*register_options)(CLI::App&)) {
    CLI::App* command = app.add_subcommand(name, description);
    commands[command] = register_options(*command);
  };
  add("run", "Generate text (batch inference)", cli::add_run_command);
  add("batch", "Run a JSONL file of completion requests (OpenAI batch format), resumable, sharded",
      cli::add_batch_command);
  add("make-model", "Write a synthetic checkpoint of a preset, OPT or Llama family (HF layout)",
      cli::add_make_model_command);
  add("skew", "Write a copy of a checkpoint with SVD-skewed query/key projections",
      cli::add_skew_command);
  add("bench", "Run the paper's latency experiments (CSV, JSON, plot); predict other hardware",
      cli::add_bench_command);
  add("eval", "Accuracy of a sweep of KV policies and settings: perplexity, or passkey retrieval",
      cli::add_eval_command);
  add("inspect", "Print a checkpoint's config and tensors", cli::add_inspect_command);
  add("session",
      "Tools for a saved conversation (run --session DIR): compact DIR merges its segments",
      cli::add_session_command);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "infinigen: error: %s\n", cli::parse_error_message(app, e).c_str());
    return 2;
  } catch (const Error& e) {  // a bad option value, a --config file that cannot be read
    std::fprintf(stderr, "infinigen: error: %s\n", cli::flag_message(e).c_str());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "infinigen: error: %s\n", e.what());
    return 2;
  }
  if (app.get_subcommands().empty()) {
    std::fputs(app.help().c_str(), stdout);
    return 0;
  }
  install_interrupt_handlers();
  try {
    return commands.at(app.get_subcommands().front())();
  } catch (const Interrupted& e) {
    std::fprintf(stderr, "infinigen: %s\n", cli::flag_message(e).c_str());
    return 128 + e.signal();  // the shell's convention: 130 for SIGINT, 143 for SIGTERM
  } catch (const Error& e) {
    std::fprintf(stderr, "infinigen: error: %s\n", cli::flag_message(e).c_str());
    return 1;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr,
                 "infinigen: error: out of memory: an allocation the plan did not foresee failed "
                 "(is an address-space limit, ulimit -v, set?)\n");
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "infinigen: error: %s\n", e.what());
    return 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  return checked_exit(run_cli(argc, argv));
}
