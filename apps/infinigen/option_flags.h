// apps/infinigen: option tables (core/option_table.h) as command-line flags, and option keys as
// the flags that name them. The only place that knows an option's `--flag` spelling.
#pragma once

#include <CLI/CLI.hpp>
#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"
#include "core/model_loader.h"
#include "core/option_table.h"
#include "offload/offload_options.h"
#include "offload/session.h"

namespace infinigen::cli {

// "kv_pool_limit" -> "--kv-pool-limit".
std::string flag_spelling(std::string_view key);

// CLI11 validators whose refusals read as the project's one line, "--flag: <why>", at parse time
// (for the command line and --config alike):
// one of the floating-point types `allowed` ("f16", "float16", ... as parse_float_dtype reads);
CLI::Validator float_type_in(std::vector<DType> allowed);
// a whole number of 0 or more that fits 64 bits (CLI11 would wrap "-1" into an unsigned 2^64 - 1).
CLI::Validator unsigned_integer();

// --threads N: the CPU backend's OpenMP threads (core/cpu_threads.h), fixed when the flag is
// read; without it (or with 0) the cores other processes leave free, measured as the run goes.
void add_threads_flag(CLI::App& app);

// What `run` and `batch` both take to generate: the model, how tokens are chosen, the device, the
// KV type and the offloading runtime's options. Each field's default is declared here, once.
struct GenerationFlags {
  std::string model = kBuiltinModel;
  int64_t gen_len = 32;  // run: per sequence; batch: a request's max_tokens when it gives none
  uint64_t seed = 0;
  std::optional<float> temperature;  // unset: the checkpoint's generation_config.json, else greedy
  std::optional<float> top_p;
  std::string device = "auto";
  std::string kv_dtype = "f16";
  bool debug_nan = false;
  OffloadOptions offload;  // defaults, help and flags from offload_option_table()
};
// Registers GenerationFlags' flags (--model, --gen-len, --seed, --temperature, --top-p, --device,
// --kv-dtype, --threads, --debug-nan and the offload table's, --policy listing the policies).
// `flags` must outlive `app`.
void add_generation_flags(CLI::App& app, GenerationFlags& flags);

// What a resumed conversation does when its turn would pass the model's context (`run` and
// `batch`; DiskSession::drop_oldest, docs/sessions.md "Overflow"). Defaults declared here, once.
struct OverflowFlags {
  std::string overflow = "refuse";  // refuse, or drop-oldest
  int64_t keep_prefix = kSessionKeepPrefix;
  int64_t margin = 0;  // tokens dropped beyond what the turn needs
  bool drops() const { return overflow == "drop-oldest"; }
};
// Registers --overflow, --keep-prefix and --overflow-margin (which need --overflow); returns
// --overflow.
CLI::Option* add_overflow_flags(CLI::App& app, OverflowFlags& flags);

// The device the flags ask for (auto: CUDA when there is one and the policy runs there; the
// fallback said on stderr), after checking the offload options; --debug-nan switched on.
Device generation_device(const GenerationFlags& flags);
// How tokens are chosen: the checkpoint's generation_config.json, the flags given over it.
SamplingOptions flag_sampling(const GenerationFlags& flags, const ModelSource& model);

// The help of a --policy flag: `lead`, then one line per registered policy (offload/kv_policy.h),
// its name and what it does, in the registry's order.
std::string policy_list_help(std::string_view lead);

// An Error's message with its options spelled as flags.
inline std::string flag_message(const Error& error) {
  return error.render(flag_spelling);
}

// Registers one flag per option of `table`, with the table's help and default. What the user
// gives is parsed into `target` while the command line is read (a bad value is one line naming
// the flag). `table` and `target` must outlive `app`.
template <typename Options>
void add_option_flags(CLI::App& app, const OptionTable<Options>& table, Options& target) {
  const Options defaults{};
  for (const OptionSpec<Options>& spec : table) {
    if (spec.is_switch) {
      app.add_flag_callback(
          flag_spelling(spec.key), [&target, &spec] { spec.parse(target, "true"); }, spec.help);
      continue;
    }
    app.add_option_function<std::string>(
           flag_spelling(spec.key),
           [&target, &spec](const std::string& text) { spec.parse(target, text); }, spec.help)
        ->type_name(spec.value_type)
        ->default_str(spec.format(defaults));
  }
}

// Registers one flag per option of `table` (but those in `except`) that takes a
// comma-separated list of values (eval's sweeps); what the user gives lands in `lists`, keyed by
// option, checked value by value. Switches are not swept.
template <typename Options>
void add_option_list_flags(CLI::App& app, const OptionTable<Options>& table,
                           std::map<std::string, std::vector<std::string>>& lists,
                           const std::vector<std::string>& except) {
  const Options defaults{};
  for (const OptionSpec<Options>& spec : table) {
    if (spec.is_switch || std::find(except.begin(), except.end(), spec.key) != except.end()) {
      continue;
    }
    app.add_option_function<std::vector<std::string>>(
           flag_spelling(spec.key),
           [&lists, &spec](const std::vector<std::string>& values) {
             Options check{};
             for (const std::string& value : values) spec.parse(check, value);
             lists[spec.key] = values;
           },
           spec.help + " (a comma-separated list sweeps it)")
        ->delimiter(',')
        ->type_name(spec.value_type)
        ->default_str(spec.format(defaults));
  }
}

}  // namespace infinigen::cli
