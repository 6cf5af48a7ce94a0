// bench: InfiniGen's speculation on the CPU backend (PartialLayer::speculate: the partial query,
// the estimated logits over every stored partial key, the selection), by context length, batch,
// grouped queries and the partial key dtype.
//
// Shapes: d 128, r 38 (ratio 0.3), H 32 query heads over H_kv 8 (Llama-3.1-8B's grouping, 4 per
// KV head) or H 32 over 32 (OPT's multi-head attention); the bytes reported are the partial keys
// scanned, which is what the cost model's speculation rate (speculation_bytes_per_s) divides.
#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "core/tensor.h"
#include "speculate/speculation.h"

namespace infinigen {
namespace {

constexpr int64_t kHeadDim = 128, kColumns = 38;

Tensor uniform(const Shape& shape, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> values(-1.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(shape_numel(shape)));
  for (float& x : v) x = values(rng);
  return Tensor::from_floats(shape, v);
}

// Arguments: batch, query heads, KV heads, positions, partial key dtype (0: f16, 1: f32).
void BM_Speculate(benchmark::State& state) {
  const int64_t B = state.range(0), H = state.range(1), Hkv = state.range(2), n = state.range(3);
  const DType key_dtype = state.range(4) == 0 ? DType::F16 : DType::F32;
  const int64_t D = H * kHeadDim;
  // The prompt's queries and keys are only read to choose the columns and fill the cache: one
  // sequence's worth, repeated, keeps the set-up's memory small at long contexts.
  const Tensor queries = uniform({B * n, D}, 1);
  const Tensor keys = uniform({B * n, Hkv * kHeadDim}, 2);
  const Tensor weight = uniform({D, D}, 3);
  const Tensor bias = uniform({D}, 4);
  const Tensor x = uniform({B, D}, 5);
  const Tensor none;
  const std::vector<int32_t> first_valid(static_cast<size_t>(B), 0);
  PartialLayer layer;
  layer.build({queries, keys, weight, bias, none, none}, first_valid, H, Hkv, n, kColumns,
              PartialIndexRule::QK, nullptr, key_dtype);
  SpeculationOptions options;
  options.max_num_kv = options.fetch_cap(n);
  for (auto _ : state) {
    PartialLayer::Selection selection = layer.speculate(x, {}, n, first_valid, options);
    benchmark::DoNotOptimize(selection);
  }
  state.SetBytesProcessed(state.iterations() * B * Hkv * n * kColumns *
                          static_cast<int64_t>(dtype_size(key_dtype)));
}

void shapes(benchmark::internal::Benchmark* b) {
  for (int64_t dtype : {0, 1}) {
    for (int64_t n : {2048, 8192, 32768}) b->Args({1, 32, 8, n, dtype});  // one long sequence
    for (int64_t n : {2048, 8192}) {
      b->Args({4, 32, 8, n, dtype});   // ShadowKV's smallest batch, grouped queries
      b->Args({4, 32, 32, n, dtype});  // multi-head
    }
  }
}

BENCHMARK(BM_Speculate)->Apply(shapes)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace
}  // namespace infinigen

BENCHMARK_MAIN();
