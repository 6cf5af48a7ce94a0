// tests: the emulated CUDA device's contract, written as CUDA code (label gpu; built only with
// INFINIGEN_CUDA=EMULATE). What a GPU would show on its own terms (shuffles, votes, barriers,
// atomics, fp16/bf16 rounding, streams ordered by events, stream-ordered allocation, cuBLAS's
// products and argument checks) is checked exactly; what a GPU turns into a hang or silent
// corruption (a barrier that cannot complete, a shuffle naming an exited lane, a host pointer
// given to a kernel, a copy of the wrong kind or past an allocation's end, a leading dimension
// that reads a neighbour's data) must be an error here, naming the culprit.
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "kernels/cuda/common.cuh"

namespace {

// A fault makes the device's error sticky, as on a GPU; the emulation's cudaDeviceReset clears it
// so that the next test starts clean.
class Emulation : public ::testing::Test {
 protected:
  void TearDown() override {
    cudaDeviceReset();
    cudaGetLastError();
  }
};

template <typename T>
T* device_array(size_t count) {
  T* p = nullptr;
  EXPECT_EQ(cudaMalloc(&p, count * sizeof(T)), cudaSuccess);
  return p;
}

template <typename T>
std::vector<T> to_host(const T* device, size_t count) {
  std::vector<T> host(count);
  EXPECT_EQ(cudaMemcpy(host.data(), device, count * sizeof(T), cudaMemcpyDeviceToHost),
            cudaSuccess);
  return host;
}

// ---- warps ----

// out[i] for every lane i of every warp, per variant: 0 __shfl_sync(src = i * 7), 1 up by 3,
// 2 down by 5, 3 xor 6, each with `width`; 4 ballot of odd lanes, 5 any(lane == 9), 6 all(lane <
// 40).
__global__ void warp_kernel(int* out, int width) {
  const int i = threadIdx.x, lane = i % 32;
  const int n = blockDim.x;
  const int value = 1000 + i;
  out[0 * n + i] = __shfl_sync(0xffffffffu, value, lane * 7, width);
  out[1 * n + i] = __shfl_up_sync(0xffffffffu, value, 3, width);
  out[2 * n + i] = __shfl_down_sync(0xffffffffu, value, 5, width);
  out[3 * n + i] = __shfl_xor_sync(0xffffffffu, value, 6, width);
  out[4 * n + i] = static_cast<int>(__ballot_sync(0xffffffffu, lane % 2));
  out[5 * n + i] = __any_sync(0xffffffffu, lane == 9);
  out[6 * n + i] = __all_sync(0xffffffffu, lane < 40);
}

TEST_F(Emulation, ShufflesAndVotesAreExactForEveryWidth) {
  constexpr int kThreads = 64;
  for (const int width : {32, 16, 8, 4}) {
    int* out = device_array<int>(7 * kThreads);
    INFINIGEN_LAUNCH(1, kThreads, 0, nullptr, warp_kernel)(out, width);
    ASSERT_EQ(cudaGetLastError(), cudaSuccess);
    const std::vector<int> got = to_host(out, 7 * kThreads);
    for (int i = 0; i < kThreads; ++i) {
      const int lane = i % 32, warp_first = i - lane;
      const int first = lane & ~(width - 1), last = first + width - 1;
      const auto at = [&](int l) { return 1000 + warp_first + l; };
      SCOPED_TRACE("width " + std::to_string(width) + ", thread " + std::to_string(i));
      EXPECT_EQ(got[0 * kThreads + i], at(first + (lane * 7) % width));
      EXPECT_EQ(got[1 * kThreads + i], lane - 3 >= first ? at(lane - 3) : at(lane));
      EXPECT_EQ(got[2 * kThreads + i], lane + 5 <= last ? at(lane + 5) : at(lane));
      EXPECT_EQ(got[3 * kThreads + i], (lane ^ 6) <= last ? at(lane ^ 6) : at(lane));
      EXPECT_EQ(static_cast<unsigned>(got[4 * kThreads + i]), 0xaaaaaaaau);
      EXPECT_EQ(got[5 * kThreads + i], 1);
      EXPECT_EQ(got[6 * kThreads + i], 1);
    }
    cudaFree(out);
  }
}

// Lanes 16-31 exit; lanes 0-15 then shuffle with a full mask, naming the exited lanes.
__global__ void exited_lane_kernel(float* out) {
  if (threadIdx.x >= 16) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.0f, 1);
}

TEST_F(Emulation, AMaskNamingAnExitedLaneIsAnError) {
  float* out = device_array<float>(32);
  INFINIGEN_LAUNCH(1, 32, 0, nullptr, exited_lane_kernel)(out);
  // The fault is found when the kernel runs, and reported from then on (sticky).
  const cudaError_t error = cudaDeviceSynchronize();
  EXPECT_EQ(error, cudaErrorLaunchFailure);
  EXPECT_NE(std::string(cudaGetErrorString(error)).find("exited_lane_kernel"), std::string::npos)
      << cudaGetErrorString(error);
}

// A partial mask is exact too: lanes 0-15 shuffle among themselves while 16-31 do other work.
__global__ void partial_mask_kernel(int* out) {
  const int lane = threadIdx.x;
  if (lane < 16) {
    out[lane] = __shfl_down_sync(0x0000ffffu, lane, 1, 16);
  } else {
    out[lane] = -lane;
  }
}

TEST_F(Emulation, PartialMasksShuffleAmongTheirLanes) {
  int* out = device_array<int>(32);
  INFINIGEN_LAUNCH(1, 32, 0, nullptr, partial_mask_kernel)(out);
  const std::vector<int> got = to_host(out, 32);
  for (int lane = 0; lane < 16; ++lane) EXPECT_EQ(got[lane], lane < 15 ? lane + 1 : lane);
  for (int lane = 16; lane < 32; ++lane) EXPECT_EQ(got[lane], -lane);
  cudaFree(out);
}

// ---- barriers ----

// Warps reach different numbers of barriers (warp w loops w + 1 times, then exits): barriers
// count arrivals and exited threads count as arrived, so every barrier completes.
__global__ void uneven_barriers_kernel(int* out) {
  __shared__ int slots[4];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int round = 0; round <= warp; ++round) {
    if (lane == 0) slots[warp] = round;
    __syncthreads();
  }
  if (lane == 0) out[warp] = slots[warp];
}

TEST_F(Emulation, BarriersCountArrivalsAndExitedThreads) {
  int* out = device_array<int>(4);
  INFINIGEN_LAUNCH(1, 128, 0, nullptr, uneven_barriers_kernel)(out);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const std::vector<int> got = to_host(out, 4);
  for (int warp = 0; warp < 4; ++warp) EXPECT_EQ(got[warp], warp);
  cudaFree(out);
}

// Lanes 0-15 of warp 0 wait at the barrier, lanes 16-31 in a full-warp shuffle that needs them:
// neither can complete. On a GPU this hangs; here it is an error naming the kernel.
__global__ void stuck_barrier_kernel(float* out) {
  if (threadIdx.x % 32 < 16) {
    __syncthreads();
    out[threadIdx.x] = 0.0f;
  } else {
    out[threadIdx.x] = __shfl_sync(0xffffffffu, 1.0f, 0);
  }
}

TEST_F(Emulation, ABarrierThatCannotCompleteIsAnErrorNotAHang) {
  float* out = device_array<float>(64);
  INFINIGEN_LAUNCH(1, 64, 0, nullptr, stuck_barrier_kernel)(out);
  const cudaError_t error = cudaDeviceSynchronize();
  EXPECT_EQ(error, cudaErrorLaunchFailure);
  const std::string text = cudaGetErrorString(error);
  EXPECT_NE(text.find("stuck_barrier_kernel"), std::string::npos) << text;
  EXPECT_NE(text.find("__syncthreads cannot complete"), std::string::npos) << text;
  // The device stays failed until reset, as a GPU context does.
  EXPECT_EQ(cudaMemset(out, 0, 4), cudaErrorLaunchFailure);
}

// ---- memory kinds ----

__global__ void fill_kernel(float* out, float value, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    out[i] = value;
}

TEST_F(Emulation, AKernelGivenAHostPointerFails) {
  std::vector<float> host(256, 0.0f);
  INFINIGEN_LAUNCH(2, 128, 0, nullptr, fill_kernel)(host.data(), 1.0f, 256);
  const cudaError_t error = cudaDeviceSynchronize();
  EXPECT_EQ(error, cudaErrorIllegalAddress);
  const std::string text = cudaGetErrorString(error);
  EXPECT_NE(text.find("fill_kernel"), std::string::npos) << text;
  EXPECT_NE(text.find("argument 1"), std::string::npos) << text;
  EXPECT_EQ(host[0], 0.0f);  // the kernel never ran
}

TEST_F(Emulation, PinnedMemoryIsMappedForKernels) {
  float* pinned = nullptr;
  ASSERT_EQ(cudaHostAlloc(&pinned, 256 * sizeof(float), cudaHostAllocMapped), cudaSuccess);
  void* mapped = nullptr;
  ASSERT_EQ(cudaHostGetDevicePointer(&mapped, pinned, 0), cudaSuccess);
  INFINIGEN_LAUNCH(2, 128, 0, nullptr, fill_kernel)(static_cast<float*>(mapped), 3.0f, 256);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(pinned[255], 3.0f);
  EXPECT_EQ(cudaFreeHost(pinned), cudaSuccess);
}

TEST_F(Emulation, CopiesOfTheWrongKindOrPastTheEndAreErrors) {
  float* device = device_array<float>(16);
  std::vector<float> host(32, 1.0f);
  // Host to device with the pointers swapped.
  EXPECT_EQ(cudaMemcpy(host.data(), device, 64, cudaMemcpyHostToDevice), cudaErrorInvalidValue);
  EXPECT_NE(std::string(cudaGetErrorString(cudaErrorInvalidValue)).find("destination"),
            std::string::npos);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);  // not sticky
  EXPECT_EQ(cudaMemcpy(device, host.data(), 32 * sizeof(float), cudaMemcpyHostToDevice),
            cudaErrorInvalidValue);  // 128 bytes into 64
  EXPECT_EQ(cudaFree(host.data()), cudaErrorInvalidValue);
  EXPECT_EQ(cudaMemcpy(device, host.data(), 16 * sizeof(float), cudaMemcpyHostToDevice),
            cudaSuccess);
  cudaFree(device);
}

TEST_F(Emulation, FreshDeviceMemoryIsPoisonedWithNaN) {
  float* device = device_array<float>(8);
  for (const float value : to_host(device, 8)) EXPECT_TRUE(std::isnan(value));
  cudaFree(device);
}

// ---- shared memory ----

__global__ void shared_sum_kernel(const float* in, float* out, int n) {
  INFINIGEN_DYNAMIC_SHARED(float, tile);
  for (int i = threadIdx.x; i < n; i += blockDim.x) tile[i] = in[i];
  __syncthreads();
  if (threadIdx.x == 0) {
    float sum = 0.0f;
    for (int i = 0; i < n; ++i) sum += tile[i];
    out[0] = sum;
  }
}

TEST_F(Emulation, DynamicSharedMemoryOver48KiBNeedsTheOptIn) {
  constexpr int n = 16 * 1024;  // 64 KiB of floats
  std::vector<float> ones(n, 1.0f);
  float* in = device_array<float>(n);
  float* out = device_array<float>(1);
  ASSERT_EQ(cudaMemcpy(in, ones.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
  INFINIGEN_LAUNCH(1, 256, n * sizeof(float), nullptr, shared_sum_kernel)(in, out, n);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue);
  EXPECT_EQ(cudaFuncSetAttribute(shared_sum_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 200 * 1024),
            cudaErrorInvalidValue);                      // more than the device has
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue);  // read, and so cleared
  ASSERT_EQ(cudaFuncSetAttribute(shared_sum_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                 n * sizeof(float)),
            cudaSuccess);
  INFINIGEN_LAUNCH(1, 256, n * sizeof(float), nullptr, shared_sum_kernel)(in, out, n);
  ASSERT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(to_host(out, 1)[0], static_cast<float>(n));
  cudaFree(in);
  cudaFree(out);
}

TEST_F(Emulation, LaunchLimitsAreCUDAs) {
  float* out = device_array<float>(1);
  INFINIGEN_LAUNCH(1, 2048, 0, nullptr, fill_kernel)(out, 0.0f, 1);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  INFINIGEN_LAUNCH(dim3(1, 70000), 32, 0, nullptr, fill_kernel)(out, 0.0f, 1);
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
  cudaFree(out);
}

// ---- atomics ----

__global__ void count_kernel(int* counter, float* total) {
  atomicAdd(counter, 1);
  atomicAdd(total, 0.5f);
}

TEST_F(Emulation, AtomicsCountEveryThreadOfEveryBlock) {
  int* counter = device_array<int>(1);
  float* total = device_array<float>(1);
  ASSERT_EQ(cudaMemset(counter, 0, sizeof(int)), cudaSuccess);
  ASSERT_EQ(cudaMemset(total, 0, sizeof(float)), cudaSuccess);
  INFINIGEN_LAUNCH(dim3(3, 2), 96, 0, nullptr, count_kernel)(counter, total);
  EXPECT_EQ(to_host(counter, 1)[0], 576);
  EXPECT_EQ(to_host(total, 1)[0], 288.0f);
  cudaFree(counter);
  cudaFree(total);
}

// ---- streams and events ----

void sleep_ms(void* ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(*static_cast<int*>(ms)));
}

__global__ void copy_kernel(const float* in, float* out, int n) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
    out[i] = in[i];
}

// Stream a is held up before it fills `data`; stream b copies `data` after waiting for a's
// event. Without the wait, b would copy the poison (the streams really run concurrently).
TEST_F(Emulation, TwoStreamsOrderedByAnEvent) {
  constexpr int n = 4096;
  cudaStream_t a = nullptr, b = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking), cudaSuccess);
  cudaEvent_t filled = nullptr;
  ASSERT_EQ(cudaEventCreateWithFlags(&filled, cudaEventDisableTiming), cudaSuccess);
  float* data = device_array<float>(n);
  float* copy = device_array<float>(n);
  static int delay_ms = 200;
  ASSERT_EQ(cudaLaunchHostFunc(a, sleep_ms, &delay_ms), cudaSuccess);
  INFINIGEN_LAUNCH(4, 256, 0, a, fill_kernel)(data, 7.0f, n);
  ASSERT_EQ(cudaEventRecord(filled, a), cudaSuccess);
  EXPECT_EQ(cudaEventQuery(filled), cudaErrorNotReady);  // a is still asleep
  ASSERT_EQ(cudaStreamWaitEvent(b, filled, 0), cudaSuccess);
  INFINIGEN_LAUNCH(4, 256, 0, b, copy_kernel)(data, copy, n);
  std::vector<float> host(n, 0.0f);
  float* pinned = nullptr;
  ASSERT_EQ(cudaMallocHost(&pinned, n * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(pinned, copy, n * sizeof(float), cudaMemcpyDeviceToHost, b),
            cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(b), cudaSuccess);
  for (int i = 0; i < n; ++i) ASSERT_EQ(pinned[i], 7.0f) << i;
  cudaFreeHost(pinned);
  cudaFree(data);
  cudaFree(copy);
  cudaEventDestroy(filled);
  cudaStreamDestroy(a);
  cudaStreamDestroy(b);
}

// The legacy default stream waits for blocking streams (and they for it).
TEST_F(Emulation, TheLegacyDefaultStreamWaitsForBlockingStreams) {
  constexpr int n = 1024;
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreate(&s), cudaSuccess);
  float* data = device_array<float>(n);
  static int delay_ms = 100;
  ASSERT_EQ(cudaLaunchHostFunc(s, sleep_ms, &delay_ms), cudaSuccess);
  INFINIGEN_LAUNCH(4, 256, 0, s, fill_kernel)(data, 5.0f, n);
  EXPECT_EQ(to_host(data, n)[n - 1], 5.0f);  // cudaMemcpy on the null stream
  cudaFree(data);
  cudaStreamDestroy(s);
}

TEST_F(Emulation, EventsTimeTheirStreams) {
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  cudaEvent_t start = nullptr, end = nullptr, untimed = nullptr;
  ASSERT_EQ(cudaEventCreate(&start), cudaSuccess);
  ASSERT_EQ(cudaEventCreate(&end), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&untimed, cudaEventDisableTiming), cudaSuccess);
  static int delay_ms = 50;
  ASSERT_EQ(cudaEventRecord(start, s), cudaSuccess);
  ASSERT_EQ(cudaLaunchHostFunc(s, sleep_ms, &delay_ms), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(end, s), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(untimed, s), cudaSuccess);
  ASSERT_EQ(cudaEventSynchronize(end), cudaSuccess);
  float ms = 0.0f;
  ASSERT_EQ(cudaEventElapsedTime(&ms, start, end), cudaSuccess);
  EXPECT_GE(ms, 45.0f);
  EXPECT_EQ(cudaEventElapsedTime(&ms, start, untimed), cudaErrorInvalidResourceHandle);
  cudaEventDestroy(start);
  cudaEventDestroy(end);
  cudaEventDestroy(untimed);
  cudaStreamDestroy(s);
}

TEST_F(Emulation, StreamOrderedAllocationFreesAfterTheWorkBeforeIt) {
  constexpr int n = 512;
  cudaStream_t s = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  float* scratch = nullptr;
  ASSERT_EQ(cudaMallocAsync(&scratch, n * sizeof(float), s), cudaSuccess);
  float* out = device_array<float>(n);
  static int delay_ms = 50;
  ASSERT_EQ(cudaLaunchHostFunc(s, sleep_ms, &delay_ms), cudaSuccess);
  INFINIGEN_LAUNCH(2, 256, 0, s, fill_kernel)(scratch, 2.0f, n);
  INFINIGEN_LAUNCH(2, 256, 0, s, copy_kernel)(scratch, out, n);
  ASSERT_EQ(cudaFreeAsync(scratch, s), cudaSuccess);
  cudaPointerAttributes attributes{};
  ASSERT_EQ(cudaPointerGetAttributes(&attributes, scratch), cudaSuccess);
  EXPECT_EQ(attributes.type, cudaMemoryTypeDevice);  // still queued work that uses it
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  ASSERT_EQ(cudaPointerGetAttributes(&attributes, scratch), cudaSuccess);
  EXPECT_EQ(attributes.type, cudaMemoryTypeUnregistered);
  EXPECT_EQ(to_host(out, n)[n - 1], 2.0f);
  cudaFree(out);
  cudaStreamDestroy(s);
}

// ---- 16-bit floats ----

TEST_F(Emulation, HalfAndBfloat16RoundAsCUDAs) {
  const auto half_bits = [](float f) { return __half_as_ushort(__float2half_rn(f)); };
  EXPECT_EQ(half_bits(1.0f), 0x3c00);
  EXPECT_EQ(half_bits(1.0f + std::ldexp(1.0f, -11)), 0x3c00);      // tie: to even
  EXPECT_EQ(half_bits(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);  // tie: to even, upwards
  EXPECT_EQ(half_bits(65504.0f), 0x7bff);
  EXPECT_EQ(half_bits(65519.0f), 0x7bff);
  EXPECT_EQ(half_bits(65520.0f), 0x7c00);  // rounds to infinity
  EXPECT_EQ(half_bits(std::ldexp(1.0f, -24)), 0x0001);
  EXPECT_EQ(half_bits(std::ldexp(1.0f, -25)), 0x0000);      // tie between 0 and 2^-24: even
  EXPECT_EQ(half_bits(3 * std::ldexp(1.0f, -25)), 0x0002);  // tie: to even, upwards
  EXPECT_EQ(half_bits(-2.0f), 0xc000);
  EXPECT_EQ(half_bits(NAN), 0x7fff);
  EXPECT_EQ(__half2float(__ushort_as_half(0x0001)), std::ldexp(1.0f, -24));
  EXPECT_EQ(__half2float(__ushort_as_half(0x7bff)), 65504.0f);
  const auto bf16_bits = [](float f) { return __bfloat16_as_ushort(__float2bfloat16_rn(f)); };
  EXPECT_EQ(bf16_bits(1.0f), 0x3f80);
  EXPECT_EQ(bf16_bits(1.0f + std::ldexp(1.0f, -8)), 0x3f80);      // tie: to even
  EXPECT_EQ(bf16_bits(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);  // tie: to even, upwards
  EXPECT_EQ(bf16_bits(NAN), 0x7fff);
  EXPECT_EQ(__bfloat162float(__ushort_as_bfloat16(0xbf80)), -1.0f);
}

// ---- cuBLAS ----

// Column-major C (m, n) = op(A) op(B) with every transpose combination and leading dimensions
// larger than the rows, against a direct sum.
TEST_F(Emulation, GemmExMatchesTheDefinitionForEveryTranspose) {
  cublasHandle_t handle = nullptr;
  ASSERT_EQ(cublasCreate(&handle), CUBLAS_STATUS_SUCCESS);
  const int m = 5, n = 3, k = 4, pad = 2;
  for (const cublasOperation_t ta : {CUBLAS_OP_N, CUBLAS_OP_T}) {
    for (const cublasOperation_t tb : {CUBLAS_OP_N, CUBLAS_OP_T}) {
      const int a_rows = ta == CUBLAS_OP_N ? m : k, a_cols = ta == CUBLAS_OP_N ? k : m;
      const int b_rows = tb == CUBLAS_OP_N ? k : n, b_cols = tb == CUBLAS_OP_N ? n : k;
      const int lda = a_rows + pad, ldb = b_rows + pad, ldc = m + pad;
      std::vector<float> a(static_cast<size_t>(lda * a_cols)), b(static_cast<size_t>(ldb * b_cols));
      for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(i % 7) - 3.0f;
      for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<float>(i % 5) * 0.5f - 1.0f;
      float* da = device_array<float>(a.size());
      float* db = device_array<float>(b.size());
      float* dc = device_array<float>(static_cast<size_t>(ldc * n));  // NaN: beta = 0 ignores it
      cudaMemcpy(da, a.data(), a.size() * sizeof(float), cudaMemcpyHostToDevice);
      cudaMemcpy(db, b.data(), b.size() * sizeof(float), cudaMemcpyHostToDevice);
      const float alpha = 2.0f, beta = 0.0f;
      ASSERT_EQ(
          cublasGemmEx(handle, ta, tb, m, n, k, &alpha, da, CUDA_R_32F, lda, db, CUDA_R_32F, ldb,
                       &beta, dc, CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
          CUBLAS_STATUS_SUCCESS);
      const std::vector<float> c = to_host(dc, static_cast<size_t>(ldc * n));
      for (int i = 0; i < m; ++i) {
        for (int j = 0; j < n; ++j) {
          float expected = 0.0f;
          for (int p = 0; p < k; ++p) {
            const float av = ta == CUBLAS_OP_N ? a[p * lda + i] : a[i * lda + p];
            const float bv = tb == CUBLAS_OP_N ? b[j * ldb + p] : b[p * ldb + j];
            expected += av * bv;
          }
          EXPECT_FLOAT_EQ(c[j * ldc + i], alpha * expected) << ta << tb << " " << i << "," << j;
        }
      }
      cudaFree(da);
      cudaFree(db);
      cudaFree(dc);
    }
  }
  cublasDestroy(handle);
}

TEST_F(Emulation, GemmExChecksItsArgumentsAndItsMemory) {
  cublasHandle_t handle = nullptr;
  ASSERT_EQ(cublasCreate(&handle), CUBLAS_STATUS_SUCCESS);
  float* d = device_array<float>(64);
  const float one = 1.0f, zero = 0.0f;
  // lda smaller than A's rows: cuBLAS's own check.
  EXPECT_EQ(
      cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, 4, 4, 4, &one, d, CUDA_R_32F, 3, d, CUDA_R_32F,
                   4, &zero, d, CUDA_R_32F, 4, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      CUBLAS_STATUS_INVALID_VALUE);
  // A (8, 8) with lda 8 spans 64 floats from d + 32: past the allocation's end, a fault.
  EXPECT_EQ(
      cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, 8, 1, 8, &one, d + 32, CUDA_R_32F, 8, d,
                   CUDA_R_32F, 8, &zero, d, CUDA_R_32F, 8, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      CUBLAS_STATUS_EXECUTION_FAILED);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaErrorIllegalAddress);
  EXPECT_NE(std::string(cudaGetErrorString(cudaErrorIllegalAddress)).find("matrix A"),
            std::string::npos);
  cudaDeviceReset();
  std::vector<float> host(64);
  EXPECT_EQ(
      cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, 4, 4, 4, &one, host.data(), CUDA_R_32F, 4, d,
                   CUDA_R_32F, 4, &zero, d, CUDA_R_32F, 4, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
      CUBLAS_STATUS_EXECUTION_FAILED);
  cudaFree(d);
  cublasDestroy(handle);
}

}  // namespace
