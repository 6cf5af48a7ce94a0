// offload: FlexGen's group-wise asymmetric 4-bit codec for KV rows, on plain host pointers.
//
// A row of d fp32 values is cut into groups along head_dim: groups of 64 when d is a multiple of
// 64, one group of d when d < 64 (small test models); other d are refused. Each group keeps its
// min and scale as fp16 and one 4-bit code per element:
//   scale = (max - min) / 15,  q = round((x - min) / scale) in [0, 15],  x' = min + q * scale.
// A constant group has scale 0 and all codes 0. min is rounded down and scale up to fp16, so the
// grid min + [0, 15] * scale covers [min, max] and every element is within scale / 2 of its
// decoded value (values on the grid decode exactly). Inputs are expected within the fp16 range
// (the KV of an fp16 model).
//
// Layout of a row: codes (d / 2 bytes), element 2i in the low nibble of byte i and element 2i + 1
// in the high nibble; meta (G, 2) fp16, group g's [min, scale].
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"

namespace infinigen {

inline constexpr int64_t kInt4GroupSize = 64;

// Elements per group (64, or d when d < 64); throws Error for a d the codec cannot cut.
int64_t int4_group_size(int64_t d);
int64_t int4_groups(int64_t d);  // G = d / int4_group_size(d)
// Bytes of one quantised row: d / 2 codes plus G * (min, scale) in fp16.
size_t int4_code_bytes(int64_t d);
size_t int4_meta_bytes(int64_t d);
size_t int4_row_bytes(int64_t d);

// x (d) -> codes (d / 2), meta (G, 2).
void int4_quantize_row(const float* x, int64_t d, uint8_t* codes, f16* meta);
// codes (d / 2), meta (G, 2) -> out (d).
void int4_dequantize_row(const uint8_t* codes, const f16* meta, int64_t d, float* out);
// The same, written as fp16 (what attention reads from the staging buffer).
void int4_dequantize_row(const uint8_t* codes, const f16* meta, int64_t d, f16* out);

}  // namespace infinigen
