// kernels/cuda/emulation: the device side of CUDA C++ that the .cu sources use, for the emulated
// device. A block's threads run as fibers on one host thread (block.cc), so:
// - threadIdx and friends read the indices of the fiber that is running;
// - __syncthreads is a counting barrier (an exited thread counts as arrived) and the warp
//   collectives (__shfl*_sync, __ballot_sync, __any_sync, __all_sync, __syncwarp) wait for every
//   lane their mask names; whatever cannot complete is a fault naming the kernel, never a hang;
// - __shared__ variables are thread_local statics: every fiber of the block (one block at a time
//   per host thread) sees the same storage, and another stream's worker thread its own.
#pragma once

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cuda_emulation/vector_types.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...)
#define __shared__ static thread_local
#define __constant__
#define __align__(n) alignas(n)

namespace infinigen::cuda_emulation {

struct ExecutionIndices {
  uint3 thread_idx{0, 0, 0};
  uint3 block_idx{0, 0, 0};
  dim3 block_dim{1, 1, 1};
  dim3 grid_dim{1, 1, 1};
};
// Set by the block scheduler before it resumes a fiber.
inline thread_local ExecutionIndices current_indices;

inline const uint3& thread_index() {
  return current_indices.thread_idx;
}
inline const uint3& block_index() {
  return current_indices.block_idx;
}
inline const dim3& block_dim() {
  return current_indices.block_dim;
}
inline const dim3& grid_dim() {
  return current_indices.grid_dim;
}

enum class CollectiveOp { Shuffle, ShuffleUp, ShuffleDown, ShuffleXor, Ballot, Any, All, SyncWarp };

// __syncthreads of the running fiber.
void barrier();
// One lane's part in a warp collective: returns the lane's result (the shuffled value's bits, or
// the vote) once every lane of `mask` has arrived.
uint64_t warp_collective(CollectiveOp op, unsigned mask, uint64_t value, int arg, int width);
// Lanes of the running fiber's warp that exist and have not exited.
unsigned active_mask();
// The launch's dynamic shared memory (the third launch parameter's bytes).
void* dynamic_shared_memory();
// A fault in device code (__trap): the kernel stops and the error is sticky, as on a GPU.
[[noreturn]] void device_trap(const char* what);

template <typename T>
T shuffle(CollectiveOp op, unsigned mask, T value, int arg, int width) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= sizeof(uint64_t),
                "a shuffled value is at most 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  bits = warp_collective(op, mask, bits, arg, width);
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}

// Read-modify-write on memory other threads (and other streams' workers) may touch.
template <typename T, typename F>
T atomic_update(T* address, F&& update) {
  std::atomic_ref<T> ref(*address);
  T old = ref.load();
  while (!ref.compare_exchange_weak(old, update(old))) {
  }
  return old;
}

}  // namespace infinigen::cuda_emulation

#define threadIdx (::infinigen::cuda_emulation::thread_index())
#define blockIdx (::infinigen::cuda_emulation::block_index())
#define blockDim (::infinigen::cuda_emulation::block_dim())
#define gridDim (::infinigen::cuda_emulation::grid_dim())
#define INFINIGEN_EMULATED_DYNAMIC_SHARED(type, name) \
  type* const name = static_cast<type*>(::infinigen::cuda_emulation::dynamic_shared_memory())

inline constexpr int warpSize = 32;

inline void __syncthreads() {
  infinigen::cuda_emulation::barrier();
}
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  infinigen::cuda_emulation::warp_collective(infinigen::cuda_emulation::CollectiveOp::SyncWarp,
                                             mask, 0, 0, warpSize);
}
inline unsigned __activemask() {
  return infinigen::cuda_emulation::active_mask();
}
inline void __threadfence() {
  std::atomic_thread_fence(std::memory_order_seq_cst);
}
inline void __threadfence_block() {
  std::atomic_thread_fence(std::memory_order_seq_cst);
}
[[noreturn]] inline void __trap() {
  infinigen::cuda_emulation::device_trap("__trap()");
}

template <typename T>
T __shfl_sync(unsigned mask, T value, int src_lane, int width = warpSize) {
  return infinigen::cuda_emulation::shuffle(infinigen::cuda_emulation::CollectiveOp::Shuffle, mask,
                                            value, src_lane, width);
}
template <typename T>
T __shfl_up_sync(unsigned mask, T value, unsigned delta, int width = warpSize) {
  return infinigen::cuda_emulation::shuffle(infinigen::cuda_emulation::CollectiveOp::ShuffleUp,
                                            mask, value, static_cast<int>(delta), width);
}
template <typename T>
T __shfl_down_sync(unsigned mask, T value, unsigned delta, int width = warpSize) {
  return infinigen::cuda_emulation::shuffle(infinigen::cuda_emulation::CollectiveOp::ShuffleDown,
                                            mask, value, static_cast<int>(delta), width);
}
template <typename T>
T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = warpSize) {
  return infinigen::cuda_emulation::shuffle(infinigen::cuda_emulation::CollectiveOp::ShuffleXor,
                                            mask, value, lane_mask, width);
}
inline unsigned __ballot_sync(unsigned mask, int predicate) {
  return static_cast<unsigned>(infinigen::cuda_emulation::warp_collective(
      infinigen::cuda_emulation::CollectiveOp::Ballot, mask, predicate != 0, 0, warpSize));
}
inline int __any_sync(unsigned mask, int predicate) {
  return static_cast<int>(infinigen::cuda_emulation::warp_collective(
      infinigen::cuda_emulation::CollectiveOp::Any, mask, predicate != 0, 0, warpSize));
}
inline int __all_sync(unsigned mask, int predicate) {
  return static_cast<int>(infinigen::cuda_emulation::warp_collective(
      infinigen::cuda_emulation::CollectiveOp::All, mask, predicate != 0, 0, warpSize));
}

template <typename T>
T atomicAdd(T* address, T value) {
  return std::atomic_ref<T>(*address).fetch_add(value);
}
template <typename T>
T atomicSub(T* address, T value) {
  return std::atomic_ref<T>(*address).fetch_sub(value);
}
template <typename T>
T atomicExch(T* address, T value) {
  return std::atomic_ref<T>(*address).exchange(value);
}
template <typename T>
T atomicCAS(T* address, T compare, T value) {
  std::atomic_ref<T>(*address).compare_exchange_strong(compare, value);
  return compare;  // the old value, whether or not it was replaced
}
template <typename T>
T atomicMax(T* address, T value) {
  return infinigen::cuda_emulation::atomic_update(
      address, [value](T old) { return old < value ? value : old; });
}
template <typename T>
T atomicMin(T* address, T value) {
  return infinigen::cuda_emulation::atomic_update(
      address, [value](T old) { return value < old ? value : old; });
}
template <typename T>
T atomicAnd(T* address, T value) {
  return std::atomic_ref<T>(*address).fetch_and(value);
}
template <typename T>
T atomicOr(T* address, T value) {
  return std::atomic_ref<T>(*address).fetch_or(value);
}
template <typename T>
T atomicXor(T* address, T value) {
  return std::atomic_ref<T>(*address).fetch_xor(value);
}

// Math: CUDA's device functions that the C library lacks. The fast intrinsics (__expf, ...) are
// computed precisely here: a kernel that is right with them on a GPU is right with these.
inline float rsqrtf(float x) {
  return 1.0f / std::sqrt(x);
}
inline float __expf(float x) {
  return std::exp(x);
}
inline float __logf(float x) {
  return std::log(x);
}
inline float __powf(float x, float y) {
  return std::pow(x, y);
}
inline float __sinf(float x) {
  return std::sin(x);
}
inline float __cosf(float x) {
  return std::cos(x);
}
inline void __sincosf(float x, float* s, float* c) {
  *s = std::sin(x);
  *c = std::cos(x);
}
inline float __fdividef(float x, float y) {
  return x / y;
}
inline float __frcp_rn(float x) {
  return 1.0f / x;
}
inline float __fsqrt_rn(float x) {
  return std::sqrt(x);
}
inline float __fmaf_rn(float x, float y, float z) {
  return std::fma(x, y, z);
}
// A product and a sum rounded on their own, which nvcc never fuses into an FMA: the product passes
// through a volatile so that the host compiler cannot contract it with the add that follows
// either (GCC contracts across inlined calls by default).
inline float __fmul_rn(float x, float y) {
  volatile float product = x * y;
  return product;
}
inline float __fadd_rn(float x, float y) {
  return x + y;
}
inline float __saturatef(float x) {
  return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x);
}
inline int __popc(unsigned x) {
  return __builtin_popcount(x);
}
inline int __popcll(unsigned long long x) {
  return __builtin_popcountll(x);
}
inline int __clz(int x) {
  return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x));
}
inline int __ffs(int x) {
  return __builtin_ffs(x);
}
inline int min(int a, int b) {
  return a < b ? a : b;
}
inline int max(int a, int b) {
  return a < b ? b : a;
}
inline unsigned min(unsigned a, unsigned b) {
  return a < b ? a : b;
}
inline unsigned max(unsigned a, unsigned b) {
  return a < b ? b : a;
}
inline long long min(long long a, long long b) {
  return a < b ? a : b;
}
inline long long max(long long a, long long b) {
  return a < b ? b : a;
}
inline float min(float a, float b) {
  return std::fmin(a, b);
}
inline float max(float a, float b) {
  return std::fmax(a, b);
}
