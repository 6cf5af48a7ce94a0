// core: the one exception type of the engine and a helper to build its message.
//
// Every user-facing failure (bad file, bad shape, bad flag, impossible plan) is an Error whose
// message is a single line naming the file, tensor or flag and what is wrong. The CLI prints it
// and exits non-zero; nothing else catches it.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace infinigen {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
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
