// tests/fuzz: what every fuzz target shares. A parser given any bytes must either accept them or
// refuse them with an infinigen::Error (the CLI prints it as one line naming the file). Any other
// exception is a finding too: the CLI would print the library's own message (say "bad
// conversion"), which names neither the file nor what is wrong. Crashes, sanitizer reports,
// hangs and runaway memory are what libFuzzer itself catches.
#pragma once

#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>
#include <typeinfo>

#include "core/error.h"

namespace infinigen::fuzz {

// Runs `parse`, treating an Error as a clean refusal and anything else thrown as a finding.
template <typename Parse>
void expect_clean(Parse&& parse) {
  try {
    parse();
  } catch (const Error&) {
    // A clean one-line refusal.
  } catch (const std::exception& e) {
    std::fprintf(stderr, "fuzz: %s escaped the parser: %s\n", typeid(e).name(), e.what());
    std::abort();
  }
}

// A directory of this process's own under the temp dir, for parsers that read files.
inline const std::filesystem::path& scratch_directory() {
  static const std::filesystem::path dir = [] {
    const auto path = std::filesystem::temp_directory_path() /
                      ("infinigen-fuzz-" + std::to_string(getpid()));
    std::filesystem::create_directories(path);
    return path;
  }();
  return dir;
}

// Writes `bytes` to `name` in the scratch directory and returns its path.
inline std::string write_scratch(const std::string& name, std::string_view bytes) {
  const std::filesystem::path path = scratch_directory() / name;
  std::ofstream(path, std::ios::binary | std::ios::trunc)
      .write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return path.string();
}

inline std::string_view as_text(const uint8_t* data, size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

}  // namespace infinigen::fuzz
