// apps/infinigen: option keys spelled as flags.
#include "apps/infinigen/option_flags.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdint>

#include "core/cpu_threads.h"
#include "offload/kv_policy.h"

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

}  // namespace infinigen::cli
