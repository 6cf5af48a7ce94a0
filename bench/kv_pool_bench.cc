// bench: gathering KV from the pool, by block size, against one memcpy of the same bytes.
//
// Shapes of one OPT-13B layer's keys for batch 8 and 2048 tokens (H 40, d 128, fp16: 160 MiB):
//  - range: every token of every (sequence, head), the `full` policy's per-layer load;
//  - selected: 10% of the tokens of each (sequence, head), scattered, row by row (d elements),
//    through gather_rows (offload/row_gather.h), the host gather of InfiniGen's selection, on one
//    thread and on every core, with the picks of each head in speculation's order or sorted;
//  - memcpy of the same bytes as each, the ceiling.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "offload/kv_pool.h"
#include "offload/row_gather.h"

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

// The selection's rows: 10% of the tokens of each (sequence, head), in the order speculation gives
// them (`sorted`: ascending positions within each head, as a sort of each head's picks would).
std::vector<CopyChunk> selected_rows(const KvPool& pool, std::vector<uint16_t>& staging,
                                     bool sorted) {
  const int64_t keep = kTokens / 10;
  std::mt19937 rng(1);
  std::vector<CopyChunk> chunks;
  chunks.reserve(static_cast<size_t>(kBatch * kHeads * keep));
  std::vector<int32_t> picks(static_cast<size_t>(keep));
  for (int64_t b = 0; b < kBatch; ++b) {
    for (int64_t h = 0; h < kHeads; ++h) {
      for (int32_t& p : picks) p = static_cast<int32_t>(rng() % kTokens);
      if (sorted) std::sort(picks.begin(), picks.end());
      for (int32_t p : picks) {
        chunks.push_back({staging.data() + chunks.size() * kHeadDim,
                          pool.row(0, KvKind::Key, b, h, p), kHeadDim * 2});
      }
    }
  }
  return chunks;
}

size_t selected_bytes() {
  return static_cast<size_t>(kBatch * kHeads * (kTokens / 10) * kHeadDim * 2);
}

// gather_rows over the selection. Arguments: block tokens, threads (0 = every core), picks sorted
// per head.
void BM_GatherSelected(benchmark::State& state) {
  Filled filled(state.range(0));
  std::vector<uint16_t> staging(selected_bytes() / 2);
  const std::vector<CopyChunk> chunks = selected_rows(filled.pool, staging, state.range(2) != 0);
  const int threads = static_cast<int>(state.range(1));
  for (auto _ : state) {
    gather_rows(chunks, threads);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(selected_bytes()));
}

// The ceiling of each gather: one memcpy of the same bytes, contiguous (arg: bytes of the range
// gather, 0, or of the selected one, 1).
void BM_Memcpy(benchmark::State& state) {
  const size_t bytes = state.range(0) == 0
                           ? static_cast<size_t>(kBatch * kHeads * kTokens * kHeadDim * 2)
                           : selected_bytes();
  std::vector<char> src(bytes, 1), dst(bytes);
  for (auto _ : state) {
    std::memcpy(dst.data(), src.data(), bytes);
    benchmark::ClobberMemory();
  }
  state.SetBytesProcessed(state.iterations() * static_cast<int64_t>(bytes));
}

BENCHMARK(BM_GatherRange)->Arg(16)->Arg(64)->Arg(128)->Arg(256)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_GatherSelected)
    ->ArgsProduct({{16, 64, 128, 256}, {1, 0}, {0, 1}})
    ->ArgNames({"bt", "threads", "sorted"})
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_Memcpy)->Arg(0)->Arg(1)->ArgName("selected")->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace infinigen

BENCHMARK_MAIN();
