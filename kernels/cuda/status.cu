// kernels/cuda: text for the error codes of the CUDA kernels (CUDA runtime or cuBLAS).
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "kernels/cuda/status.h"

namespace infinigen::kernels::cuda {

const char* status_string(int code) {
  if (code >= kCublasStatusBase) {
    return cublasGetStatusString(static_cast<cublasStatus_t>(code - kCublasStatusBase));
  }
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

}  // namespace infinigen::kernels::cuda
