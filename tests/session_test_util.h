// tests: what the session suites share (session_test.cc, session_compact_test.cc,
// session_overflow_test.cc): the tiny models they run, each policy's options for them, a store
// resumed from a session, and the raw bytes of a session's files.
#pragma once

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "core/model_loader.h"
#include "offload/kv_policy.h"
#include "offload/offload_options.h"
#include "offload/offload_stats.h"
#include "offload/runtime.h"
#include "offload/session.h"
#include "offload/transfer_engine.h"

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

// A store of `options.policy` resumed on the CPU from `session`'s history, left padded, and
// through the layer loads of a one-token pass: what it then holds is what a resumed turn reads.
struct ResumedStore {
  explicit ResumedStore(const OffloadOptions& options) : engine(Device::Cpu, options.link) {}
  TransferEngine engine;
  OffloadStats stats;
  std::unique_ptr<KvStore> store;
  std::vector<int32_t> first_valid;  // (B): each sequence's first history row
};

inline std::unique_ptr<ResumedStore> resume_store(DiskSession& session, const ModelSource& source,
                                                  const OffloadOptions& options) {
  auto resumed = std::make_unique<ResumedStore>(options);
  const auto& history = session.history();
  const int64_t B = std::ssize(history), L = source.config.num_layers;
  int64_t longest = 0;
  for (const auto& h : history) longest = std::max<int64_t>(longest, std::ssize(h) + 1);
  for (const auto& h : history)
    resumed->first_valid.push_back(static_cast<int32_t>(longest - std::ssize(h) - 1));
  const int64_t capacity = longest + 4;
  const int64_t pool_positions = kv_pool_positions(options.kv_pool_limit, source.config, B,
                                                   capacity, DType::F16, /*session=*/true);
  resumed->store = kv_policy(options.policy)
                       .make_store({source.config, B, capacity, DType::F16, Device::Cpu, options,
                                    pool_positions, resumed->engine, resumed->stats});
  resumed->store->resume(longest - 1, resumed->first_valid, L,
                         [&](int64_t layer, KvStore& s) { session.restore_layer(layer, s); });
  session.begin();
  resumed->store->begin_pass(1);
  for (int64_t l = 0; l < L; ++l) resumed->store->begin_layer(l);
  resumed->engine.synchronize();
  return resumed;
}

inline std::string read_bytes(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

inline void write_bytes(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

}  // namespace infinigen::testing_util
