// apps/infinigen: CLI11's parse errors in the project's own words. CLI11 reports a bad command
// line in its own phrasing ("At Most 1 required but received 2", "INI was not able to parse
// run.bogus-key"); every message a user sees is one line of ours, naming the flag.
#pragma once

#include <CLI/CLI.hpp>
#include <string>

namespace infinigen::cli {

// The one line for `error`, raised while `app` (the root) parsed the command line: an unknown
// option or argument, a value that does not convert (with the type the flag takes), a flag given
// twice or with its value missing, two flags that exclude each other, an unknown key in a
// --config file. Other errors keep CLI11's text.
std::string parse_error_message(const CLI::App& app, const CLI::ParseError& error);

}  // namespace infinigen::cli
