// core: reading and writing option values as text.
#include "core/option_table.h"

namespace infinigen {

std::string format_number(double value) {
  char text[32];
  const auto [end, error] = std::to_chars(text, text + sizeof(text), value);
  return error == std::errc() ? std::string(text, end) : std::string("?");
}

double parse_number(std::string_view key, const std::string& text) {
  double value = 0;
  const char* end = text.data() + text.size();
  const auto [at, error] = std::from_chars(text.data(), end, value);
  INFINIGEN_CHECK(error != std::errc::result_out_of_range, option(key), ": ", text,
                  " is out of range");
  INFINIGEN_CHECK(!text.empty() && error == std::errc() && at == end, option(key), ": '", text,
                  "' is not a number");
  INFINIGEN_CHECK(std::isfinite(value), option(key), " must be finite, got ", text);
  return value;
}

int64_t parse_integer(std::string_view key, const std::string& text) {
  int64_t value = 0;
  const char* end = text.data() + text.size();
  const auto [at, error] = std::from_chars(text.data(), end, value);
  INFINIGEN_CHECK(error != std::errc::result_out_of_range, option(key), ": ", text,
                  " is out of range");
  INFINIGEN_CHECK(!text.empty() && error == std::errc() && at == end, option(key), ": '", text,
                  "' is not a whole number");
  return value;
}

bool parse_switch(std::string_view key, const std::string& text) {
  if (text == "true" || text == "1" || text == "yes" || text == "on") return true;
  if (text == "false" || text == "0" || text == "no" || text == "off") return false;
  fail(option(key), ": '", text, "' is not true or false");
}

}  // namespace infinigen
