// kernels/cuda: a selection on the device, as InfiniGen's speculation leaves it for the kernels
// that read it (the selected-row gather, the row cache's match and store).
#pragma once

#include <cstdint>

namespace infinigen::kernels::cuda {

// For sequence b and head h, the take[b] ascending pool positions positions[(b * heads + h) *
// stride + j], j < take[b]; the largest take is the selection's fetch.
struct DeviceSelection {
  const int32_t* positions;  // (batch, heads, stride), on the device
  const int32_t* take;       // (batch), on the device
  int64_t batch;
  int64_t heads;
  int64_t stride;
};

}  // namespace infinigen::kernels::cuda
