// kernels/cpu: embedding lookup, parallel over tokens.
#include "kernels/cpu/embedding.h"

#include <vector>

#include "kernels/cpu/parallel.h"

namespace infinigen::kernels::cpu {

void embed(const int32_t* tokens, const int32_t* positions, int64_t n, const void* tokens_table,
           const void* positions_table, Element table_type, int64_t D, float* out) {
#pragma omp parallel if (n * D >= kParallelWork)
  {
    std::vector<float> position_row(static_cast<size_t>(D));
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      float* row = out + i * D;
      widen(tokens_table, table_type, static_cast<size_t>(tokens[i] * D), row, D);
      if (positions_table == nullptr) continue;
      widen(positions_table, table_type, static_cast<size_t>(positions[i] * D), position_row.data(),
            D);
      for (int64_t c = 0; c < D; ++c) row[c] += position_row[c];
    }
  }
}

}  // namespace infinigen::kernels::cpu
