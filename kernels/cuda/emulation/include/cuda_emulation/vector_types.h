// kernels/cuda/emulation: CUDA's built-in vector types (what <vector_types.h> declares).
#pragma once

struct uint3 {
  unsigned int x, y, z;
};
struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1)
      : x(vx), y(vy), z(vz) {}
  constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
  constexpr operator uint3() const { return uint3{x, y, z}; }
};
struct float2 {
  float x, y;
};
struct float4 {
  float x, y, z, w;
};
struct int2 {
  int x, y;
};
struct int4 {
  int x, y, z, w;
};
struct alignas(16) uint4 {  // 16-byte aligned as CUDA's: one vector load or store
  unsigned int x, y, z, w;
};
inline constexpr float2 make_float2(float x, float y) {
  return float2{x, y};
}
inline constexpr float4 make_float4(float x, float y, float z, float w) {
  return float4{x, y, z, w};
}
inline constexpr int2 make_int2(int x, int y) {
  return int2{x, y};
}
inline constexpr uint3 make_uint3(unsigned x, unsigned y, unsigned z) {
  return uint3{x, y, z};
}
