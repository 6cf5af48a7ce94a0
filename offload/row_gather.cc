// offload: the multi-threaded host gather of KV rows.
#include "offload/row_gather.h"

#include <omp.h>

#include <cstring>

namespace infinigen {

void gather_rows(const std::vector<CopyChunk>& chunks, int threads) {
#pragma omp parallel num_threads(threads > 0 ? threads : omp_get_max_threads())
  {
    const auto share = static_cast<size_t>(omp_get_num_threads());
    const auto index = static_cast<size_t>(omp_get_thread_num());
    const size_t end = chunks.size() * (index + 1) / share;
    for (size_t i = chunks.size() * index / share; i < end; ++i) {
      if (chunks[i].bytes != 0) std::memcpy(chunks[i].dst, chunks[i].src, chunks[i].bytes);
    }
  }
}

}  // namespace infinigen
