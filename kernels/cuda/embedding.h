// kernels/cuda: token plus learned position embeddings.
#pragma once

#include <cstdint>

#include "kernels/cuda/element_type.h"

namespace infinigen::kernels::cuda {

// out (n, D) fp32 = tokens_table[tokens[i]] + positions_table[positions[i]], tables (rows, D) of
// `table_type`; without a positions table (null), out = tokens_table[tokens[i]] and positions
// is unused. tokens (n) and positions (n) are int32 device arrays of table rows (the caller
// computes position rows, as for the CPU kernel). Indices are trusted: callers check them
// against the table sizes.
int embed(const int32_t* tokens, const int32_t* positions, int64_t n, const void* tokens_table,
          const void* positions_table, Element table_type, int64_t D, float* out, void* stream);

}  // namespace infinigen::kernels::cuda
