// offload: the 4-bit KV codec.
#include "offload/int4_codec.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace infinigen {
namespace {

// The smallest fp16 above `h` (finite h).
f16 next_up(f16 h) {
  if ((h.bits & 0x7fffu) == 0) return f16{0x0001};  // +0 or -0: the smallest subnormal
  if (h.bits & 0x8000u) return f16{static_cast<uint16_t>(h.bits - 1)};
  return f16{static_cast<uint16_t>(h.bits + 1)};
}

// fp16 roundings toward +inf and -inf, so that the stored grid still covers the group.
f16 f16_round_up(float v) {
  const f16 h = float_to_f16(v);
  return f16_to_float(h) >= v ? h : next_up(h);
}

f16 f16_round_down(float v) {
  f16 h = f16_round_up(-v);
  h.bits ^= 0x8000u;  // -round_up(-v)
  return h;
}

}  // namespace

int64_t int4_group_size(int64_t d) {
  INFINIGEN_CHECK(d > 0 && d % 2 == 0 && (d < kInt4GroupSize || d % kInt4GroupSize == 0),
                  "int4 KV needs head_dim even and below ", kInt4GroupSize, " or a multiple of ",
                  kInt4GroupSize, " (got ", d, ")");
  return std::min(d, kInt4GroupSize);
}

int64_t int4_groups(int64_t d) {
  return d / int4_group_size(d);
}

size_t int4_code_bytes(int64_t d) {
  int4_group_size(d);  // validates d
  return static_cast<size_t>(d / 2);
}

size_t int4_meta_bytes(int64_t d) {
  return static_cast<size_t>(int4_groups(d)) * 2 * sizeof(f16);
}

size_t int4_row_bytes(int64_t d) {
  return int4_code_bytes(d) + int4_meta_bytes(d);
}

void int4_quantize_row(const float* x, int64_t d, uint8_t* codes, f16* meta) {
  const int64_t group = int4_group_size(d);
  for (int64_t g0 = 0; g0 < d; g0 += group) {
    float lo = x[g0], hi = x[g0];
    for (int64_t i = g0 + 1; i < g0 + group; ++i) {
      lo = std::min(lo, x[i]);
      hi = std::max(hi, x[i]);
    }
    const f16 min16 = f16_round_down(lo);
    const float min = f16_to_float(min16);
    const f16 scale16 = hi > min ? f16_round_up((hi - min) / 15.0f) : f16{0};
    const float scale = f16_to_float(scale16);
    f16* m = meta + 2 * (g0 / group);
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

namespace {

template <typename Out, typename Store>
void dequantize(const uint8_t* codes, const f16* meta, int64_t d, Out* out, Store store) {
  const int64_t group = int4_group_size(d);
  for (int64_t g0 = 0; g0 < d; g0 += group) {
    const f16* m = meta + 2 * (g0 / group);
    const float min = f16_to_float(m[0]);
    const float scale = f16_to_float(m[1]);
    for (int64_t i = g0; i < g0 + group; i += 2) {
      const uint8_t byte = codes[i / 2];
      out[i] = store(min + static_cast<float>(byte & 0x0f) * scale);
      out[i + 1] = store(min + static_cast<float>(byte >> 4) * scale);
    }
  }
}

}  // namespace

void int4_dequantize_row(const uint8_t* codes, const f16* meta, int64_t d, float* out) {
  dequantize(codes, meta, d, out, [](float v) { return v; });
}

void int4_dequantize_row(const uint8_t* codes, const f16* meta, int64_t d, f16* out) {
  dequantize(codes, meta, d, out, [](float v) { return float_to_f16(v); });
}

}  // namespace infinigen
