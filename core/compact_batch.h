// core: compacting what a batch keeps per sequence when some of its sequences leave it
// (KvStore::drop_sequences): the entries of the sequences kept move down, in order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace infinigen {

// `data` holds `outer` blocks of `batch` sequences of `bytes` each, [outer][batch][bytes]: the
// bytes of sequence keep[i] (old indices, ascending) of each block move to [outer][K][bytes]
// (K = keep.size()). Every run lands at or before where it was, so moving them in order never
// overwrites one still to move.
inline void compact_batch_bytes(void* data, int64_t outer, int64_t batch,
                                const std::vector<int64_t>& keep, size_t bytes) {
  char* base = static_cast<char*>(data);
  const int64_t K = std::ssize(keep);
  for (int64_t o = 0; o < outer; ++o) {
    for (int64_t i = 0; i < K; ++i) {
      const size_t from = static_cast<size_t>(o * batch + keep[static_cast<size_t>(i)]) * bytes;
      const size_t to = static_cast<size_t>(o * K + i) * bytes;
      if (from != to) std::memmove(base + to, base + from, bytes);
    }
  }
}

// The same for a vector of `outer` blocks of sequences of `per_sequence` entries each, resized to
// the kept ones. An empty vector stays empty (state a policy does not keep).
template <typename T>
void compact_batch(std::vector<T>& v, const std::vector<int64_t>& keep, size_t per_sequence,
                   int64_t outer = 1) {
  static_assert(std::is_trivially_copyable_v<T>);
  if (v.empty()) return;
  const int64_t batch =
      static_cast<int64_t>(v.size() / (static_cast<size_t>(outer) * per_sequence));
  compact_batch_bytes(v.data(), outer, batch, keep, per_sequence * sizeof(T));
  v.resize(static_cast<size_t>(outer) * keep.size() * per_sequence);
}

}  // namespace infinigen
