// kernels/cpu: bulk fp16/bf16 <-> fp32 conversions. Uses F16C when the build targets it
// (x86-64-v3), Eigen's scalar types otherwise; both round to nearest even.
#include "kernels/cpu/convert.h"

#include <Eigen/Core>
#include <cstring>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace infinigen::kernels::cpu {

void f16_to_f32(const uint16_t* src, float* dst, size_t n) {
  size_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(halves));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(src[i]));
}

void f32_to_f16(const float* src, uint16_t* dst, size_t n) {
  size_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    const __m128i halves = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), halves);
  }
#endif
  for (; i < n; ++i) dst[i] = Eigen::numext::bit_cast<uint16_t>(Eigen::half(src[i]));
}

void bf16_to_f32(const uint16_t* src, float* dst, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
    std::memcpy(dst + i, &bits, sizeof(float));
  }
}

void f32_to_bf16(const float* src, uint16_t* dst, size_t n) {
  for (size_t i = 0; i < n; ++i)
    dst[i] = Eigen::numext::bit_cast<uint16_t>(Eigen::bfloat16(src[i]));
}

}  // namespace infinigen::kernels::cpu
