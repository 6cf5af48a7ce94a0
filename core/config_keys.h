// core: reading the keys of an HF config.json, shared by the model families' config parsers
// (core/models/). Every reader names the file and the key in its one-line Error.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "core/error.h"

namespace infinigen::config_keys {

using nlohmann::json;

// A key that must be there and be a positive integer.
int64_t positive_int(const json& j, const char* key, const std::string& source);
// A positive integer, or `fallback` when the key is absent or null.
int64_t positive_int_or(const json& j, const char* key, int64_t fallback,
                        const std::string& source);
// A positive finite number, or `fallback` when the key is absent or null.
double positive_number_or(const json& j, const char* key, double fallback,
                          const std::string& source);
// A token id: a non-negative integer, `fallback` when absent or null. HF configs of the Llama
// family may give a list of ids (several end-of-sequence tokens): the first is taken.
int32_t token_id(const json& j, const char* key, int32_t fallback, const std::string& source);
bool flag(const json& j, const char* key, bool fallback, const std::string& source);
// A string, or `fallback` when absent or null.
std::string text(const json& j, const char* key, const std::string& fallback,
                 const std::string& source);

// A key that must have `expected` (when present) for this engine to compute the model correctly.
template <typename T>
void require(const json& j, const char* key, const T& expected, const std::string& source,
             const char* why) {
  if (!j.contains(key) || j.at(key).is_null()) return;
  bool matches = false;
  try {
    matches = j.at(key).get<T>() == expected;
  } catch (const json::exception&) {
  }
  INFINIGEN_CHECK(matches, source, ": unsupported ", key, " = ", j.at(key).dump(), " (", why, ")");
}

}  // namespace infinigen::config_keys
