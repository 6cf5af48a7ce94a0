// core: RoPE frequencies (transformers' _compute_default_rope_parameters and the linear and
// llama3 rescalings), and a rotated key moved to another position.
#include "core/rope.h"

#include <cmath>
#include <numbers>

#include "core/error.h"
#include "kernels/cpu/rope.h"

namespace infinigen {

std::vector<float> rope_inv_freq(const RopeConfig& rope, int64_t head_dim) {
  INFINIGEN_CHECK(rope.enabled() && head_dim >= 2 && head_dim % 2 == 0,
                  "rotary embedding needs a positive theta and an even head size, got theta ",
                  rope.theta, " and head size ", head_dim);
  const int64_t half = head_dim / 2;
  std::vector<float> inv_freq(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(head_dim);
    inv_freq[static_cast<size_t>(i)] = 1.0f / std::pow(static_cast<float>(rope.theta), exponent);
  }
  switch (rope.scaling) {
    case RopeConfig::Scaling::None:
      break;
    case RopeConfig::Scaling::Linear:
      for (float& f : inv_freq) f = static_cast<float>(f / rope.factor);
      break;
    case RopeConfig::Scaling::Llama3: {
      const double old_context = static_cast<double>(rope.original_max_positions);
      const double low_freq_wavelen = old_context / rope.low_freq_factor;
      const double high_freq_wavelen = old_context / rope.high_freq_factor;
      for (float& f : inv_freq) {
        const double wavelen = 2.0 * std::numbers::pi / f;
        if (wavelen > low_freq_wavelen) {
          f = static_cast<float>(f / rope.factor);
        } else if (wavelen >= high_freq_wavelen) {  // between the two: a smooth blend
          const double smooth = (old_context / wavelen - rope.low_freq_factor) /
                                (rope.high_freq_factor - rope.low_freq_factor);
          f = static_cast<float>((1.0 - smooth) * f / rope.factor + smooth * f);
        }
      }
      break;
    }
  }
  return inv_freq;
}

RotaryShift::RotaryShift(const std::vector<float>& inv_freq, int64_t delta) {
  INFINIGEN_CHECK(delta > -(int64_t{1} << 24) && delta < (int64_t{1} << 24), "a rotary shift of ",
                  delta, " positions is past fp32's exact integers");
  const float position = static_cast<float>(delta);
  for (const float frequency : inv_freq) {
    cos_.push_back(std::cos(position * frequency));
    sin_.push_back(std::sin(position * frequency));
  }
  row_.resize(2 * inv_freq.size());
}

void RotaryShift::apply(void* row, DType dtype) {
  convert_to_f32(row, dtype, row_.data(), row_.size());
  kernels::cpu::rotate_half(row_.data(), cos_.data(), sin_.data(), std::ssize(cos_));
  convert_from_f32(row_.data(), row, dtype, row_.size());
}

}  // namespace infinigen
