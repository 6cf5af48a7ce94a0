// apps/infinigen: the subcommands. Each registers its options on the CLI11 app and returns the
// function that runs it after parsing (exit status as the result).
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

namespace infinigen::cli {

using Command = std::function<int()>;

Command add_run_command(CLI::App& app);
Command add_batch_command(CLI::App& app);
Command add_make_model_command(CLI::App& app);
Command add_skew_command(CLI::App& app);
Command add_inspect_command(CLI::App& app);
Command add_bench_command(CLI::App& app);
Command add_eval_command(CLI::App& app);
Command add_session_command(CLI::App& app);

}  // namespace infinigen::cli
