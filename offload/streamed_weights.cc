// offload: streamed layer weights.
#include "offload/streamed_weights.h"

namespace infinigen {

StreamedLayers::StreamedLayers(const ModelConfig& config, std::vector<TensorTable> layers,
                               const std::vector<WeightHome>& homes, Device device,
                               TransferEngine& engine, OffloadStats& stats)
    : num_layers_(config.num_layers), engine_(engine), stats_(stats), layers_(std::move(layers)) {
  const WeightLayout layout = weight_layout(config);
  const size_t n = layout.layer.size(), first = layout.first.size();
  INFINIGEN_CHECK(homes.size() == first + n * layers_.size() + layout.last.size(),
                  "weight placement does not match the model's layout");
  for (const TensorSpec& spec : layout.layer) names_.push_back(spec.name);
  on_host_.assign(layers_.size(), std::vector<char>(n, 0));
  for (size_t l = 0; l < layers_.size(); ++l) {
    for (size_t i = 0; i < n; ++i) {
      const bool host = !homes[first + n * l + i].on_device;
      on_host_[l][i] = host;
      Tensor& t = *layers_[l].find(names_[i]);
      if (host) {
        // Pinned host copy, the source of every load of this tensor.
        void* pinned = pinned_alloc(t.nbytes(), cat("weight ", names_[i], " of layer ", l));
        device_copy(pinned, Device::Cpu, t.raw(), Device::Cpu, t.nbytes());
        host_bytes_ += t.nbytes();
        t = Tensor::view(pinned, t.shape(), t.dtype(), Device::Cpu,
                         std::shared_ptr<void>(pinned, [](void* p) { pinned_free(p); }));
      } else if (t.device() != device) {
        t = t.to(device);
      }
    }
  }
  // Staging: one device tensor per host-resident tensor (the same for every layer: all layers
  // share shapes, and the placement rule depends only on them); resident tensors are filled in
  // by issue_load.
  for (TensorTable& staged : staged_) {
    for (size_t i = 0; i < n; ++i) {
      bool any_host = false;
      for (const auto& host : on_host_) any_host = any_host || host[i];
      const Tensor& shape_of = layers_[0].get(names_[i]);
      staged.add(names_[i],
                 any_host ? Tensor::empty(shape_of.shape(), shape_of.dtype(), device) : Tensor());
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
  std::vector<CopyChunk> chunks;
  uint64_t bytes = 0;
  for (size_t i = 0; i < names_.size(); ++i) {
    const Tensor& source = layers_[static_cast<size_t>(layer)].get(names_[i]);
    Tensor& target = staged_[p].entries()[i].second;
    if (!on_host_[static_cast<size_t>(layer)][i]) {
      target = source;  // device-resident: use in place
      continue;
    }
    chunks.push_back({target.raw(), source.raw(), source.nbytes()});
    bytes += source.nbytes();
  }
  staged_layer_[p] = layer;
  if (chunks.empty()) {
    loaded_[p] = completed_event();
    return;
  }
  stats_.current().layers[static_cast<size_t>(layer)].weight_h2d_bytes += bytes;
  stats_.current().h2d_bytes += bytes;
  loaded_[p] = engine_.load(std::move(chunks), nullptr, {"weights", layer, TransferContent::Weights});
}

const TensorTable& StreamedLayers::layer(int64_t layer) {
  const size_t p = static_cast<size_t>(layer % 2);
  if (staged_layer_[p] != layer) issue_load(layer);  // first use: nothing prefetched it
  StepStats& step = stats_.current();
  engine_.compute_waits(loaded_[p], {&step.layers[static_cast<size_t>(layer)].load_wait_seconds,
                                     &step.load_wait_seconds});
  // Prefetch the next layer (after the last one, layer 0 of the next pass) into the other
  // buffer, which layer - 1 finished reading.
  // With an odd layer count, layer 0 shares the last layer's buffer: it loads on first use.
  const int64_t next = (layer + 1) % num_layers_;
  if (static_cast<size_t>(next % 2) != p && staged_layer_[1 - p] != next) issue_load(next);
  return staged_[p];
}

}  // namespace infinigen
