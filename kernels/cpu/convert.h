// kernels/cpu: bulk conversions between fp32 and the 16-bit float formats (raw bits in/out).
#pragma once

#include <cstddef>
#include <cstdint>

namespace infinigen::kernels::cpu {

void f16_to_f32(const uint16_t* src, float* dst, size_t n);
void f32_to_f16(const float* src, uint16_t* dst, size_t n);
void bf16_to_f32(const uint16_t* src, float* dst, size_t n);
void f32_to_bf16(const float* src, uint16_t* dst, size_t n);

}  // namespace infinigen::kernels::cpu
