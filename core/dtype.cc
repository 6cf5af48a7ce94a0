// core: element types and scalar fp16/bf16 conversions.
#include "core/dtype.h"

#include <Eigen/Core>
#include <cstring>

#include "core/error.h"
#include "kernels/cpu/convert.h"

namespace infinigen {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::F32:
      return 4;
    case DType::F16:
      return 2;
    case DType::BF16:
      return 2;
    case DType::I32:
      return 4;
    case DType::I64:
      return 8;
  }
  return 0;
}

std::string_view dtype_name(DType dtype) {
  switch (dtype) {
    case DType::F32:
      return "F32";
    case DType::F16:
      return "F16";
    case DType::BF16:
      return "BF16";
    case DType::I32:
      return "I32";
    case DType::I64:
      return "I64";
  }
  return "?";
}

bool parse_dtype(std::string_view name, DType* out) {
  static constexpr DType kAll[] = {DType::F32, DType::F16, DType::BF16, DType::I32, DType::I64};
  for (DType d : kAll) {
    if (dtype_name(d) == name) {
      *out = d;
      return true;
    }
  }
  return false;
}

std::string_view float_dtype_spelling(DType dtype) {
  switch (dtype) {
    case DType::F32:
      return "f32";
    case DType::F16:
      return "f16";
    case DType::BF16:
      return "bf16";
    default:
      fail("not a floating-point type: ", dtype_name(dtype));
  }
}

DType parse_float_dtype(std::string_view name) {
  if (name == "f32" || name == "float32" || name == "F32") return DType::F32;
  if (name == "f16" || name == "float16" || name == "half" || name == "F16") return DType::F16;
  if (name == "bf16" || name == "bfloat16" || name == "BF16") return DType::BF16;
  fail("unknown floating-point type '", name, "' (expected f32, f16 or bf16)");
}

float f16_to_float(f16 value) {
  return static_cast<float>(Eigen::numext::bit_cast<Eigen::half>(value.bits));
}
f16 float_to_f16(float value) {
  return {Eigen::numext::bit_cast<uint16_t>(Eigen::half(value))};
}
float bf16_to_float(bf16 value) {
  return static_cast<float>(Eigen::numext::bit_cast<Eigen::bfloat16>(value.bits));
}
bf16 float_to_bf16(float value) {
  return {Eigen::numext::bit_cast<uint16_t>(Eigen::bfloat16(value))};
}

void convert_to_f32(const void* src, DType src_dtype, float* dst, size_t n) {
  switch (src_dtype) {
    case DType::F32:
      std::memcpy(dst, src, n * sizeof(float));
      return;
    case DType::F16:
      kernels::cpu::f16_to_f32(static_cast<const uint16_t*>(src), dst, n);
      return;
    case DType::BF16:
      kernels::cpu::bf16_to_f32(static_cast<const uint16_t*>(src), dst, n);
      return;
    default:
      fail("cannot convert ", dtype_name(src_dtype), " to F32");
  }
}

void convert_from_f32(const float* src, void* dst, DType dst_dtype, size_t n) {
  switch (dst_dtype) {
    case DType::F32:
      std::memcpy(dst, src, n * sizeof(float));
      return;
    case DType::F16:
      kernels::cpu::f32_to_f16(src, static_cast<uint16_t*>(dst), n);
      return;
    case DType::BF16:
      kernels::cpu::f32_to_bf16(src, static_cast<uint16_t*>(dst), n);
      return;
    default:
      fail("cannot convert F32 to ", dtype_name(dst_dtype));
  }
}

}  // namespace infinigen
