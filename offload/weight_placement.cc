// offload: FlexGen's midpoint rule deciding which weight tensors live on the device.
#include "offload/weight_placement.h"

#include <map>

#include "core/dtype.h"
#include "core/error.h"
#include "core/weights.h"

namespace infinigen {
namespace {}  // namespace

std::vector<WeightHome> place_weights(const ModelConfig& config, double gpu_percent) {
  INFINIGEN_CHECK(gpu_percent >= 0.0 && gpu_percent <= 100.0, option("weights_gpu_percent"),
                  " must be in [0, 100], got ", gpu_percent);
  const size_t element_bytes = dtype_size(config.dtype);
  // Group of each tensor: its layer, or -1 for the globals (embeddings, final norm).
  const WeightLayout layout = weight_layout(config);
  std::vector<WeightHome> homes;
  std::vector<int64_t> groups;
  std::map<int64_t, size_t> group_bytes;
  layout.visit([&](const TensorSpec& spec) {
    homes.push_back(
        {spec.name, static_cast<size_t>(shape_numel(spec.shape)) * element_bytes, true});
    groups.push_back(spec.layer);
    group_bytes[spec.layer] += homes.back().bytes;
  });
  // Walk each group in order: a tensor whose byte midpoint lies in the first gpu_percent of its
  // group's bytes stays on the device (so 100% keeps everything and 0% no layer weight).
  std::map<int64_t, size_t> group_offset;
  for (size_t i = 0; i < homes.size(); ++i) {
    size_t& offset = group_offset[groups[i]];
    const double midpoint = static_cast<double>(offset) + 0.5 * static_cast<double>(homes[i].bytes);
    const double limit = gpu_percent / 100.0 * static_cast<double>(group_bytes[groups[i]]);
    // The globals (embeddings, final norm, LM head) are used at both ends of every pass: they
    // stay on the device.
    homes[i].on_device = groups[i] < 0 || midpoint < limit;
    offset += homes[i].bytes;
  }
  return homes;
}

}  // namespace infinigen
