// core: element types of tensors and checkpoints, and scalar conversions to and from fp32.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace infinigen {

enum class DType : uint8_t { F32, F16, BF16, I32, I64 };

// Storage types for the 16-bit floats. They only carry bits; arithmetic happens in fp32.
struct f16 {
  uint16_t bits;
};
struct bf16 {
  uint16_t bits;
};

size_t dtype_size(DType dtype);
// Safetensors spelling: "F32", "F16", "BF16", "I32", "I64".
std::string_view dtype_name(DType dtype);
// Parses a safetensors dtype name; returns false for anything this engine does not read.
bool parse_dtype(std::string_view name, DType* out);
// Parses user spellings: "f32"/"float32", "f16"/"float16"/"half", "bf16"/"bfloat16".
DType parse_float_dtype(std::string_view name);
// The short lowercase spelling parse_float_dtype reads back: "f32", "f16", "bf16".
std::string_view float_dtype_spelling(DType dtype);

template <typename T>
constexpr DType dtype_of();
template <>
constexpr DType dtype_of<float>() {
  return DType::F32;
}
template <>
constexpr DType dtype_of<f16>() {
  return DType::F16;
}
template <>
constexpr DType dtype_of<bf16>() {
  return DType::BF16;
}
template <>
constexpr DType dtype_of<int32_t>() {
  return DType::I32;
}
template <>
constexpr DType dtype_of<int64_t>() {
  return DType::I64;
}

// Scalar conversions (IEEE binary16 and bfloat16, round to nearest even), via Eigen's types.
float f16_to_float(f16 value);
f16 float_to_f16(float value);
float bf16_to_float(bf16 value);
bf16 float_to_bf16(float value);

// Bulk conversions of `n` elements of a floating-point `dtype` on the CPU.
void convert_to_f32(const void* src, DType src_dtype, float* dst, size_t n);
void convert_from_f32(const float* src, void* dst, DType dst_dtype, size_t n);

}  // namespace infinigen
