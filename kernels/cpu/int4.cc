// kernels/cpu: the 4-bit KV codec (kernels/cpu/int4.h states its arithmetic; kernels/cuda/int4.cu
// repeats it on the device).
#include "kernels/cpu/int4.h"

#include <Eigen/Core>
#include <algorithm>
#include <cmath>

namespace infinigen::kernels::cpu {
namespace {

// fp16 <-> fp32, round to nearest even (F16C when the build targets it), as core/dtype.h's.
float half_value(uint16_t bits) {
  return static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(bits));
}
uint16_t half_bits(float value) {
  return Eigen::numext::bit_cast<uint16_t>(Eigen::half(value));
}

// The smallest fp16 above `h` (finite h).
uint16_t next_up(uint16_t h) {
  if ((h & 0x7fffu) == 0) return 0x0001;  // +0 or -0: the smallest subnormal
  if (h & 0x8000u) return static_cast<uint16_t>(h - 1);
  return static_cast<uint16_t>(h + 1);
}

// fp16 roundings toward +inf and -inf, so that the stored grid still covers the group.
uint16_t round_up(float v) {
  const uint16_t h = half_bits(v);
  return half_value(h) >= v ? h : next_up(h);
}

uint16_t round_down(float v) {
  return static_cast<uint16_t>(round_up(-v) ^ 0x8000u);  // -round_up(-v)
}

template <typename Out, typename Store>
void dequantize(const uint8_t* codes, const uint16_t* meta, int64_t d, Out* out, Store store) {
  const int64_t group = int4_group_size(d);
  for (int64_t g0 = 0; g0 < d; g0 += group) {
    const uint16_t* m = meta + 2 * (g0 / group);
    const float min = half_value(m[0]);
    const float scale = half_value(m[1]);
    for (int64_t i = g0; i < g0 + group; i += 2) {
      const uint8_t byte = codes[i / 2];
      out[i] = store(min + static_cast<float>(byte & 0x0f) * scale);
      out[i + 1] = store(min + static_cast<float>(byte >> 4) * scale);
    }
  }
}

}  // namespace

void int4_quantize_row(const float* x, int64_t d, uint8_t* codes, uint16_t* meta) {
  const int64_t group = int4_group_size(d);
  for (int64_t g0 = 0; g0 < d; g0 += group) {
    float lo = x[g0], hi = x[g0];
    for (int64_t i = g0 + 1; i < g0 + group; ++i) {
      lo = std::min(lo, x[i]);
      hi = std::max(hi, x[i]);
    }
    const uint16_t min16 = round_down(lo);
    const float min = half_value(min16);
    const uint16_t scale16 = hi > min ? round_up((hi - min) / 15.0f) : uint16_t{0};
    const float scale = half_value(scale16);
    uint16_t* m = meta + 2 * (g0 / group);
    m[0] = min16;
    m[1] = scale16;
    for (int64_t i = g0; i < g0 + group; i += 2) {
      uint8_t q[2] = {0, 0};
      if (scale > 0.0f) {
        for (int k = 0; k < 2; ++k) {
          const float v = std::nearbyint((x[i + k] - min) / scale);
          q[k] = static_cast<uint8_t>(std::clamp(v, 0.0f, 15.0f));
        }
      }
      codes[i / 2] = static_cast<uint8_t>(q[0] | (q[1] << 4));
    }
  }
}

void int4_dequantize_row(const uint8_t* codes, const uint16_t* meta, int64_t d, float* out) {
  dequantize(codes, meta, d, out, [](float v) { return v; });
}

void int4_dequantize_row_f16(const uint8_t* codes, const uint16_t* meta, int64_t d, uint16_t* out) {
  dequantize(codes, meta, d, out, [](float v) { return half_bits(v); });
}

void int4_quantize(const float* keys, const float* values, int64_t B, int64_t n, int64_t H,
                   int64_t d, uint8_t* codes, uint16_t* meta, int64_t rows) {
  const int64_t code_bytes = d / 2, meta_halves = 2 * (d / int4_group_size(d));
  for (int64_t kind = 0; kind < 2; ++kind) {
    const float* src = kind == 0 ? keys : values;
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t t = 0; t < n; ++t) {
        for (int64_t h = 0; h < H; ++h) {
          const int64_t row = ((kind * B + b) * H + h) * rows + t;
          int4_quantize_row(src + ((b * n + t) * H + h) * d, d, codes + row * code_bytes,
                            meta + row * meta_halves);
        }
      }
    }
  }
}

void int4_dequantize(const uint8_t* codes, const uint16_t* meta, int64_t rows, int64_t B, int64_t H,
                     int64_t d, int64_t t0, int64_t t1, const int32_t* first_valid, int64_t row0,
                     uint16_t* keys, uint16_t* values, int64_t capacity) {
  const int64_t code_bytes = d / 2, meta_halves = 2 * (d / int4_group_size(d));
  for (int64_t kind = 0; kind < 2; ++kind) {
    uint16_t* out = kind == 0 ? keys : values;
    for (int64_t b = 0; b < B; ++b) {
      // Left padding is never read by attention, so it is not decoded.
      const int64_t first = std::max(t0, first_valid[b] - row0 + t0);
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t t = first; t < t1; ++t) {
          const int64_t row = ((kind * B + b) * H + h) * rows + t;
          int4_dequantize_row_f16(codes + row * code_bytes, meta + row * meta_halves, d,
                                  out + ((b * H + h) * capacity + row0 + t - t0) * d);
        }
      }
    }
  }
}

}  // namespace infinigen::kernels::cpu
