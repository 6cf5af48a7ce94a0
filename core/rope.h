// core: the frequencies of rotary position embeddings (RoPE), as HF transformers computes them
// for the Llama family: inv_freq[i] = theta^(-2i/d) for i < d/2, then rescaled by the config's
// rope_scaling ("linear": all divided by the factor; "llama3": long wavelengths divided by the
// factor, short ones kept, a smooth blend between). Channel pairs (i, i + d/2) of each head are
// rotated by the angle position * inv_freq[i] (ops::rope).
#pragma once

#include <cstdint>
#include <vector>

#include "core/model_config.h"

namespace infinigen {

// (d / 2) fp32 frequencies, computed in fp32 as transformers does so that angles match.
std::vector<float> rope_inv_freq(const RopeConfig& rope, int64_t head_dim);

// Moves a rotated key to another position: `row` (d elements of `dtype`, rotated at position p)
// becomes the key rotated at p + delta, since rotations by angles add (in fp32, then stored back
// in `dtype`). `scratch` is any buffer, resized here. A conversation's kept keys move to earlier
// positions this way when it overflows the context (offload/session.h).
void shift_rotary_row(void* row, DType dtype, const std::vector<float>& inv_freq, int64_t delta,
                      std::vector<float>& scratch);

}  // namespace infinigen
