// core: a piece of a gather list: `bytes` from `src` to `dst`. The transfer engine's loads and
// stores are lists of them (offload/transfer_engine.h), and the CUDA gather kernel reads such a
// list as it is (core/cuda_stream.h's copy_pieces; kernels/cuda/gather.h's CopyItem has the same
// layout).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace infinigen {

struct CopyChunk {
  void* dst;
  const void* src;
  size_t bytes;
};

// Bytes a gather list moves.
inline uint64_t total_bytes(const std::vector<CopyChunk>& chunks) {
  uint64_t total = 0;
  for (const CopyChunk& chunk : chunks) total += chunk.bytes;
  return total;
}

}  // namespace infinigen
