// kernels/cpu: FlexGen's group-wise asymmetric 4-bit codec for KV rows (the `int4` policy),
// on raw pointers; kernels/cuda/int4.h is its twin, bit for bit.
//
// A row of d fp32 values is cut into groups along head_dim: groups of 64 when d is a multiple of
// 64, one group of d when d < 64 (small test models); the caller checks d (ops::int4_group_size
// refuses any other). Each group keeps its min and scale as fp16 and one 4-bit code per element:
//   scale = (max - min) / 15,  q = round((x - min) / scale) in [0, 15],  x' = min + q * scale.
// A constant group has scale 0 and all codes 0. min is rounded down and scale up to fp16, so the
// grid min + [0, 15] * scale covers [min, max] and every element is within scale / 2 of its
// decoded value (values on the grid decode exactly). Inputs are expected within the fp16 range
// (the KV of an fp16 model).
//
// The arithmetic, exactly (the CUDA kernels do the same operations in the same order):
//   lo, hi    the group's min and max, scanned in order as std::min / std::max do
//             (x < lo ? x : lo), so that -0 and +0 resolve as here;
//   min       fp16(lo) rounded toward -inf: -(round toward +inf of -lo);
//   scale     hi > min ? fp16((hi - min) / 15.0f) rounded toward +inf : 0 (fp32 arithmetic);
//             round toward +inf of v: the nearest-even fp16 of v, or the next fp16 above it when
//             that is below v;
//   q         scale > 0 ? clamp(nearbyint((x - min) / scale), 0, 15) : 0, ties to even;
//   x'        min + q * scale in fp32, then nearest-even fp16 for fp16 rows. q * scale is exact
//             (a 4-bit integer times an 11-bit significand), so a fused multiply-add, which
//             compilers may or may not contract this into, gives the same value.
//
// Layout of a row: codes (d / 2 bytes), element 2i in the low nibble of byte i and element 2i + 1
// in the high nibble; meta (G, 2) fp16 (as raw bits), group g's [min, scale].
//
// The batched forms work on one layer of the int4 store (offload/int4_kv.h): rows laid out
// [2][B][H][rows] (K then V; sequence; head; token), codes and meta as two arrays. They run on the
// calling thread, as the store's host codec always has (the cost model's codec rate is measured
// that way, predict/profile_measurement.cc).
#pragma once

#include <cstdint>

namespace infinigen::kernels::cpu {

inline constexpr int64_t kInt4GroupSize = 64;

// Elements per group of a row of d (64, or d when d < 64).
constexpr int64_t int4_group_size(int64_t d) {
  return d < kInt4GroupSize ? d : kInt4GroupSize;
}

// x (d) -> codes (d / 2), meta (G, 2) fp16 bits.
void int4_quantize_row(const float* x, int64_t d, uint8_t* codes, uint16_t* meta);
// codes (d / 2), meta (G, 2) -> out (d) fp32.
void int4_dequantize_row(const uint8_t* codes, const uint16_t* meta, int64_t d, float* out);
// The same, written as fp16 bits (what attention reads from the staging buffer).
void int4_dequantize_row_f16(const uint8_t* codes, const uint16_t* meta, int64_t d, uint16_t* out);

// Quantises keys and values (B * n, H * d) fp32 (row b * n + t holds token t of sequence b) into
// rows [0, n) of codes and meta laid out [2][B][H][rows]: row ((kind * B + b) * H + h) * rows + t
// has d / 2 bytes at codes + row * d / 2 and 2G fp16 at meta + row * 2G. n <= rows.
void int4_quantize(const float* keys, const float* values, int64_t B, int64_t n, int64_t H,
                   int64_t d, uint8_t* codes, uint16_t* meta, int64_t rows);

// Dequantises rows [t0, t1) of codes and meta ([2][B][H][rows], as above) into keys and values
// (B, H, capacity, d) fp16 bits, row t going to row row0 + t - t0. Rows of sequence b whose
// destination lies before first_valid[b] (left padding, never read) are not written.
void int4_dequantize(const uint8_t* codes, const uint16_t* meta, int64_t rows, int64_t B, int64_t H,
                     int64_t d, int64_t t0, int64_t t1, const int32_t* first_valid, int64_t row0,
                     uint16_t* keys, uint16_t* values, int64_t capacity);

}  // namespace infinigen::kernels::cpu
