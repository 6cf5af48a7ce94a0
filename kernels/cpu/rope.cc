// kernels/cpu: RoPE, one row per iteration; the angles of a row are shared by its heads.
#include "kernels/cpu/rope.h"

#include <cmath>
#include <vector>

#include "kernels/cpu/parallel.h"

namespace infinigen::kernels::cpu {

void rope(float* x, const int32_t* positions, const float* inv_freq, int64_t rows, int64_t heads,
          int64_t head_dim) {
  const int64_t half = head_dim / 2;
#pragma omp parallel if (rows * heads * head_dim >= kParallelWork)
  {
    std::vector<float> cos_row(static_cast<size_t>(half)), sin_row(static_cast<size_t>(half));
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const float position = static_cast<float>(positions[r]);
      for (int64_t i = 0; i < half; ++i) {
        const float angle = position * inv_freq[i];
        cos_row[static_cast<size_t>(i)] = std::cos(angle);
        sin_row[static_cast<size_t>(i)] = std::sin(angle);
      }
      for (int64_t h = 0; h < heads; ++h) {
        rotate_half(x + (r * heads + h) * head_dim, cos_row.data(), sin_row.data(), half);
      }
    }
  }
}

}  // namespace infinigen::kernels::cpu
