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

// Moves rotated keys to other positions: a key row rotated at position p becomes the key rotated
// at p + delta, since rotations by angles add (the angles delta * inv_freq[i] computed once, in
// fp32 as ops::rope computes them; each row widened to fp32, rotated and stored back in its
// dtype). A conversation's kept keys move to earlier positions this way when it overflows the
// context (offload/session.h).
class RotaryShift {
 public:
  RotaryShift(const std::vector<float>& inv_freq, int64_t delta);
  // `row`: d = 2 * inv_freq.size() elements of `dtype`, rotated in place.
  void apply(void* row, DType dtype);

 private:
  std::vector<float> cos_, sin_;  // (d / 2)
  std::vector<float> row_;        // (d): the row in fp32
};

}  // namespace infinigen
