// kernels/cpu: element types of weight and cache buffers that kernels read (activations are fp32).
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/cpu/convert.h"

namespace infinigen::kernels::cpu {

enum class Element { F32, F16, BF16 };

// Widens `n` elements starting at element `offset` of `src` to fp32.
inline void widen(const void* src, Element type, size_t offset, float* dst, size_t n) {
  switch (type) {
    case Element::F32:
      for (size_t i = 0; i < n; ++i) dst[i] = static_cast<const float*>(src)[offset + i];
      return;
    case Element::F16:
      f16_to_f32(static_cast<const uint16_t*>(src) + offset, dst, n);
      return;
    case Element::BF16:
      bf16_to_f32(static_cast<const uint16_t*>(src) + offset, dst, n);
      return;
  }
}

// Narrows `n` fp32 values into `dst` starting at element `offset`.
inline void narrow(const float* src, void* dst, Element type, size_t offset, size_t n) {
  switch (type) {
    case Element::F32:
      for (size_t i = 0; i < n; ++i) static_cast<float*>(dst)[offset + i] = src[i];
      return;
    case Element::F16:
      f32_to_f16(src, static_cast<uint16_t*>(dst) + offset, n);
      return;
    case Element::BF16:
      f32_to_bf16(src, static_cast<uint16_t*>(dst) + offset, n);
      return;
  }
}

}  // namespace infinigen::kernels::cpu
