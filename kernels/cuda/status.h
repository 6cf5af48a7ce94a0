// kernels/cuda: the error codes every CUDA kernel returns, and their text.
//
// 0 is success. Other codes below kCublasStatusBase are cudaError_t values; a cuBLAS failure is
// returned as kCublasStatusBase + its cublasStatus_t, so that one int carries both libraries'
// errors through the flashinfer-style interface without a CUDA header in sight.
#pragma once

namespace infinigen::kernels::cuda {

inline constexpr int kCublasStatusBase = 1 << 20;

// Text for any code a kernel in kernels/cuda returned ("no error" for 0).
const char* status_string(int code);

}  // namespace infinigen::kernels::cuda
