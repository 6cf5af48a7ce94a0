// core: reading HF config.json keys.
#include "core/config_keys.h"

#include <cmath>

namespace infinigen::config_keys {

int64_t positive_int(const json& j, const char* key, const std::string& source) {
  INFINIGEN_CHECK(j.contains(key), source, ": missing '", key, "'");
  const json& v = j.at(key);
  INFINIGEN_CHECK(v.is_number_integer() && v.get<int64_t>() > 0, source, ": '", key,
                  "' must be a positive integer, got ", v.dump());
  return v.get<int64_t>();
}

int64_t positive_int_or(const json& j, const char* key, int64_t fallback,
                        const std::string& source) {
  if (!j.contains(key) || j.at(key).is_null()) return fallback;
  return positive_int(j, key, source);
}

double positive_number_or(const json& j, const char* key, double fallback,
                          const std::string& source) {
  if (!j.contains(key) || j.at(key).is_null()) return fallback;
  const json& v = j.at(key);
  INFINIGEN_CHECK(v.is_number() && std::isfinite(v.get<double>()) && v.get<double>() > 0, source,
                  ": '", key, "' must be a positive number, got ", v.dump());
  return v.get<double>();
}

int32_t token_id(const json& j, const char* key, int32_t fallback, const std::string& source) {
  if (!j.contains(key) || j.at(key).is_null()) return fallback;
  const json& given = j.at(key);
  const json& v = given.is_array() && !given.empty() ? given.front() : given;
  INFINIGEN_CHECK(v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() <= INT32_MAX,
                  source, ": '", key, "' must be a non-negative integer, got ", given.dump());
  return static_cast<int32_t>(v.get<int64_t>());
}

bool flag(const json& j, const char* key, bool fallback, const std::string& source) {
  if (!j.contains(key) || j.at(key).is_null()) return fallback;
  INFINIGEN_CHECK(j.at(key).is_boolean(), source, ": '", key, "' must be true or false, got ",
                  j.at(key).dump());
  return j.at(key).get<bool>();
}

std::string text(const json& j, const char* key, const std::string& fallback,
                 const std::string& source) {
  if (!j.contains(key) || j.at(key).is_null()) return fallback;
  INFINIGEN_CHECK(j.at(key).is_string(), source, ": '", key, "' must be a string, got ",
                  j.at(key).dump());
  return j.at(key).get<std::string>();
}

}  // namespace infinigen::config_keys
