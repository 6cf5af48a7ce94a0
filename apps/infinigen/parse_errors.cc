// apps/infinigen: CLI11's parse errors reworded.
#include "apps/infinigen/parse_errors.h"

#include <regex>
#include <string_view>

namespace infinigen::cli {
namespace {

// The option `name` ("--gen-len") of the chosen subcommand or of the root, or null.
const CLI::Option* find_option(const CLI::App& app, const std::string& name) {
  for (const CLI::App* command : app.get_subcommands()) {
    if (const CLI::Option* option = command->get_option_no_throw(name)) return option;
  }
  return app.get_option_no_throw(name);
}

// The help's name of the value a flag takes ("INT", "FLOAT", "f32|f16"), or "value".
std::string value_type(const CLI::App& app, const std::string& flag) {
  const CLI::Option* option = find_option(app, flag);
  const std::string type = option != nullptr ? option->get_type_name() : "";
  return type.empty() ? "value" : type;
}

// "infinigen run --help", or "infinigen --help" before a subcommand was chosen.
std::string help_command(const CLI::App& app) {
  const auto chosen = app.get_subcommands();
  return chosen.empty() ? "infinigen --help" : "infinigen " + chosen.front()->get_name() + " --help";
}

}  // namespace

std::string parse_error_message(const CLI::App& app, const CLI::ParseError& error) {
  const std::string text = error.what();
  std::smatch m;
  static const std::regex unexpected(R"(^The following arguments? (?:was|were) not expected: (.*)$)");
  static const std::regex convert(R"(^Could not convert: (\S+) = (.*)$)");
  static const std::regex repeated(R"(^(\S+): At Most (\d+) required but received (\d+)$)");
  static const std::regex missing(R"(^(\S+): (\d+) required (\S+) missing$)");
  static const std::regex excludes(R"(^(\S+) excludes (\S+)$)");
  static const std::regex config_key(R"(^INI was not able to parse (?:([\w-]+)\.)?(.+)$)");
  if (std::regex_match(text, m, unexpected)) {
    const std::string what = m[1];
    const bool option = !what.empty() && what.front() == '-';
    return (option ? "unknown option " : "unexpected argument ") + what + " (see " +
           help_command(app) + ")";
  }
  if (std::regex_match(text, m, convert)) {
    return m[1].str() + ": '" + m[2].str() + "' is not a valid " + value_type(app, m[1]);
  }
  if (std::regex_match(text, m, repeated)) {
    return m[1].str() + " is given " + m[3].str() + " times; give it " +
           (m[2] == "1" ? std::string("once") : "at most " + m[2].str() + " times");
  }
  if (std::regex_match(text, m, missing)) {
    return m[1].str() + " needs a value (" + m[3].str() + ")";
  }
  if (std::regex_match(text, m, excludes)) {
    return m[1].str() + " and " + m[2].str() + " cannot be used together";
  }
  if (std::regex_match(text, m, config_key)) {
    const std::string command = m[1].matched ? "infinigen " + m[1].str() : "infinigen";
    return "--config: '" + m[2].str() + "' is not an option of " + command + " (see " +
           help_command(app) + ")";
  }
  return text;
}

}  // namespace infinigen::cli
