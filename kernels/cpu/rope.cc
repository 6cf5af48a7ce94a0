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
        float* head = x + (r * heads + h) * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = head[i], x2 = head[i + half];
          const float c = cos_row[static_cast<size_t>(i)], s = sin_row[static_cast<size_t>(i)];
          head[i] = x1 * c - x2 * s;
          head[i + half] = x2 * c + x1 * s;
        }
      }
    }
  }
}

}  // namespace infinigen::kernels::cpu
