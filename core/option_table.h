// core: options declared once.
//
// An OptionTable lists the options of one struct (offload/offload_options.h, say): for each, its
// key (the snake_case name of its field, also its key in YAML files), its help text, and how it
// is read from text and written as text. The front ends are built from the table: the CLI's
// flags with their help and defaults, YAML files, experiment files and eval's sweeps, so a
// default, a parse rule or a help text is written once. Bad text is an Error naming the option
// (core/error.h's option references).
#pragma once

#include <charconv>
#include <cmath>
#include <cstdint>
#include <functional>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/error.h"

namespace infinigen {

template <typename Options>
struct OptionSpec {
  std::string key;
  std::string help;
  std::string value_type;  // for help texts: NUMBER, INT, or the choices as "a|b|c"
  bool is_switch = false;  // a flag without a value on the command line ("true"/"false" as text)
  std::function<void(Options&, const std::string& text)> parse;
  std::function<std::string(const Options&)> format;
  // Whether the option changes anything given the others (null: always); e.g. an eviction
  // policy only with a pool limit. Sweeps skip settings that differ only in options not in effect.
  std::function<bool(const Options&)> in_effect;
};

template <typename Options>
using OptionTable = std::vector<OptionSpec<Options>>;

// The entry of `key`, or null.
template <typename Options>
const OptionSpec<Options>* find_option(const OptionTable<Options>& table, std::string_view key) {
  for (const OptionSpec<Options>& spec : table) {
    if (spec.key == key) return &spec;
  }
  return nullptr;
}

// "a, b or c" of the table's keys (for "unknown option" messages).
template <typename Options>
std::string option_keys(const OptionTable<Options>& table) {
  std::string keys;
  for (size_t i = 0; i < table.size(); ++i) {
    keys += (i == 0 ? "" : i + 1 == table.size() ? " or " : ", ") + table[i].key;
  }
  return keys;
}

// Text of a number as the tables write it: the shortest form that reads back the same.
std::string format_number(double value);

// Parsers shared by the builders below: the whole of `text` or an Error naming `key`.
double parse_number(std::string_view key, const std::string& text);
int64_t parse_integer(std::string_view key, const std::string& text);
bool parse_switch(std::string_view key, const std::string& text);

// An option whose text `read(key, text)` turns into the field's value and `write(value)` turns
// back into text; `field(options)` is the field (a generic lambda serves const and non-const).
// The builders below are this with the parsers above.
template <typename Options, typename Field, typename Read, typename Write>
OptionSpec<Options> value_option(std::string key, std::string help, std::string value_type,
                                 bool is_switch, Field field, Read read, Write write) {
  return OptionSpec<Options>{
      .key = key,
      .help = std::move(help),
      .value_type = std::move(value_type),
      .is_switch = is_switch,
      .parse = [key, field, read](Options& o,
                                  const std::string& text) { field(o) = read(key, text); },
      .format = [field, write](const Options& o) -> std::string { return write(field(o)); },
      .in_effect = nullptr};
}

template <typename Options, typename Field>
OptionSpec<Options> number_option(std::string key, std::string help, Field field) {
  return value_option<Options>(std::move(key), std::move(help), "NUMBER", false, field,
                               parse_number, format_number);
}

template <typename Options, typename Field>
OptionSpec<Options> integer_option(std::string key, std::string help, Field field) {
  return value_option<Options>(std::move(key), std::move(help), "INT", false, field, parse_integer,
                               [](auto value) { return std::to_string(value); });
}

template <typename Options, typename Field>
OptionSpec<Options> switch_option(std::string key, std::string help, Field field) {
  return value_option<Options>(std::move(key), std::move(help), "", true, field, parse_switch,
                               [](bool on) -> std::string { return on ? "true" : "false"; });
}

// An option whose text is one of `choices` (name, value).
template <typename Options, typename T, typename Field>
OptionSpec<Options> choice_option(std::string key, std::string help, Field field,
                                  std::vector<std::pair<std::string, T>> choices) {
  std::string names, type;
  for (size_t i = 0; i < choices.size(); ++i) {
    names += (i == 0 ? "" : i + 1 == choices.size() ? " or " : ", ") + choices[i].first;
    type += (i == 0 ? "" : "|") + choices[i].first;
  }
  const auto read = [choices, names](std::string_view option_key, const std::string& text) -> T {
    for (const auto& [name, value] : choices) {
      if (name == text) return value;
    }
    fail(option(option_key), ": unknown value '", text, "' (expected ", names, ")");
  };
  const auto write = [choices](const T& value) -> std::string {
    for (const auto& [name, choice] : choices) {
      if (choice == value) return name;
    }
    return "?";
  };
  return value_option<Options>(std::move(key), std::move(help), std::move(type), false, field, read,
                               write);
}

}  // namespace infinigen
