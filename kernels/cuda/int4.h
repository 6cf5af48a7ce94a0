// kernels/cuda: the int4 policy's 4-bit KV codec on the device, the twin of kernels/cpu/int4.h:
// the same layout and the same arithmetic in the same order (fp16 roundings toward -inf and +inf
// for a group's min and scale, codes rounded to nearest even, decoding as min + q * scale then
// nearest-even fp16), so codes, scales and decoded rows are bit-identical to the CPU's.
//
// Codes and meta are one layer of the int4 store (offload/int4_kv.h): rows laid out [2][B][H][rows]
// (K then V; sequence; head; token), row r's d / 2 code bytes at codes + r * d / 2 and its G
// (min, scale) fp16 pairs at meta + r * 2G (G = d / 64, or 1 when d < 64; d even, and below 64 or
// a multiple of it: the caller checks). Every pointer is device memory (or mapped pinned memory).
#pragma once

#include <cstdint>

namespace infinigen::kernels::cuda {

// Quantises keys and values (B * n, H * d) fp32 (row b * n + t holds token t of sequence b) into
// rows [0, n) of codes and meta ([2][B][H][rows], n <= rows): one thread per group of 64.
// `stream` is a cudaStream_t (null: the default stream).
int int4_quantize(const float* keys, const float* values, int64_t B, int64_t n, int64_t H,
                  int64_t d, uint8_t* codes, uint16_t* meta, int64_t rows, void* stream);

// Dequantises rows [t0, t1) of codes and meta ([2][B][H][rows]) into keys and values
// (B, H, capacity, d) fp16 (raw bits), row t to row row0 + t - t0; rows of sequence b that land
// before first_valid[b] (left padding: never read) are not written. first_valid (B) is an int32
// device array. One thread per code byte (two elements), grid-stride.
int int4_dequantize(const uint8_t* codes, const uint16_t* meta, int64_t rows, int64_t B, int64_t H,
                    int64_t d, int64_t t0, int64_t t1, const int32_t* first_valid, int64_t row0,
                    uint16_t* keys, uint16_t* values, int64_t capacity, void* stream);

}  // namespace infinigen::kernels::cuda
