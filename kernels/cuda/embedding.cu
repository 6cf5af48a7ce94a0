// kernels/cuda: embedding lookup, one thread block per token.
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/embedding.h"

namespace infinigen::kernels::cuda {
namespace {

constexpr int kThreads = 256;

// Block i writes row i of out (n, D); threads stride over the D columns, so reads of both table
// rows and the write are coalesced.
template <typename T>
__global__ void embed_kernel(const int32_t* tokens, const int32_t* positions, const T* tokens_table,
                             const T* positions_table, int64_t D, float* out) {
  const int64_t i = blockIdx.x;
  const T* token_row = tokens_table + static_cast<int64_t>(tokens[i]) * D;
  const T* position_row =
      positions_table ? positions_table + static_cast<int64_t>(positions[i]) * D : nullptr;
  float* row = out + i * D;
  for (int64_t c = threadIdx.x; c < D; c += blockDim.x) {
    row[c] =
        detail::to_float(token_row[c]) + (position_row ? detail::to_float(position_row[c]) : 0.0f);
  }
}

}  // namespace

int embed(const int32_t* tokens, const int32_t* positions, int64_t n, const void* tokens_table,
          const void* positions_table, Element table_type, int64_t D, float* out, void* stream) {
  if (n <= 0 || D <= 0) return cudaSuccess;
  if (n > 0x7fffffff) return cudaErrorInvalidValue;  // grid.x limit
  return detail::dispatch_element(table_type, [&](auto tag) {
    using T = decltype(tag);
    INFINIGEN_LAUNCH(static_cast<unsigned>(n), kThreads, 0, detail::as_stream(stream),
                     embed_kernel<T>)
    (tokens, positions, static_cast<const T*>(tokens_table), static_cast<const T*>(positions_table),
     D, out);
    return static_cast<int>(cudaGetLastError());
  });
}

}  // namespace infinigen::kernels::cuda
