// apps/infinigen: option keys spelled as flags.
#include "apps/infinigen/option_flags.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdint>
#include <cstdio>

#include "core/cpu_threads.h"
#include "core/device.h"
#include "offload/kv_policy.h"
#include "offload/offload_options.h"
#include "offload/runtime.h"

namespace infinigen::cli {

std::string flag_spelling(std::string_view key) {
  std::string flag = "--";
  flag.append(key);
  std::replace(flag.begin() + 2, flag.end(), '_', '-');
  return flag;
}

std::string policy_list_help(std::string_view lead) {
  size_t width = 0;
  for (const KvPolicy* policy : kv_policies()) width = std::max(width, policy->name.size());
  std::string help(lead);
  for (const KvPolicy* policy : kv_policies()) {
    help +=
        "\n  " + policy->name + std::string(width + 2 - policy->name.size(), ' ') + policy->help;
  }
  return help;
}

CLI::Validator float_type_in(std::vector<DType> allowed) {
  std::string names;
  for (size_t i = 0; i < allowed.size(); ++i) {
    names += i == 0 ? "" : i + 1 == allowed.size() ? " or " : ", ";
    names += float_dtype_spelling(allowed[i]);
  }
  return CLI::Validator(
      [allowed, names](std::string& text) -> std::string {
        try {
          const DType dtype = parse_float_dtype(text);
          if (std::find(allowed.begin(), allowed.end(), dtype) != allowed.end()) return "";
        } catch (const Error&) {
          // not a floating-point type at all: the same refusal
        }
        return "must be " + names + ", got '" + text + "'";
      },
      "");  // the help names the types
}

CLI::Validator unsigned_integer() {
  return CLI::Validator(
      [](std::string& text) -> std::string {
        uint64_t value = 0;
        const char* end = text.data() + text.size();
        const auto [stop, error] = std::from_chars(text.data(), end, value);
        if (!text.empty() && std::isdigit(static_cast<unsigned char>(text.front())) &&
            error == std::errc() && stop == end) {
          return "";
        }
        return "must be a whole number from 0 to 18446744073709551615, got '" + text + "'";
      },
      "");  // the option's type name says it
}

CLI::Option* add_overflow_flags(CLI::App& app, OverflowFlags& flags) {
  CLI::Option* overflow =
      app.add_option("--overflow", flags.overflow,
                     "When a resumed conversation with this turn would pass the context: refuse "
                     "it, or drop its oldest history tokens after --keep-prefix and move the rest "
                     "to earlier positions (rotary models; docs/sessions.md, \"Overflow\")")
          ->check(CLI::IsMember({"refuse", "drop-oldest"}))
          ->capture_default_str();
  app.add_option("--keep-prefix", flags.keep_prefix,
                 "Tokens kept at the start of every conversation when --overflow drop-oldest "
                 "drops history (a system prompt; the first tokens draw much of the attention)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str()
      ->needs(overflow);
  app.add_option("--overflow-margin", flags.margin,
                 "Tokens --overflow drop-oldest drops beyond what the turn needs (as far as the "
                 "history goes), so that the next turns fit without dropping again: each drop "
                 "rewrites the kept history, and with no margin a conversation at the context "
                 "drops at every turn")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str()
      ->needs(overflow);
  return overflow;
}

void add_threads_flag(CLI::App& app) {
  app.add_option_function<int>(
         "--threads", [](int threads) { configure_cpu_threads(threads); },
         "CPU threads (default: every core other processes leave free, measured as the run goes)")
      ->type_name("N")
      ->check(CLI::Validator(
          [](std::string& text) -> std::string {
            int value = -1;
            const char* end = text.data() + text.size();
            const auto [stop, error] = std::from_chars(text.data(), end, value);
            if (error == std::errc() && stop == end && value >= 0 && value <= 4096) return "";
            return "must be a whole number from 0 (every free core) to 4096, got '" + text + "'";
          },
          ""));
}

void add_generation_flags(CLI::App& app, GenerationFlags& flags) {
  app.add_option("--model,-m", flags.model,
                 "Checkpoint directory, a preset (opt-125m ... opt-66b, llama-2-7b, llama-3.1-8b, "
                 "...), or 'builtin' / 'builtin-llama'")
      ->capture_default_str();
  app.add_option("--gen-len,-n", flags.gen_len,
                 "Tokens to generate per sequence (batch: for a request without max_tokens)")
      ->capture_default_str();
  app.add_option("--seed", flags.seed, "Seed for sampling, synthetic prompts and synthetic weights")
      ->check(unsigned_integer())
      ->capture_default_str();
  app.add_option("--temperature", flags.temperature,
                 "Sampling temperature, 0 = greedy (default: the checkpoint's "
                 "generation_config.json, else greedy)");
  app.add_option(
      "--top-p", flags.top_p,
      "Nucleus sampling mass (default: the checkpoint's generation_config.json, else 1)");
  app.add_option("--device", flags.device, "cpu, cuda or auto")->capture_default_str();
  app.add_option("--kv-dtype", flags.kv_dtype, "KV cache element type: f16 or f32")
      ->check(float_type_in({DType::F16, DType::F32}))
      ->capture_default_str();
  add_threads_flag(app);
  add_option_flags(app, offload_option_table(), flags.offload);
  // The policies one per line, rather than the table's one paragraph.
  app.get_option(flag_spelling("policy"))->description(policy_list_help("KV policy:"));
  app.add_flag("--debug-nan", flags.debug_nan,
               "Fill device buffers with NaN before use, to expose reads of untransferred data");
}

Device generation_device(const GenerationFlags& flags) {
  flags.offload.validate();
  std::string fallback;
  const Device device = resolve_device(parse_device_request(flags.device),
                                       policy_runs_on(flags.offload.policy, Device::Cuda),
                                       &fallback, "--policy " + flags.offload.policy);
  if (!fallback.empty()) std::fprintf(stderr, "infinigen: %s\n", fallback.c_str());
  if (flags.debug_nan) set_debug_poison(true);
  return device;
}

SamplingOptions flag_sampling(const GenerationFlags& flags, const ModelSource& model) {
  SamplingOptions sampling = model.sampling.value_or(SamplingOptions{});
  if (flags.temperature) sampling.temperature = *flags.temperature;
  if (flags.top_p) sampling.top_p = *flags.top_p;
  sampling.seed = flags.seed;
  return sampling;
}

}  // namespace infinigen::cli
