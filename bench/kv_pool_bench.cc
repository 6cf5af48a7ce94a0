// bench: gathering KV from the pool, by block size, against one memcpy of the same bytes.
//
// Shapes of one OPT-13B layer's keys for batch 8 and 2048 tokens (H 40, d 128, fp16: 160 MiB):
//  - range: every token of every (sequence, head), the `full` policy's per-layer load;
//  - selected: 10% of the tokens of each (sequence, head), scattered, row by row (d elements), as
//    a host-side gather of InfiniGen's selection does, on one thread or on every OpenMP thread.
#include <benchmark/benchmark.h>

#include <cstring>
#include <random>
#include <vector>

#include "offload/kv_pool.h"

namespace infinigen {
namespace {

constexpr int64_t kBatch = 8, kHeads = 40, kHeadDim = 128, kTokens = 2048;

KvPoolShape shape(int64_t block_tokens) {
  return {1, kBatch, kHeads, kHeadDim, kTokens, block_tokens, DType::F16};
}

struct Filled {
  explicit Filled(int64_t block_tokens) : pool(shape(block_tokens)) {
    pool.reserve(kTokens);
    for (int64_t b = 0; b < kBatch; ++b) {
      for (int64_t h = 0; h < kHeads; ++h) {
        for (int64_t t = 0; t < kTokens; ++t) {
          std::memset(pool.row(0, KvKind::Key, b, h, t), static_cast<int>(t & 0x7f), kHeadDim * 2);
        }
      }
    }
  }
  KvPool pool;
};

void BM_GatherRange(benchmark::State& state) {
  Filled filled(state.range(0));
  std::vector<uint16_t> staging(static_cast<size_t>(kBatch * kHeads * kTokens * kHeadDim));
  std::vector<CopyChunk> chunks;
  for (auto _ : state) {
    chunks.clear();
    filled.pool.gather_chunks(0, KvKind::Key, 0, kTokens, staging.data(), kTokens, 0, &chunks);
    for (const CopyChunk& c : chunks) std::memcpy(c.dst, c.src, c.bytes);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(staging.size() * 2));
  state.counters["chunks"] = static_cast<double>(chunks.size());
}

void BM_GatherSelected(benchmark::State& state) {
  Filled filled(state.range(0));
  const bool parallel = state.range(1) != 0;
  const int64_t keep = kTokens / 10;
  std::vector<int32_t> picks(static_cast<size_t>(kBatch * kHeads * keep));
  std::mt19937 rng(1);
  for (int32_t& p : picks) p = static_cast<int32_t>(rng() % kTokens);
  std::vector<uint16_t> staging(static_cast<size_t>(kBatch * kHeads * keep * kHeadDim));
  for (auto _ : state) {
#pragma omp parallel for collapse(2) schedule(static) if (parallel)
    for (int64_t b = 0; b < kBatch; ++b) {
      for (int64_t h = 0; h < kHeads; ++h) {
        for (int64_t k = 0; k < keep; ++k) {
          const size_t i = static_cast<size_t>((b * kHeads + h) * keep + k);
          std::memcpy(staging.data() + i * kHeadDim,
                      filled.pool.row(0, KvKind::Key, b, h, picks[i]), kHeadDim * 2);
        }
      }
    }
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(staging.size() * 2));
}

// The ceiling: one contiguous copy of the range gather's bytes.
void BM_Memcpy(benchmark::State& state) {
  const size_t bytes = static_cast<size_t>(kBatch * kHeads * kTokens * kHeadDim * 2);
  std::vector<char> src(bytes, 1), dst(bytes);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), bytes);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(bytes));
}

BENCHMARK(BM_GatherRange)->Arg(16)->Arg(64)->Arg(128)->Arg(256)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_GatherSelected)
    ->ArgsProduct({{16, 64, 128, 256}, {0, 1}})
    ->ArgNames({"bt", "omp"})
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Memcpy)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace infinigen

BENCHMARK_MAIN();
