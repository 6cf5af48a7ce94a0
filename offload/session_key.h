// offload: the key of a session on disk (offload/session.h): what must stay the same across its
// turns (the model, the policy, the KV dtype, the policy's fixed options), saved in its manifest
// and compared when the session is continued.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/device.h"
#include "core/dtype.h"
#include "core/model_loader.h"
#include "offload/offload_options.h"

namespace infinigen {

// What must stay the same across a session's turns.
struct SessionKey {
  std::string model;     // for messages: the model's name
  std::string identity;  // CRC-32 (hex) of the config and the weights' names, dtypes and shapes
  std::string policy;
  DType kv_dtype = DType::F16;
  std::vector<std::pair<std::string, std::string>> options;  // the policy's session_options
  // Each option's default, what a session written before the option was recorded was saved with.
  std::vector<std::string> option_defaults;
  int64_t num_layers = 0;
  int64_t kv_heads = 0;
};

// The key of a run of `source` with `options` and `kv_dtype`; a one-line Error when the policy
// cannot keep a session or the device cannot (sessions are read and written in host memory).
SessionKey session_key(const ModelSource& source, const OffloadOptions& options, DType kv_dtype,
                       Device device);

}  // namespace infinigen
