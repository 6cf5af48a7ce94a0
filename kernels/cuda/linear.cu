// kernels/cuda: fully connected layer, cublasGemmEx with fp32 accumulation and a small epilogue
// kernel for bias and ReLU.
#include <cublas_v2.h>

#include <climits>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/linear.h"
#include "kernels/cuda/status.h"

namespace infinigen::kernels::cuda {
namespace {

constexpr int kThreads = 256;

int cublas_code(cublasStatus_t status) {
  return status == CUBLAS_STATUS_SUCCESS ? 0 : kCublasStatusBase + static_cast<int>(status);
}

// One cuBLAS handle per host thread, created on first use: a handle must not be used by two
// threads at once, and the pipeline calls ops from more than one thread. The stream is set on
// every call, so one handle serves all of a thread's streams.
class ThreadHandle {
 public:
  ~ThreadHandle() {
    if (handle_ != nullptr) cublasDestroy(handle_);  // nothing to report at thread exit
  }
  int get(cublasHandle_t* out) {
    if (handle_ == nullptr) {
      const cublasStatus_t status = cublasCreate(&handle_);
      if (status != CUBLAS_STATUS_SUCCESS) {
        handle_ = nullptr;
        return cublas_code(status);
      }
    }
    *out = handle_;
    return 0;
  }

 private:
  cublasHandle_t handle_ = nullptr;
};

thread_local ThreadHandle thread_handle;

template <typename T>
__global__ void round_kernel(const float* x, T* out, int64_t count) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride)
    out[i] = detail::from_float<T>(x[i]);
}

// y (M, N) += bias (N) broadcast over rows (bias may be null), then ReLU when `relu`.
__global__ void epilogue_kernel(float* y, const float* bias, int64_t M, int64_t N, bool relu) {
  const int64_t count = M * N;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    float value = y[i];
    if (bias != nullptr) value += bias[i % N];
    y[i] = relu ? fmaxf(value, 0.0f) : value;
  }
}

cudaDataType_t cuda_type(Element element) {
  switch (element) {
    case Element::F16:
      return CUDA_R_16F;
    case Element::BF16:
      return CUDA_R_16BF;
    case Element::F32:
      break;
  }
  return CUDA_R_32F;
}

// Row-major buffers read column-major are transposed, so row-major y (M, N) = x (M, K) . w^T is
// the column-major product y^T (N, M) = w (N, K) . x^T (K, M): A is w's buffer, a (K, N)
// column-major matrix used transposed (lda K); B is x's buffer, (K, M) used as is (ldb K); C is
// y's buffer, (N, M) with ldc N.
int gemm(cublasHandle_t handle, const void* x, const void* w, cudaDataType_t type, float* y, int M,
         int N, int K) {
  const float alpha = 1.0f, beta = 0.0f;
  return cublas_code(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, N, M, K, &alpha, w, type, K, x,
                                  type, K, &beta, y, CUDA_R_32F, N, CUBLAS_COMPUTE_32F,
                                  CUBLAS_GEMM_DEFAULT));
}

}  // namespace

int linear(const float* x, const void* w, Element w_type, const float* bias, float* y, int64_t M,
           int64_t N, int64_t K, bool relu, void* scratch, size_t scratch_bytes, void* stream) {
  if (M <= 0 || N <= 0) return cudaSuccess;
  if (M > INT_MAX || N > INT_MAX || K > INT_MAX || K < 0) return cudaErrorInvalidValue;
  const cudaStream_t s = detail::as_stream(stream);
  cublasHandle_t handle = nullptr;
  if (const int code = thread_handle.get(&handle); code != 0) return code;
  if (const int code = cublas_code(cublasSetStream(handle, s)); code != 0) return code;

  int code = 0;
  if (K == 0) {
    // An empty sum; cuBLAS rejects leading dimensions of 0.
    code = cudaMemsetAsync(y, 0, static_cast<size_t>(M * N) * sizeof(float), s);
  } else if (w_type == Element::F32) {
    code = gemm(handle, x, w, CUDA_R_32F, y, static_cast<int>(M), static_cast<int>(N),
                static_cast<int>(K));
  } else {
    // x (M, K) rounded to w's 16-bit type in the caller's scratch (__half and __nv_bfloat16 are
    // both 2 bytes).
    const int64_t count = M * K;  // > 0 here
    if (scratch == nullptr || scratch_bytes / sizeof(__half) < static_cast<size_t>(count)) {
      return cudaErrorInvalidValue;
    }
    if (w_type == Element::F16) {
      INFINIGEN_LAUNCH(detail::grid_stride_blocks(count, kThreads), kThreads, 0, s,
                       round_kernel<__half>)
      (x, static_cast<__half*>(scratch), count);
    } else {
      INFINIGEN_LAUNCH(detail::grid_stride_blocks(count, kThreads), kThreads, 0, s,
                       round_kernel<__nv_bfloat16>)
      (x, static_cast<__nv_bfloat16*>(scratch), count);
    }
    code = cudaGetLastError();
    if (code == 0) {
      code = gemm(handle, scratch, w, cuda_type(w_type), y, static_cast<int>(M),
                  static_cast<int>(N), static_cast<int>(K));
    }
  }
  if (code != 0) return code;
  if (bias == nullptr && !relu) return cudaSuccess;
  INFINIGEN_LAUNCH(detail::grid_stride_blocks(M * N, kThreads), kThreads, 0, s, epilogue_kernel)
  (y, bias, M, N, relu);
  return cudaGetLastError();
}

}  // namespace infinigen::kernels::cuda
