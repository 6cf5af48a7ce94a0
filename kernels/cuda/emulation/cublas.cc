// kernels/cuda/emulation: the cuBLAS calls infinigen makes, on the CPU. Arguments are checked
// as cuBLAS checks them (INVALID_VALUE for a bad operation, size or leading dimension;
// NOT_SUPPORTED for a type combination it lacks), then, beyond cuBLAS, every matrix must lie in
// device memory and inside its allocation (on a GPU a wrong leading dimension reads a neighbour's
// data; here it is an error naming the matrix). The product itself runs on the handle's stream,
// in fp32 with Eigen, which is what CUBLAS_COMPUTE_32F promises.
#include <Eigen/Core>
#include <cstring>
#include <mutex>
#include <set>
#include <string>

#include "cublas_v2.h"
#include "cuda_emulation/half.h"
#include "kernels/cuda/emulation/device_state.h"

struct cublasContext {
  cudaStream_t stream = nullptr;
};

namespace infinigen::cuda_emulation {
namespace {

using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::ColMajor>;

struct Handles {
  std::mutex mutex;
  std::set<cublasHandle_t> live;
};
Handles& handles() {
  static auto* state = new Handles;
  return *state;
}

bool live(cublasHandle_t handle) {
  Handles& h = handles();
  std::lock_guard<std::mutex> lock(h.mutex);
  return h.live.count(handle) > 0;
}

size_t element_bytes(cudaDataType_t type) {
  switch (type) {
    case CUDA_R_32F:
      return 4;
    case CUDA_R_16F:
    case CUDA_R_16BF:
      return 2;
    default:
      return 0;
  }
}

// A (rows, cols) column-major matrix with leading dimension ld, widened to fp32.
Matrix load(const void* data, cudaDataType_t type, int rows, int cols, int ld) {
  Matrix m(rows, cols);
  for (int c = 0; c < cols; ++c) {
    for (int r = 0; r < rows; ++r) {
      const size_t i = static_cast<size_t>(c) * static_cast<size_t>(ld) + static_cast<size_t>(r);
      switch (type) {
        case CUDA_R_16F:
          m(r, c) = static_cast<float>(static_cast<const __half*>(data)[i]);
          break;
        case CUDA_R_16BF:
          m(r, c) = static_cast<float>(static_cast<const __nv_bfloat16*>(data)[i]);
          break;
        default:
          m(r, c) = static_cast<const float*>(data)[i];
          break;
      }
    }
  }
  return m;
}

void store(const Matrix& m, void* data, cudaDataType_t type, int ld) {
  for (int c = 0; c < m.cols(); ++c) {
    for (int r = 0; r < m.rows(); ++r) {
      const size_t i = static_cast<size_t>(c) * static_cast<size_t>(ld) + static_cast<size_t>(r);
      switch (type) {
        case CUDA_R_16F:
          static_cast<__half*>(data)[i] = __half(m(r, c));
          break;
        case CUDA_R_16BF:
          static_cast<__nv_bfloat16*>(data)[i] = __nv_bfloat16(m(r, c));
          break;
        default:
          static_cast<float*>(data)[i] = m(r, c);
          break;
      }
    }
  }
}

// The bytes a (rows, cols) matrix with leading dimension ld spans.
size_t span_bytes(int rows, int cols, int ld, cudaDataType_t type) {
  if (rows == 0 || cols == 0) return 0;
  return (static_cast<size_t>(cols - 1) * static_cast<size_t>(ld) + static_cast<size_t>(rows)) *
         element_bytes(type);
}

struct Gemm {
  cublasOperation_t transa, transb;
  int m, n, k;
  float alpha, beta;
  const void* A;
  cudaDataType_t Atype;
  int lda;
  const void* B;
  cudaDataType_t Btype;
  int ldb;
  void* C;
  cudaDataType_t Ctype;
  int ldc;
};

cublasStatus_t invalid(const std::string& message) {
  fail(cudaErrorInvalidValue, "cublasGemmEx: " + message);
  return CUBLAS_STATUS_INVALID_VALUE;
}

// cuBLAS's own checks, then the emulation's memory checks for each of `batch` matrices.
cublasStatus_t check(const Gemm& g, int batch, long long stride_a, long long stride_b,
                     long long stride_c) {
  const auto op_ok = [](cublasOperation_t op) { return op == CUBLAS_OP_N || op == CUBLAS_OP_T; };
  if (!op_ok(g.transa) || !op_ok(g.transb)) return invalid("operation must be N or T");
  if (g.m < 0 || g.n < 0 || g.k < 0 || batch < 0) return invalid("negative size");
  const int a_rows = g.transa == CUBLAS_OP_N ? g.m : g.k;
  const int b_rows = g.transb == CUBLAS_OP_N ? g.k : g.n;
  if (g.lda < std::max(1, a_rows)) {
    return invalid("lda " + std::to_string(g.lda) + " < rows of A (" + std::to_string(a_rows) +
                   ")");
  }
  if (g.ldb < std::max(1, b_rows)) {
    return invalid("ldb " + std::to_string(g.ldb) + " < rows of B (" + std::to_string(b_rows) +
                   ")");
  }
  if (g.ldc < std::max(1, g.m)) {
    return invalid("ldc " + std::to_string(g.ldc) + " < rows of C (" + std::to_string(g.m) + ")");
  }
  const bool supported = g.Atype == g.Btype && element_bytes(g.Atype) > 0 &&
                         (g.Ctype == CUDA_R_32F || g.Ctype == g.Atype);
  if (!supported) {
    fail(cudaErrorInvalidValue, "cublasGemmEx: unsupported type combination");
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (g.m == 0 || g.n == 0) return CUBLAS_STATUS_SUCCESS;
  const int a_cols = g.transa == CUBLAS_OP_N ? g.k : g.m;
  const int b_cols = g.transb == CUBLAS_OP_N ? g.n : g.k;
  for (int i = 0; i < batch; ++i) {
    const struct {
      const char* name;
      const void* data;
      size_t bytes;
    } matrices[] = {{"A", static_cast<const char*>(g.A) + i * stride_a * element_bytes(g.Atype),
                     g.k == 0 ? 0 : span_bytes(a_rows, a_cols, g.lda, g.Atype)},
                    {"B", static_cast<const char*>(g.B) + i * stride_b * element_bytes(g.Btype),
                     g.k == 0 ? 0 : span_bytes(b_rows, b_cols, g.ldb, g.Btype)},
                    {"C", static_cast<const char*>(g.C) + i * stride_c * element_bytes(g.Ctype),
                     span_bytes(g.m, g.n, g.ldc, g.Ctype)}};
    for (const auto& matrix : matrices) {
      if (matrix.bytes == 0) continue;
      const std::string what = std::string("cublasGemmEx matrix ") + matrix.name;
      if (auto problem = check_range(matrix.data, matrix.bytes, MemoryKind::Device, what.c_str())) {
        // On a GPU this faults in the kernel: sticky, as there.
        set_sticky_error(cudaErrorIllegalAddress, *problem);
        return CUBLAS_STATUS_EXECUTION_FAILED;
      }
    }
  }
  return CUBLAS_STATUS_SUCCESS;
}

void compute(const Gemm& g) {
  const int a_rows = g.transa == CUBLAS_OP_N ? g.m : g.k;
  const int a_cols = g.transa == CUBLAS_OP_N ? g.k : g.m;
  const int b_rows = g.transb == CUBLAS_OP_N ? g.k : g.n;
  const int b_cols = g.transb == CUBLAS_OP_N ? g.n : g.k;
  Matrix product = Matrix::Zero(g.m, g.n);
  if (g.k > 0) {
    const Matrix a = load(g.A, g.Atype, a_rows, a_cols, g.lda);
    const Matrix b = load(g.B, g.Btype, b_rows, b_cols, g.ldb);
    if (g.transa == CUBLAS_OP_N && g.transb == CUBLAS_OP_N) product.noalias() = a * b;
    if (g.transa == CUBLAS_OP_T && g.transb == CUBLAS_OP_N) product.noalias() = a.transpose() * b;
    if (g.transa == CUBLAS_OP_N && g.transb == CUBLAS_OP_T) product.noalias() = a * b.transpose();
    if (g.transa == CUBLAS_OP_T && g.transb == CUBLAS_OP_T) {
      product.noalias() = a.transpose() * b.transpose();
    }
  }
  Matrix c = g.alpha * product;
  if (g.beta != 0.0f) c += g.beta * load(g.C, g.Ctype, g.m, g.n, g.ldc);  // C unread when beta = 0
  store(c, g.C, g.Ctype, g.ldc);
}

cublasStatus_t gemm(cublasHandle_t handle, const Gemm& g, int batch, long long stride_a,
                    long long stride_b, long long stride_c, cublasComputeType_t compute_type) {
  if (!live(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (compute_type != CUBLAS_COMPUTE_32F && compute_type != CUBLAS_COMPUTE_32F_PEDANTIC &&
      compute_type != CUBLAS_COMPUTE_32F_FAST_16F && compute_type != CUBLAS_COMPUTE_32F_FAST_16BF &&
      compute_type != CUBLAS_COMPUTE_32F_FAST_TF32) {
    fail(cudaErrorInvalidValue, "cublasGemmEx: only fp32 compute types are emulated");
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  if (sticky_error() != cudaSuccess) return CUBLAS_STATUS_EXECUTION_FAILED;
  if (const cublasStatus_t status = check(g, batch, stride_a, stride_b, stride_c);
      status != CUBLAS_STATUS_SUCCESS) {
    return status;
  }
  if (g.m == 0 || g.n == 0 || batch == 0) return CUBLAS_STATUS_SUCCESS;
  const std::shared_ptr<Stream> stream = find_stream(handle->stream);
  if (!stream) return CUBLAS_STATUS_EXECUTION_FAILED;
  enqueue(stream, Task{[g, batch, stride_a, stride_b, stride_c] {
                         for (int i = 0; i < batch; ++i) {
                           Gemm one = g;
                           one.A = static_cast<const char*>(g.A) +
                                   i * stride_a * static_cast<long long>(element_bytes(g.Atype));
                           one.B = static_cast<const char*>(g.B) +
                                   i * stride_b * static_cast<long long>(element_bytes(g.Btype));
                           one.C = static_cast<char*>(g.C) +
                                   i * stride_c * static_cast<long long>(element_bytes(g.Ctype));
                           compute(one);
                         }
                       },
                       {},
                       false});
  return CUBLAS_STATUS_SUCCESS;
}

}  // namespace
}  // namespace infinigen::cuda_emulation

namespace emu = infinigen::cuda_emulation;

cublasStatus_t cublasCreate(cublasHandle_t* handle) {
  if (handle == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *handle = new cublasContext;
  emu::Handles& h = emu::handles();
  std::lock_guard<std::mutex> lock(h.mutex);
  h.live.insert(*handle);
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy(cublasHandle_t handle) {
  {
    emu::Handles& h = emu::handles();
    std::lock_guard<std::mutex> lock(h.mutex);
    if (h.live.erase(handle) == 0) return CUBLAS_STATUS_NOT_INITIALIZED;
  }
  delete handle;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream(cublasHandle_t handle, cudaStream_t stream) {
  if (!emu::live(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (!emu::find_stream(stream)) {
    emu::fail(cudaErrorInvalidResourceHandle, "cublasSetStream: unknown stream");
    return CUBLAS_STATUS_INVALID_VALUE;
  }
  handle->stream = stream;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetStream(cublasHandle_t handle, cudaStream_t* stream) {
  if (!emu::live(handle)) return CUBLAS_STATUS_NOT_INITIALIZED;
  if (stream == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  *stream = handle->stream;
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t) {
  return emu::live(handle) ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_INITIALIZED;
}

namespace {

struct StatusText {
  cublasStatus_t status;
  const char* name;
  const char* text;
};
// cuBLAS's names and texts for its statuses.
constexpr StatusText kStatusTexts[] = {
    {CUBLAS_STATUS_SUCCESS, "CUBLAS_STATUS_SUCCESS", "success"},
    {CUBLAS_STATUS_NOT_INITIALIZED, "CUBLAS_STATUS_NOT_INITIALIZED",
     "the library was not initialized"},
    {CUBLAS_STATUS_ALLOC_FAILED, "CUBLAS_STATUS_ALLOC_FAILED", "the resource allocation failed"},
    {CUBLAS_STATUS_INVALID_VALUE, "CUBLAS_STATUS_INVALID_VALUE",
     "an invalid numeric value was used as an argument"},
    {CUBLAS_STATUS_ARCH_MISMATCH, "CUBLAS_STATUS_ARCH_MISMATCH",
     "an absent device architectural feature is required"},
    {CUBLAS_STATUS_MAPPING_ERROR, "CUBLAS_STATUS_MAPPING_ERROR",
     "an access to GPU memory space failed"},
    {CUBLAS_STATUS_EXECUTION_FAILED, "CUBLAS_STATUS_EXECUTION_FAILED",
     "the GPU program failed to execute"},
    {CUBLAS_STATUS_INTERNAL_ERROR, "CUBLAS_STATUS_INTERNAL_ERROR", "an internal operation failed"},
    {CUBLAS_STATUS_NOT_SUPPORTED, "CUBLAS_STATUS_NOT_SUPPORTED",
     "the functionality requested is not supported"},
};

const StatusText* status_text(cublasStatus_t status) {
  for (const StatusText& entry : kStatusTexts)
    if (entry.status == status) return &entry;
  return nullptr;
}

}  // namespace

const char* cublasGetStatusName(cublasStatus_t status) {
  const StatusText* entry = status_text(status);
  return entry != nullptr ? entry->name : "CUBLAS_STATUS_UNKNOWN";
}

const char* cublasGetStatusString(cublasStatus_t status) {
  const StatusText* entry = status_text(status);
  return entry != nullptr ? entry->text : "unknown error";
}

cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa,
                            cublasOperation_t transb, int m, int n, int k, const void* alpha,
                            const void* A, cudaDataType_t Atype, int lda, const void* B,
                            cudaDataType_t Btype, int ldb, const void* beta, void* C,
                            cudaDataType_t Ctype, int ldc, cublasComputeType_t computeType,
                            cublasGemmAlgo_t algo) {
  // One product is a batch of one.
  return cublasGemmStridedBatchedEx(handle, transa, transb, m, n, k, alpha, A, Atype, lda, 0, B,
                                    Btype, ldb, 0, beta, C, Ctype, ldc, 0, 1, computeType, algo);
}

cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t handle, cublasOperation_t transa,
                                          cublasOperation_t transb, int m, int n, int k,
                                          const void* alpha, const void* A, cudaDataType_t Atype,
                                          int lda, long long int strideA, const void* B,
                                          cudaDataType_t Btype, int ldb, long long int strideB,
                                          const void* beta, void* C, cudaDataType_t Ctype, int ldc,
                                          long long int strideC, int batchCount,
                                          cublasComputeType_t computeType, cublasGemmAlgo_t) {
  if (alpha == nullptr || beta == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
  const emu::Gemm g{transa,
                    transb,
                    m,
                    n,
                    k,
                    *static_cast<const float*>(alpha),
                    *static_cast<const float*>(beta),
                    A,
                    Atype,
                    lda,
                    B,
                    Btype,
                    ldb,
                    C,
                    Ctype,
                    ldc};
  return emu::gemm(handle, g, batchCount, strideA, strideB, strideC, computeType);
}

cublasStatus_t cublasSgemm(cublasHandle_t handle, cublasOperation_t transa,
                           cublasOperation_t transb, int m, int n, int k, const float* alpha,
                           const float* A, int lda, const float* B, int ldb, const float* beta,
                           float* C, int ldc) {
  return cublasGemmEx(handle, transa, transb, m, n, k, alpha, A, CUDA_R_32F, lda, B, CUDA_R_32F,
                      ldb, beta, C, CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}
