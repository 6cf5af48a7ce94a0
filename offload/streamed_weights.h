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

#include "core/model.h"
#include "offload/offload_stats.h"
#include "offload/transfer_engine.h"
#include "offload/weight_placement.h"

namespace infinigen {

class StreamedLayers : public LayerWeightSource {
 public:
  // `layers` are host tensors in checkpoint dtypes as loaded (vectors widened to F32); `homes`
  // is place_weights() for the same config.
  StreamedLayers(const ModelConfig& config, std::vector<TensorTable> layers,
                 const std::vector<WeightHome>& homes, Device device, TransferEngine& engine,
                 OffloadStats& stats);
  ~StreamedLayers() override;

  const TensorTable& layer(int64_t layer) override;
  size_t host_bytes() const { return host_bytes_; }

 private:
  void issue_load(int64_t layer);

  int64_t num_layers_;
  TransferEngine& engine_;
  OffloadStats& stats_;
  std::vector<std::string> names_;          // a layer's tensors, in the layout's order
  std::vector<TensorTable> layers_;         // device-resident tensors on the device, others on host
  std::vector<std::vector<char>> on_host_;  // (L, tensors): lives in pinned host memory
  std::array<TensorTable, 2> staged_;       // by parity: the layer attention reads (device copies
                                            // of host-resident tensors, resident ones as they are)
  std::array<int64_t, 2> staged_layer_ = {-1, -1};
  std::array<EventPtr, 2> loaded_;
  size_t host_bytes_ = 0;
};

}  // namespace infinigen
