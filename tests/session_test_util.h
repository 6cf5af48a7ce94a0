// tests: what the session suites share (session_test.cc, session_compact_test.cc): the tiny
// models they run, each policy's options for them, and the raw bytes of a session's files.
#pragma once

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "core/model_loader.h"
#include "offload/offload_options.h"

namespace infinigen::testing_util {

// opt-tiny with 4 layers (InfiniGen's two dense ones and two speculated), or llama-tiny (4 too).
inline ModelSource session_model(const std::string& model) {
  ModelSource source = resolve_model(model, {});
  if (model == "opt-tiny") source.config.num_layers = 4;
  return source;
}

// `policy` with its defaults, but InfiniGen fetching every token within alpha 1000 of the top one
// (it must then equal the full cache).
inline OffloadOptions session_options(const std::string& policy) {
  OffloadOptions options;
  options.policy = policy;
  if (policy == "infinigen") {
    options.speculation.alpha = 1000.0;
    options.speculation.max_num_kv = 100000;
  }
  return options;
}

inline std::string read_bytes(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

inline void write_bytes(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

}  // namespace infinigen::testing_util
