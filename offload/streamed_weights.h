// offload: decoder-layer weights split between the device and pinned host memory
// (--weights-gpu-percent), host-resident tensors streamed onto the device ahead of use.
//
// Device-resident tensors stay where they are. For host-resident ones, two staging layers on the
// device alternate by layer parity: while layer l computes from staging[l % 2], the load stream
// fills staging[(l + 1) % 2] with layer l + 1 (and after the last layer, layer 0 of the next
// pass), so weight transfers overlap compute as in FlexGen.
#pragma once

#include <array>
#include <vector>

#include "core/opt_weights.h"
#include "offload/offload_stats.h"
#include "offload/transfer_engine.h"
#include "offload/weight_placement.h"

namespace infinigen {

class StreamedLayers : public LayerWeightSource {
 public:
  // `layers` are host tensors in checkpoint dtypes as loaded (LayerNorms and biases widened);
  // `homes` is place_weights() for the same config.
  StreamedLayers(const ModelConfig& config, std::vector<OptLayerWeights> layers,
                 const std::vector<WeightHome>& homes, Device device, TransferEngine& engine,
                 OffloadStats& stats);
  ~StreamedLayers() override;

  const OptLayerWeights& layer(int64_t layer) override;
  size_t host_bytes() const { return host_bytes_; }

 private:
  // The 16 tensors of a layer in a fixed order, for walking host and staging copies together.
  static std::array<Tensor*, 16> slots(OptLayerWeights& w);
  void issue_load(int64_t layer);

  int64_t num_layers_;
  TransferEngine& engine_;
  OffloadStats& stats_;
  std::vector<OptLayerWeights> layers_;  // device-resident tensors on the device, others on host
  std::vector<std::array<bool, 16>> on_host_;
  std::array<OptLayerWeights, 2> staged_;  // by parity: device copies of host-resident tensors
  std::array<int64_t, 2> staged_layer_ = {-1, -1};
  std::array<EventPtr, 2> loaded_;
  size_t host_bytes_ = 0;
};

}  // namespace infinigen
