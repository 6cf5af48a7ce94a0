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

}  // namespace infinigen
