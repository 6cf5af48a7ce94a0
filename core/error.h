// core: the one exception type of the engine and a helper to build its message.
//
// Every user-facing failure (bad file, bad shape, bad option, impossible plan) is an Error whose
// message is a single line naming the file, tensor or option and what is wrong. The CLI prints it
// and exits non-zero; nothing else catches it.
//
// Options are named by their key (the snake_case name of the option's field, which is also its
// YAML key): `fail(option("kv_pool_limit"), " must be >= 0")`. How a user spelled the option
// is the front end's business: what() writes the key as it is, render() lets the CLI write
// "--kv-pool-limit" instead, so flag spellings live only in apps/.
#pragma once

#include <functional>
#include <memory>
#include <ostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

namespace infinigen {

// A reference to a user option inside a message; see the header comment.
struct OptionName {
  std::string_view key;
};
inline OptionName option(std::string_view key) {
  return {key};
}
// Writes the reference in the form Error::render() recognises.
std::ostream& operator<<(std::ostream& out, OptionName name);

// How a front end spells an option key (e.g. "kv_pool_limit" -> "--kv-pool-limit").
using OptionSpelling = std::function<std::string(std::string_view key)>;

class Error : public std::runtime_error {
 public:
  // `message` may hold option references (operator<< of OptionName).
  explicit Error(const std::string& message);
  // The message with every option reference spelled by `spell`.
  std::string render(const OptionSpelling& spell) const;
  // The message as given, references kept (to build another Error from this one).
  const std::string& message() const { return *message_; }

 private:
  std::shared_ptr<const std::string> message_;  // shared: copying an exception must not throw
};

// Concatenates anything that streams: cat("tensor ", name, " has ", n, " dims").
template <typename... Parts>
std::string cat(Parts&&... parts) {
  std::ostringstream out;
  (out << ... << std::forward<Parts>(parts));
  return out.str();
}

template <typename... Parts>
[[noreturn]] void fail(Parts&&... parts) {
  throw Error(cat(std::forward<Parts>(parts)...));
}

#define INFINIGEN_CHECK(cond, ...)               \
  do {                                           \
    if (!(cond)) ::infinigen::fail(__VA_ARGS__); \
  } while (0)

}  // namespace infinigen
