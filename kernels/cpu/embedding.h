// kernels/cpu: token plus learned position embeddings.
#pragma once

#include <cstdint>

#include "kernels/cpu/element_type.h"

namespace infinigen::kernels::cpu {

// out (n, D) = tokens_table[tokens[i]] + positions_table[positions[i]], tables (rows, D) of
// `table_type`; without a positions table (null), out = tokens_table[tokens[i]] and positions
// is unused. Indices are trusted: callers check them against the table sizes.
void embed(const int32_t* tokens, const int32_t* positions, int64_t n, const void* tokens_table,
           const void* positions_table, Element table_type, int64_t D, float* out);

}  // namespace infinigen::kernels::cpu
