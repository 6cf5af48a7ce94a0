// core: the KV cache of the non-offloaded engine: every layer's keys and values resident on the
// model's device.
#pragma once

#include <cstdint>
#include <vector>

#include "core/model_config.h"
#include "core/tensor.h"

namespace infinigen {

struct KvCache {
  DType dtype = DType::F16;
  int64_t batch = 0;
  int64_t capacity = 0;              // tokens per sequence, padding included
  int64_t length = 0;                // tokens stored so far (the same for every sequence)
  std::vector<int32_t> first_valid;  // (B): tokens before this index are left padding
  std::vector<Tensor> keys;          // per layer: (B, H, capacity, d)
  std::vector<Tensor> values;        // per layer: (B, H, capacity, d)

  static KvCache allocate(const ModelConfig& config, int64_t batch, int64_t capacity, DType dtype,
                          Device device);
};

}  // namespace infinigen
