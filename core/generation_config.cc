#include "core/generation_config.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace infinigen {

namespace {

template <typename T>
T field_or(const nlohmann::json& j, const char* key, T fallback, const std::string& path) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  try {
    return j[key].get<T>();
  } catch (const nlohmann::json::exception&) {
    fail(path, ": \"", key, "\" has the wrong type (", j[key].type_name(), ")");
  }
}

}  // namespace

std::optional<SamplingOptions> load_generation_config(const std::string& directory) {
  const std::filesystem::path path = std::filesystem::path(directory) / "generation_config.json";
  if (!std::filesystem::exists(path)) return std::nullopt;
  std::ifstream in(path);
  INFINIGEN_CHECK(in.good(), path.string(), ": not readable");
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    fail(path.string(), ": not valid JSON (", e.what(), ")");
  }
  INFINIGEN_CHECK(j.is_object(), path.string(), ": not a JSON object");
  SamplingOptions sampling;
  if (!field_or(j, "do_sample", false, path.string())) return sampling;  // greedy
  sampling.temperature = field_or(j, "temperature", 1.0f, path.string());
  sampling.top_p = field_or(j, "top_p", 1.0f, path.string());
  INFINIGEN_CHECK(sampling.temperature > 0.0f, path.string(),
                  ": temperature must be positive when do_sample is true, got ",
                  sampling.temperature);
  INFINIGEN_CHECK(sampling.top_p > 0.0f && sampling.top_p <= 1.0f, path.string(),
                  ": top_p must be in (0, 1], got ", sampling.top_p);
  return sampling;
}

}  // namespace infinigen
