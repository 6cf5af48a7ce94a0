// kernels/cpu: elementwise ops, parallel over elements.
#include "kernels/cpu/elementwise.h"

#include <cmath>

#include "kernels/cpu/parallel.h"

namespace infinigen::kernels::cpu {

void add_inplace(float* y, const float* x, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n >= kParallelWork)
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

void scale_inplace(float* y, float factor, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n >= kParallelWork)
  for (int64_t i = 0; i < n; ++i) y[i] *= factor;
}

void silu_mul(float* gate, const float* up, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n >= kParallelWork)
  for (int64_t i = 0; i < n; ++i) gate[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

}  // namespace infinigen::kernels::cpu
