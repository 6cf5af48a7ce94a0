// offload: streamed layer weights.
#include "offload/streamed_weights.h"

#include <chrono>
#include <cstring>

namespace infinigen {

std::array<Tensor*, 16> StreamedLayers::slots(OptLayerWeights& w) {
  // The order of opt_tensor_specs within a layer.
  return {&w.q_weight,         &w.q_bias,         &w.k_weight,        &w.k_bias,
          &w.v_weight,         &w.v_bias,         &w.out_weight,      &w.out_bias,
          &w.attn_norm_weight, &w.attn_norm_bias, &w.fc1_weight,      &w.fc1_bias,
          &w.fc2_weight,       &w.fc2_bias,       &w.ffn_norm_weight, &w.ffn_norm_bias};
}

StreamedLayers::StreamedLayers(const ModelConfig& config, std::vector<OptLayerWeights> layers,
                               const std::vector<WeightHome>& homes, Device device,
                               TransferEngine& engine, OffloadStats& stats)
    : num_layers_(config.num_layers), engine_(engine), stats_(stats), layers_(std::move(layers)) {
  // homes: 2 global tensors, then 16 per layer, then 2 global (opt_tensor_specs order).
  INFINIGEN_CHECK(homes.size() == 4 + 16 * layers_.size(), "weight placement does not match");
  on_host_.resize(layers_.size());
  for (size_t l = 0; l < layers_.size(); ++l) {
    const auto tensors = slots(layers_[l]);
    for (size_t i = 0; i < 16; ++i) {
      const bool host = !homes[2 + 16 * l + i].on_device;
      on_host_[l][i] = host;
      Tensor& t = *tensors[i];
      if (host) {
        // Pinned host copy, the source of every load of this tensor.
        void* pinned = pinned_alloc(t.nbytes());
        std::memcpy(pinned, t.raw(), t.nbytes());
        host_bytes_ += t.nbytes();
        t = Tensor::view(pinned, t.shape(), t.dtype(), Device::Cpu,
                         std::shared_ptr<void>(pinned, [](void* p) { pinned_free(p); }));
      } else if (t.device() != device) {
        t = t.to(device);
      }
    }
  }
  // Staging: one device tensor per host-resident slot (the same for every layer: all layers
  // share shapes, and the placement rule depends only on them).
  for (size_t p = 0; p < 2; ++p) {
    const auto shapes = slots(layers_[0]);
    const auto staged = slots(staged_[p]);
    for (size_t i = 0; i < 16; ++i) {
      bool any_host = false;
      for (const auto& host : on_host_) any_host = any_host || host[i];
      if (any_host) *staged[i] = Tensor::empty(shapes[i]->shape(), shapes[i]->dtype(), device);
    }
  }
}

StreamedLayers::~StreamedLayers() {
  try {
    engine_.synchronize();
  } catch (...) {
    // Reported to the pass that issued the transfer.
  }
}

void StreamedLayers::issue_load(int64_t layer) {
  const size_t p = static_cast<size_t>(layer % 2);
  OptLayerWeights& target = staged_[p];
  const auto sources = slots(layers_[static_cast<size_t>(layer)]);
  const auto targets = slots(target);
  std::vector<CopyChunk> chunks;
  uint64_t bytes = 0;
  for (size_t i = 0; i < 16; ++i) {
    if (!on_host_[static_cast<size_t>(layer)][i]) {
      *targets[i] = *sources[i];  // device-resident: use in place
      continue;
    }
    chunks.push_back({targets[i]->raw(), sources[i]->raw(), sources[i]->nbytes()});
    bytes += sources[i]->nbytes();
  }
  staged_layer_[p] = layer;
  if (chunks.empty()) {
    loaded_[p] = completed_event();
    return;
  }
  stats_.current().layers[static_cast<size_t>(layer)].weight_h2d_bytes += bytes;
  stats_.current().h2d_bytes += bytes;
  loaded_[p] = engine_.load(std::move(chunks));
}

const OptLayerWeights& StreamedLayers::layer(int64_t layer) {
  const size_t p = static_cast<size_t>(layer % 2);
  if (staged_layer_[p] != layer) issue_load(layer);  // first use: nothing prefetched it
  const auto start = std::chrono::steady_clock::now();
  loaded_[p]->wait();
  const double waited =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  stats_.current().layers[static_cast<size_t>(layer)].load_wait_seconds += waited;
  stats_.current().load_wait_seconds += waited;
  // Prefetch the next layer (after the last one, layer 0 of the next pass) into the other
  // buffer, which layer - 1 finished reading.
  // With an odd layer count, layer 0 shares the last layer's buffer: it loads on first use.
  const int64_t next = (layer + 1) % num_layers_;
  if (static_cast<size_t>(next % 2) != p && staged_layer_[1 - p] != next) issue_load(next);
  return staged_[p];
}

}  // namespace infinigen
