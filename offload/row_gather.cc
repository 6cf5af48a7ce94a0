// offload: the multi-threaded host gather of KV rows.
#include "offload/row_gather.h"

#include <omp.h>

#include <cstdint>
#include <cstring>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace infinigen {
namespace {

constexpr size_t kCacheLine = 64;

// Asks for every cache line of `chunk`'s source.
void prefetch(const CopyChunk& chunk) {
  const char* src = static_cast<const char*>(chunk.src);
  for (size_t at = 0; at < chunk.bytes; at += kCacheLine) __builtin_prefetch(src + at, 0, 0);
}

// One chunk with non-temporal stores where the destination allows them (32-byte aligned, whole
// 32-byte words); memcpy otherwise.
void copy_streaming(const CopyChunk& chunk) {
#ifdef __AVX2__
  const auto dst_address = reinterpret_cast<uintptr_t>(chunk.dst);
  if (dst_address % 32 == 0 && chunk.bytes % 32 == 0) {
    auto* dst = static_cast<__m256i*>(chunk.dst);
    const auto* src = static_cast<const __m256i*>(chunk.src);
    for (size_t i = 0; i < chunk.bytes / 32; ++i) {
      _mm256_stream_si256(dst + i, _mm256_loadu_si256(src + i));
    }
    return;
  }
#endif
  std::memcpy(chunk.dst, chunk.src, chunk.bytes);
}

}  // namespace

void gather_rows(const std::vector<CopyChunk>& chunks, const GatherOptions& options) {
  const int threads = options.threads > 0 ? options.threads : omp_get_max_threads();
  const size_t ahead = static_cast<size_t>(options.prefetch_rows);
#pragma omp parallel num_threads(threads)
  {
    const auto share = static_cast<size_t>(omp_get_num_threads());
    const auto index = static_cast<size_t>(omp_get_thread_num());
    const size_t begin = chunks.size() * index / share;
    const size_t end = chunks.size() * (index + 1) / share;
    for (size_t i = begin; i < end; ++i) {
      if (ahead > 0 && i + ahead < end) prefetch(chunks[i + ahead]);
      if (chunks[i].bytes == 0) continue;
      if (options.streaming) {
        copy_streaming(chunks[i]);
      } else {
        std::memcpy(chunks[i].dst, chunks[i].src, chunks[i].bytes);
      }
    }
#ifdef __AVX2__
    if (options.streaming) _mm_sfence();  // streamed stores are visible before the list is done
#endif
  }
}

}  // namespace infinigen
