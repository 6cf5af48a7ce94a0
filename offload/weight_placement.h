// offload: which weight tensors live on the device and which are streamed from host memory.
//
// FlexGen's rule, per layer: walk the layer's tensors in order; a tensor stays on the device when
// the midpoint of its byte range within the layer falls below `gpu_percent` of the layer's bytes,
// otherwise it lives in pinned host memory and is loaded ahead of use. The globals (embeddings,
// the final norm, the LM head) are read at both ends of every pass and always stay on the
// device.
#pragma once

#include <string>
#include <vector>

#include "core/model_config.h"

namespace infinigen {

struct WeightHome {
  std::string name;  // HF tensor name
  size_t bytes = 0;
  bool on_device = true;
};

// One entry per tensor of weight_layout(config).all(), in that order.
std::vector<WeightHome> place_weights(const ModelConfig& config, double gpu_percent);

}  // namespace infinigen
