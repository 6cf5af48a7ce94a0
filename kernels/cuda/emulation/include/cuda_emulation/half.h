// kernels/cuda/emulation: __half and __nv_bfloat16 as CUDA defines them: 16-bit storage,
// arithmetic in float, conversions rounded as CUDA's intrinsics round (round to nearest even for
// the _rn forms and the constructors; NaN becomes the canonical 0x7fff, as on a GPU).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cuda_emulation/vector_types.h"

namespace infinigen::cuda_emulation {

inline uint32_t float_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}
inline float bits_float(uint32_t bits) {
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
}

inline uint16_t float_to_half_bits(float value) {
  const uint32_t bits = float_bits(value);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return 0x7fff;                     // NaN
  if (magnitude >= 0x477ff000u) return sign | 0x7c00u;            // >= 65520: infinity
  if (magnitude < 0x38800000u) {                                  // below 2^-14: subnormal
    const float scaled = bits_float(magnitude) * 16777216.0f;     // exact: units of 2^-24
    return sign | static_cast<uint16_t>(std::nearbyint(scaled));  // ties to even; 1024 = 2^-14
  }
  const uint32_t mantissa = magnitude & 0x7fffffu;
  uint32_t half = ((((magnitude >> 23) - 127 + 15) << 10) | (mantissa >> 13));
  const uint32_t rest = mantissa & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half;  // a carry moves the exponent
  return sign | static_cast<uint16_t>(half);
}

inline float half_bits_to_float(uint16_t half) {
  const uint32_t sign = static_cast<uint32_t>(half & 0x8000u) << 16;
  const uint32_t exponent = (half >> 10) & 0x1fu, mantissa = half & 0x3ffu;
  if (exponent == 0) {
    const float magnitude = static_cast<float>(mantissa) * (1.0f / 16777216.0f);
    return sign ? -magnitude : magnitude;
  }
  if (exponent == 31) return bits_float(sign | 0x7f800000u | (mantissa << 13));
  return bits_float(sign | ((exponent - 15 + 127) << 23) | (mantissa << 13));
}

inline uint16_t float_to_bfloat16_bits(float value) {
  const uint32_t bits = float_bits(value);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fff;  // NaN
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

inline float bfloat16_bits_to_float(uint16_t bits) {
  return bits_float(static_cast<uint32_t>(bits) << 16);
}

}  // namespace infinigen::cuda_emulation

struct __half {
  uint16_t __x;
  __half() = default;
  __half(float value) : __x(infinigen::cuda_emulation::float_to_half_bits(value)) {}
  operator float() const { return infinigen::cuda_emulation::half_bits_to_float(__x); }
};

struct __nv_bfloat16 {
  uint16_t __x;
  __nv_bfloat16() = default;
  __nv_bfloat16(float value) : __x(infinigen::cuda_emulation::float_to_bfloat16_bits(value)) {}
  operator float() const { return infinigen::cuda_emulation::bfloat16_bits_to_float(__x); }
};

struct __half2 {
  __half x, y;
};
struct __nv_bfloat162 {
  __nv_bfloat16 x, y;
};

inline float __half2float(__half value) {
  return static_cast<float>(value);
}
inline __half __float2half(float value) {
  return __half(value);
}
inline __half __float2half_rn(float value) {
  return __half(value);
}
inline unsigned short __half_as_ushort(__half value) {
  return value.__x;
}
inline __half __ushort_as_half(unsigned short bits) {
  __half value;
  value.__x = bits;
  return value;
}
inline float __bfloat162float(__nv_bfloat16 value) {
  return static_cast<float>(value);
}
inline __nv_bfloat16 __float2bfloat16(float value) {
  return __nv_bfloat16(value);
}
inline __nv_bfloat16 __float2bfloat16_rn(float value) {
  return __nv_bfloat16(value);
}
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 value) {
  return value.__x;
}
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short bits) {
  __nv_bfloat16 value;
  value.__x = bits;
  return value;
}
inline __half2 __floats2half2_rn(float a, float b) {
  return __half2{__half(a), __half(b)};
}
inline float2 __half22float2(__half2 value) {
  return float2{static_cast<float>(value.x), static_cast<float>(value.y)};
}
inline float __low2float(__half2 value) {
  return static_cast<float>(value.x);
}
inline float __high2float(__half2 value) {
  return static_cast<float>(value.y);
}
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
  return __nv_bfloat162{__nv_bfloat16(a), __nv_bfloat16(b)};
}
inline float2 __bfloat1622float2(__nv_bfloat162 value) {
  return float2{static_cast<float>(value.x), static_cast<float>(value.y)};
}

// Arithmetic: computed in float and rounded once, as the hardware's fp16/bf16 instructions do.
#define INFINIGEN_EMULATION_HALF_OPERATORS(T, prefix)                                        \
  inline T prefix##add(T a, T b) {                                                           \
    return T(static_cast<float>(a) + static_cast<float>(b));                                 \
  }                                                                                          \
  inline T prefix##sub(T a, T b) {                                                           \
    return T(static_cast<float>(a) - static_cast<float>(b));                                 \
  }                                                                                          \
  inline T prefix##mul(T a, T b) {                                                           \
    return T(static_cast<float>(a) * static_cast<float>(b));                                 \
  }                                                                                          \
  inline T prefix##div(T a, T b) {                                                           \
    return T(static_cast<float>(a) / static_cast<float>(b));                                 \
  }                                                                                          \
  inline T prefix##fma(T a, T b, T c) {                                                      \
    return T(std::fma(static_cast<float>(a), static_cast<float>(b), static_cast<float>(c))); \
  }                                                                                          \
  inline T prefix##neg(T a) {                                                                \
    return T(-static_cast<float>(a));                                                        \
  }                                                                                          \
  inline bool prefix##isnan(T a) {                                                           \
    return std::isnan(static_cast<float>(a));                                                \
  }                                                                                          \
  inline T operator+(T a, T b) {                                                             \
    return prefix##add(a, b);                                                                \
  }                                                                                          \
  inline T operator-(T a, T b) {                                                             \
    return prefix##sub(a, b);                                                                \
  }                                                                                          \
  inline T operator*(T a, T b) {                                                             \
    return prefix##mul(a, b);                                                                \
  }                                                                                          \
  inline T operator/(T a, T b) {                                                             \
    return prefix##div(a, b);                                                                \
  }                                                                                          \
  inline T operator-(T a) {                                                                  \
    return prefix##neg(a);                                                                   \
  }                                                                                          \
  inline bool operator==(T a, T b) {                                                         \
    return static_cast<float>(a) == static_cast<float>(b);                                   \
  }                                                                                          \
  inline bool operator!=(T a, T b) {                                                         \
    return static_cast<float>(a) != static_cast<float>(b);                                   \
  }                                                                                          \
  inline bool operator<(T a, T b) {                                                          \
    return static_cast<float>(a) < static_cast<float>(b);                                    \
  }                                                                                          \
  inline bool operator>(T a, T b) {                                                          \
    return static_cast<float>(a) > static_cast<float>(b);                                    \
  }                                                                                          \
  inline T __hmax(T a, T b) {                                                                \
    return a < b ? b : a;                                                                    \
  }                                                                                          \
  inline T __hmin(T a, T b) {                                                                \
    return b < a ? b : a;                                                                    \
  }
// The same names serve both types, as in CUDA's headers.
INFINIGEN_EMULATION_HALF_OPERATORS(__half, __h)
INFINIGEN_EMULATION_HALF_OPERATORS(__nv_bfloat16, __h)
#undef INFINIGEN_EMULATION_HALF_OPERATORS
