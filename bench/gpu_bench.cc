// bench: the CUDA backend on its device: the host <-> device link, the KV gathers the transfer
// engine issues, and the transformer's ops at OPT-13B shapes. Google Benchmark with manual time:
// each iteration is timed by device events on the stream it ran on (or, for a synchronous
// pageable copy, by the host clock around it), so the numbers are what the device spent.
//
//   gpu_bench [--quick] [Google Benchmark flags, e.g. --benchmark_out=gpu.json
//              --benchmark_out_format=json --benchmark_repetitions=5]
//
// --quick shrinks every shape by 8 (and the link copies to 8 MiB) so that the emulated device runs
// it in seconds: tools/gpu_check.sh --quick checks the program itself that way.
//
// Shapes (OPT-13B: D 5120, H 40, d 128, F 20480; fp16 weights and KV, fp32 activations):
//  - Link/*: one copy of 256 MiB, pageable or pinned host memory, each direction;
//  - Gather/<mode>/<per-mille>: one layer's keys at batch 20 and 2048 tokens (420 MB pinned), a
//    selection of that share of each (sequence, head)'s 256-byte rows in position order (the
//    InfiniGen load), moved by the transfer engine with --gather device or host; `bulk` moves
//    the same bytes as one contiguous copy, the ceiling a gather is judged against; `selected`
//    is the selected-row gather, the selection on the device and no descriptor per row;
//    `selected_cached` the same with 90% of each (sequence, head)'s rows held by InfiniGen's row
//    cache on the device (its rate counts the rows that cross the link);
//  - Op/*: each op of a decoder layer at the decode step of batch 20 over 2048 tokens and at a
//    prefill chunk of 20 x 128 tokens.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/cuda_stream.h"
#include "core/device.h"
#include "core/ops.h"
#include "core/stream.h"
#include "core/tensor.h"
#include "kernels/cuda/gather.h"
#include "offload/transfer_engine.h"

namespace infinigen {
namespace {

int64_t g_shrink = 1;  // --quick: 8

struct Opt13b {
  int64_t batch = 20, d_model = 5120, heads = 40, head_dim = 128, ffn = 20480, context = 2048,
          prefill_tokens = 128;
  size_t link_bytes = size_t{256} << 20;
};

Opt13b shapes() {
  Opt13b s;
  if (g_shrink == 1) return s;
  s.d_model /= g_shrink;
  s.heads /= g_shrink;
  s.ffn /= g_shrink;
  s.context /= g_shrink;
  s.prefill_tokens /= g_shrink;
  s.link_bytes = size_t{8} << 20;
  return s;
}

// A device-event timer on one stream.
class StreamTimer {
 public:
  explicit StreamTimer(void* stream)
      : stream_(stream), start_(cuda_stream::acquire_event()), end_(cuda_stream::acquire_event()) {}
  ~StreamTimer() {
    cuda_stream::release_event(start_);
    cuda_stream::release_event(end_);
  }
  void start() { cuda_stream::record(start_, stream_); }
  double stop() {
    cuda_stream::record(end_, stream_);
    cuda_stream::synchronize_event(end_);
    return cuda_stream::elapsed_seconds(start_, end_);
  }

 private:
  void* stream_;
  void* start_;
  void* end_;
};

struct PinnedBuffer {
  explicit PinnedBuffer(size_t size)
      : data(static_cast<char*>(pinned_alloc(size, "a benchmark buffer"))), bytes(size) {}
  ~PinnedBuffer() { pinned_free(data); }
  char* data;
  size_t bytes;
};

struct DeviceBuffer {
  explicit DeviceBuffer(size_t size)
      : data(static_cast<char*>(device_alloc(Device::Cuda, size))), bytes(size) {}
  ~DeviceBuffer() { device_free(Device::Cuda, data); }
  char* data;
  size_t bytes;
};

void fill_random(char* data, size_t bytes, uint32_t seed) {
  std::mt19937 rng(seed);
  for (size_t i = 0; i + 4 <= bytes; i += 4) {
    const uint32_t word = rng() & 0x3bff3bffu;  // finite fp16 pairs (|x| < 1)
    std::memcpy(data + i, &word, 4);
  }
}

Tensor random_tensor(Shape shape, DType dtype, uint32_t seed) {
  Tensor host = Tensor::empty(shape, dtype, Device::Cpu);
  if (dtype == DType::F32) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    float* data = host.data<float>();
    for (int64_t i = 0; i < host.numel(); ++i) data[i] = dist(rng);
  } else {
    fill_random(static_cast<char*>(host.raw()), host.nbytes(), seed);
  }
  return host.to(Device::Cuda);
}

// ---- the link ----

void link_pageable(benchmark::State& state, bool to_device) {
  const size_t bytes = shapes().link_bytes;
  std::vector<char> host(bytes);
  fill_random(host.data(), bytes, 1);
  DeviceBuffer device(bytes);
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    if (to_device) {
      device_copy(device.data, Device::Cuda, host.data(), Device::Cpu, bytes);
    } else {
      device_copy(host.data(), Device::Cpu, device.data, Device::Cuda, bytes);
    }
    state.SetIterationTime(
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
}

void link_pinned(benchmark::State& state, bool to_device) {
  const size_t bytes = shapes().link_bytes;
  PinnedBuffer host(bytes);
  fill_random(host.data, bytes, 2);
  DeviceBuffer device(bytes);
  void* stream = cuda_stream::create_stream();
  {
    StreamTimer timer(stream);
    for (auto _ : state) {
      timer.start();
      if (to_device) {
        cuda_stream::copy_async(device.data, Device::Cuda, host.data, Device::Cpu, bytes, stream);
      } else {
        cuda_stream::copy_async(host.data, Device::Cpu, device.data, Device::Cuda, bytes, stream);
      }
      state.SetIterationTime(timer.stop());
    }
  }
  cuda_stream::destroy_stream(stream);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
}

// The device reading mapped pinned memory itself: one kernel copying 64 KiB pieces (the device
// gather's path, with pieces large enough that the rows' size does not matter).
void link_mapped(benchmark::State& state) {
  const size_t bytes = shapes().link_bytes, piece = size_t{64} << 10;
  PinnedBuffer host(bytes);
  fill_random(host.data, bytes, 2);
  DeviceBuffer device(bytes);
  const size_t count = bytes / piece;
  PinnedBuffer list(count * sizeof(CopyChunk));
  auto* pieces = reinterpret_cast<CopyChunk*>(list.data);
  for (size_t i = 0; i < count; ++i)
    pieces[i] = {device.data + i * piece, host.data + i * piece, piece};
  void* stream = cuda_stream::create_stream();
  {
    StreamTimer timer(stream);
    for (auto _ : state) {
      timer.start();
      cuda_stream::copy_pieces(pieces, count, stream);
      state.SetIterationTime(timer.stop());
    }
  }
  cuda_stream::destroy_stream(stream);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
}

// Pinning host memory: cudaHostAlloc (mapped, portable) and cudaFreeHost of 4 GiB, what the
// `full` pool of a large batch pays for each 4 GiB before its prefill ends.
void pinned_alloc_rate(benchmark::State& state) {
  const size_t bytes = shapes().link_bytes * 16;
  for (auto _ : state) {
    const auto start = std::chrono::steady_clock::now();
    void* memory = pinned_alloc(bytes, "a benchmark buffer");
    const auto allocated = std::chrono::steady_clock::now();
    pinned_free(memory);
    state.SetIterationTime(std::chrono::duration<double>(allocated - start).count());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
}

// ---- gathers of one layer's keys ----

enum class GatherKind { Device, Host, Bulk };

// One layer's keys in the pool's layout (sequence, head, token, d), pinned and filled once for
// every gather benchmark.
struct KeyLayer {
  KeyLayer()
      : s(shapes()),
        row_bytes(static_cast<size_t>(s.head_dim) * 2),
        pool(static_cast<size_t>(s.batch * s.heads * s.context) * row_bytes) {
    fill_random(pool.data, pool.bytes, 3);
  }
  // `per_mille` of each (sequence, head)'s rows, at random, in position order as the runtime
  // lists a selection.
  std::vector<const char*> select(int64_t per_mille) const {
    const int64_t picked = std::max<int64_t>(1, s.context * per_mille / 1000);
    std::mt19937 rng(4);
    std::vector<int32_t> positions(static_cast<size_t>(s.context));
    std::vector<const char*> rows;
    for (int64_t sh = 0; sh < s.batch * s.heads; ++sh) {
      for (int64_t t = 0; t < s.context; ++t)
        positions[static_cast<size_t>(t)] = static_cast<int32_t>(t);
      std::shuffle(positions.begin(), positions.end(), rng);
      std::sort(positions.begin(), positions.begin() + picked);
      for (int64_t i = 0; i < picked; ++i) {
        rows.push_back(pool.data +
                       static_cast<size_t>(sh * s.context + positions[static_cast<size_t>(i)]) *
                           row_bytes);
      }
    }
    return rows;
  }
  Opt13b s;
  size_t row_bytes;
  PinnedBuffer pool;
};

const KeyLayer& key_layer() {
  static const KeyLayer layer;
  return layer;
}

void gather(benchmark::State& state, GatherKind kind) {
  const KeyLayer& layer = key_layer();
  const std::vector<const char*> selected = layer.select(state.range(0));
  const size_t bytes = selected.size() * layer.row_bytes;
  DeviceBuffer landing(bytes);
  std::vector<CopyChunk> chunks;
  if (kind == GatherKind::Bulk) {
    chunks.push_back({landing.data, layer.pool.data, bytes});
  } else {
    chunks.reserve(selected.size());
    for (size_t i = 0; i < selected.size(); ++i) {
      chunks.push_back({landing.data + i * layer.row_bytes, selected[i], layer.row_bytes});
    }
  }
  TransferEngine engine(Device::Cuda, {},
                        kind == GatherKind::Host ? GatherMode::Host : GatherMode::Device);
  engine.reserve_gathers(chunks.size(), bytes);
  double host_seconds = 0.0;
  for (auto _ : state) {
    const TransferCounters before = engine.counters();
    const auto start = std::chrono::steady_clock::now();
    engine.load(chunks);
    engine.synchronize();
    host_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    state.SetIterationTime(engine.counters().h2d_busy_seconds - before.h2d_busy_seconds);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
  state.counters["rows"] = static_cast<double>(selected.size());
  state.counters["host_ms"] = 1e3 * host_seconds / static_cast<double>(state.iterations());
}

// The selected-row gather (kernels/cuda/gather.h): the same share of each (sequence, head)'s rows
// as Gather/*, keys and values (the keys' pool read twice), the selection in device memory and
// the pool's block table (blocks of 128 tokens, (H, 128, d) each) as addresses in mapped pinned
// memory: no descriptor per row crosses the link. Judged, as the others, by its rate against
// Gather/bulk. With `cached` (Gather/selected_cached), 9 of every 10 rows of each (sequence,
// head) are held by a row cache on the device (as InfiniGen's decode steps find them: the
// built-in models fetch 50-58% again, OPT-13B's synthetic weights 91%), copied on the device
// by a launch of their own; the rate counts the rows that cross the link.
void gather_selected(benchmark::State& state, bool cached) {
  const KeyLayer& layer = key_layer();
  const Opt13b& s = layer.s;
  const int64_t block_tokens = 128, blocks = s.context / block_tokens;
  const int64_t picked = std::max<int64_t>(1, s.context * state.range(0) / 1000);
  std::mt19937 rng(4);
  std::vector<int32_t> order(static_cast<size_t>(s.context));
  std::vector<int32_t> positions;
  for (int64_t sh = 0; sh < s.batch * s.heads; ++sh) {
    for (int64_t t = 0; t < s.context; ++t) order[static_cast<size_t>(t)] = static_cast<int32_t>(t);
    std::shuffle(order.begin(), order.end(), rng);
    std::sort(order.begin(), order.begin() + picked);
    positions.insert(positions.end(), order.begin(), order.begin() + picked);
  }
  const std::vector<int32_t> take(static_cast<size_t>(s.batch), static_cast<int32_t>(picked));
  DeviceBuffer device_positions(positions.size() * sizeof(int32_t));
  DeviceBuffer device_take(take.size() * sizeof(int32_t));
  device_copy(device_positions.data, Device::Cuda, positions.data(), Device::Cpu,
              device_positions.bytes);
  device_copy(device_take.data, Device::Cuda, take.data(), Device::Cpu, device_take.bytes);
  PinnedBuffer table(static_cast<size_t>(s.batch * blocks) * sizeof(void*));
  auto** addresses = reinterpret_cast<const void**>(table.data);
  const size_t block_bytes = static_cast<size_t>(s.heads * block_tokens) * layer.row_bytes;
  for (int64_t i = 0; i < s.batch * blocks; ++i) {
    addresses[i] = layer.pool.data + static_cast<size_t>(i) * block_bytes;
  }
  const size_t bytes = positions.size() * layer.row_bytes;
  DeviceBuffer keys(bytes), values(bytes);
  // The row cache: cache row j of (b, h) holds selected row j where j % 10 != 0.
  std::vector<int32_t> sources(positions.size(), -1);
  size_t link_rows = positions.size();
  if (cached) {
    for (size_t i = 0; i < sources.size(); ++i) {
      const int32_t j = static_cast<int32_t>(i % static_cast<size_t>(picked));
      if (j % 10 != 0) sources[i] = j, --link_rows;
    }
  }
  DeviceBuffer device_sources(sources.size() * sizeof(int32_t));
  device_copy(device_sources.data, Device::Cuda, sources.data(), Device::Cpu, device_sources.bytes);
  DeviceBuffer cached_keys(cached ? bytes : 16), cached_values(cached ? bytes : 16);
  void* stream = cuda_stream::create_stream();
  {
    StreamTimer timer(stream);
    for (auto _ : state) {
      timer.start();
      cuda_stream::gather_selected_rows(
          {reinterpret_cast<const int32_t*>(device_positions.data),
           reinterpret_cast<const int32_t*>(device_take.data), s.batch, s.heads, picked, addresses,
           addresses, blocks, block_tokens, keys.data, values.data, picked,
           static_cast<int64_t>(layer.row_bytes),
           cached ? reinterpret_cast<const int32_t*>(device_sources.data) : nullptr,
           cached_keys.data, cached_values.data, picked},
          stream);
      state.SetIterationTime(timer.stop());
    }
  }
  cuda_stream::destroy_stream(stream);
  state.SetBytesProcessed(
      static_cast<int64_t>(state.iterations() * 2 * link_rows * layer.row_bytes));
  state.counters["rows"] = static_cast<double>(2 * positions.size());
  state.counters["link_rows"] = static_cast<double>(2 * link_rows);
}

// The gather kernel alone (kernels/cuda/gather.h), its list prepared in mapped pinned memory, on
// grids of state.range(1) blocks: `rows`, 10% of the keys' 256-byte rows (InfiniGen's load);
// `blocks`, every (sequence, head)'s 128-token block runs of 32 KiB (the `full` policy's load).
// The gather kernel on a grid of state.range(0) blocks, over either every row of the layer
// (`run_rows` 0) or its runs of `run_rows` rows, at most `max_runs` of them (a short list of
// large pieces: int4's codes and scales are about 70 KB a chunk, 1,300 of them a layer).
void gather_kernel(benchmark::State& state, size_t run_rows,
                   size_t max_runs = std::numeric_limits<size_t>::max()) {
  const KeyLayer& layer = key_layer();
  std::vector<CopyChunk> list;
  if (run_rows == 0) {
    for (const char* row : layer.select(100)) list.push_back({nullptr, row, layer.row_bytes});
  } else {
    const size_t run = run_rows * layer.row_bytes;
    for (size_t offset = 0; offset + run <= layer.pool.bytes && list.size() < max_runs;
         offset += run) {
      list.push_back({nullptr, layer.pool.data + offset, run});
    }
  }
  const size_t bytes = list.size() * list.front().bytes;
  DeviceBuffer landing(bytes);
  PinnedBuffer pieces(list.size() * sizeof(CopyChunk));
  auto* mapped = reinterpret_cast<CopyChunk*>(pieces.data);
  for (size_t i = 0; i < list.size(); ++i) {
    mapped[i] = {landing.data + i * list[i].bytes, list[i].src, list[i].bytes};
  }
  void* stream = cuda_stream::create_stream();
  {
    StreamTimer timer(stream);
    for (auto _ : state) {
      timer.start();
      const int status = kernels::cuda::copy_items(
          reinterpret_cast<const kernels::cuda::CopyItem*>(mapped),
          static_cast<int64_t>(list.size()), stream, static_cast<int>(state.range(0)));
      INFINIGEN_CHECK(status == 0, "gather kernel launch failed (", status, ")");
      state.SetIterationTime(timer.stop());
    }
  }
  cuda_stream::destroy_stream(stream);
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * bytes));
  state.counters["items"] = static_cast<double>(list.size());
}

// What a load costs the compute beside it: a decode layer's worth of GEMMs (4 D x D and the two
// FFN ones at batch 20) on one stream, timed alone and while the device gather of 10% of the
// keys (grid of state.range(0) blocks; 0: the default) runs on another. Reported: the GEMMs' time
// with the gather running, and `alone_us`, without.
void compute_beside_gather(benchmark::State& state) {
  const Opt13b s = shapes();
  Tensor x = random_tensor({s.batch, s.d_model}, DType::F32, 21);
  Tensor h = random_tensor({s.batch, s.ffn}, DType::F32, 22);
  Tensor w_dd = random_tensor({s.d_model, s.d_model}, DType::F16, 23);
  Tensor w_fc1 = random_tensor({s.ffn, s.d_model}, DType::F16, 24);
  Tensor w_fc2 = random_tensor({s.d_model, s.ffn}, DType::F16, 25);
  Tensor y = Tensor::empty({s.batch, s.d_model}, DType::F32, Device::Cuda);
  Tensor y_ffn = Tensor::empty({s.batch, s.ffn}, DType::F32, Device::Cuda);
  const Tensor none;
  const auto layer_gemms = [&] {
    for (int i = 0; i < 4; ++i) ops::linear(x, w_dd, none, y);
    ops::linear(x, w_fc1, none, y_ffn, true);
    ops::linear(h, w_fc2, none, y);
  };
  const KeyLayer& layer = key_layer();
  const std::vector<const char*> rows = layer.select(100);
  DeviceBuffer landing(rows.size() * layer.row_bytes);
  PinnedBuffer pieces(rows.size() * sizeof(CopyChunk));
  auto* mapped = reinterpret_cast<CopyChunk*>(pieces.data);
  for (size_t i = 0; i < rows.size(); ++i) {
    mapped[i] = {landing.data + i * layer.row_bytes, rows[i], layer.row_bytes};
  }
  void* compute = cuda_stream::create_stream();
  void* load = cuda_stream::create_stream();
  double alone = 0.0;
  {
    CudaStreamScope scope(compute);
    layer_gemms();
    StreamTimer timer(compute);
    std::vector<double> solo;
    for (int i = 0; i < 20; ++i) {
      timer.start();
      for (int repeat = 0; repeat < 8; ++repeat) layer_gemms();
      solo.push_back(timer.stop());
    }
    std::sort(solo.begin(), solo.end());
    alone = solo[solo.size() / 2];
    for (auto _ : state) {
      // The gather first, so that it holds its multiprocessors when the GEMMs arrive.
      INFINIGEN_CHECK(
          kernels::cuda::copy_items(reinterpret_cast<const kernels::cuda::CopyItem*>(mapped),
                                    static_cast<int64_t>(rows.size()), load,
                                    static_cast<int>(state.range(0))) == 0,
          "gather kernel launch failed");
      timer.start();
      for (int repeat = 0; repeat < 8; ++repeat) layer_gemms();
      state.SetIterationTime(timer.stop());
      cuda_stream::synchronize(load);
    }
  }
  ops::release_cuda_scratch(compute);
  cuda_stream::destroy_stream(compute);
  cuda_stream::destroy_stream(load);
  state.counters["alone_us"] = alone * 1e6;
}

// ---- ops at OPT-13B shapes ----

// Times `op` on a stream of its own: device time per call, the median of the repetitions.
void time_op(benchmark::State& state, const std::function<void()>& op, double flops, double bytes) {
  void* stream = cuda_stream::create_stream();
  {
    CudaStreamScope scope(stream);
    op();  // warm-up: the stream's scratch and cuBLAS's handle
    StreamTimer timer(stream);
    for (auto _ : state) {
      timer.start();
      op();
      state.SetIterationTime(timer.stop());
    }
  }
  ops::release_cuda_scratch(stream);
  cuda_stream::destroy_stream(stream);
  using benchmark::Counter;
  state.counters["TFLOP/s"] = Counter(flops * 1e-12, Counter::kIsIterationInvariantRate);
  state.counters["GB/s"] = Counter(bytes * 1e-9, Counter::kIsIterationInvariantRate);
}

void linear_op(benchmark::State& state, int n_out_of_ffn, bool prefill) {
  const Opt13b s = shapes();
  const int64_t rows = prefill ? s.batch * s.prefill_tokens : s.batch;
  // n_out_of_ffn: 0 = D -> D (q, k, v, out), 1 = D -> F (fc1), 2 = F -> D (fc2)
  const int64_t K = n_out_of_ffn == 2 ? s.ffn : s.d_model;
  const int64_t N = n_out_of_ffn == 1 ? s.ffn : s.d_model;
  Tensor x = random_tensor({rows, K}, DType::F32, 5);
  Tensor w = random_tensor({N, K}, DType::F16, 6);
  Tensor bias = random_tensor({N}, DType::F32, 7);
  Tensor y = Tensor::empty({rows, N}, DType::F32, Device::Cuda);
  time_op(
      state, [&] { ops::linear(x, w, bias, y, n_out_of_ffn == 1); },
      2.0 * static_cast<double>(rows * N * K), static_cast<double>(N * K * 2 + rows * (K + N) * 4));
}

void layer_norm_op(benchmark::State& state, bool prefill) {
  const Opt13b s = shapes();
  const int64_t rows = prefill ? s.batch * s.prefill_tokens : s.batch;
  Tensor x = random_tensor({rows, s.d_model}, DType::F32, 8);
  Tensor gamma = random_tensor({s.d_model}, DType::F32, 9);
  Tensor beta = random_tensor({s.d_model}, DType::F32, 10);
  Tensor y = Tensor::empty({rows, s.d_model}, DType::F32, Device::Cuda);
  time_op(
      state, [&] { ops::layer_norm(x, gamma, beta, 1e-5f, y); }, 8.0 * rows * s.d_model,
      8.0 * rows * s.d_model);
}

void attention_decode_op(benchmark::State& state) {
  const Opt13b s = shapes();
  Tensor q = random_tensor({s.batch, s.heads * s.head_dim}, DType::F32, 11);
  Tensor k = random_tensor({s.batch, s.heads, s.context, s.head_dim}, DType::F16, 12);
  Tensor v = random_tensor({s.batch, s.heads, s.context, s.head_dim}, DType::F16, 13);
  Tensor out = Tensor::empty({s.batch, s.heads * s.head_dim}, DType::F32, Device::Cuda);
  const std::vector<int32_t> first_valid(static_cast<size_t>(s.batch), 0);
  const double kv_bytes = 2.0 * static_cast<double>(k.nbytes());
  time_op(
      state, [&] { ops::attention_decode(q, k, v, out, s.context, first_valid); },
      4.0 * static_cast<double>(s.batch * s.heads * s.context * s.head_dim), kv_bytes);
}

// An extension of `rows` rows per sequence over a cache of the context (a prompt's last chunk):
// fewer than 8 rows take the decode kernel once per row, more the tiled kernel. Bytes are the
// cache's K and V read once, so GB/s shows how often the kernel reads each row again.
void attention_extend_op(benchmark::State& state, int64_t rows) {
  const Opt13b s = shapes();
  const int64_t width = s.heads * s.head_dim;
  Tensor q = random_tensor({s.batch * rows, width}, DType::F32, 11);
  Tensor k = random_tensor({s.batch, s.heads, s.context, s.head_dim}, DType::F16, 12);
  Tensor v = random_tensor({s.batch, s.heads, s.context, s.head_dim}, DType::F16, 13);
  Tensor out = Tensor::empty({s.batch * rows, width}, DType::F32, Device::Cuda);
  const std::vector<int32_t> first_valid(static_cast<size_t>(s.batch), 0);
  // Query i of the last `rows` sees context - rows + i + 1 rows: QK^T and PV.
  const double pairs = static_cast<double>(rows) * static_cast<double>(s.context - rows) +
                       static_cast<double>(rows * (rows + 1) / 2);
  time_op(
      state, [&] { ops::attention_decode(q, k, v, out, s.context, first_valid); },
      4.0 * static_cast<double>(s.batch * s.heads * s.head_dim) * pairs,
      2.0 * static_cast<double>(k.nbytes()));
}

// Prefill attention over `tokens` tokens per sequence (a chunk of 128, or a whole 1920-token
// prompt: the Fig. 14 point's).
void attention_prefill_op(benchmark::State& state, int64_t tokens) {
  Opt13b s = shapes();
  s.prefill_tokens = tokens / g_shrink;
  const int64_t rows = s.batch * s.prefill_tokens, width = s.heads * s.head_dim;
  Tensor q = random_tensor({rows, width}, DType::F32, 14);
  Tensor k = random_tensor({rows, width}, DType::F32, 15);
  Tensor v = random_tensor({rows, width}, DType::F32, 16);
  Tensor out = Tensor::empty({rows, width}, DType::F32, Device::Cuda);
  const std::vector<int32_t> first_valid(static_cast<size_t>(s.batch), 0);
  // causal: about half of the n^2 score matrix, QK^T and PV
  const double flops = 2.0 * static_cast<double>(s.batch * s.heads * s.head_dim) *
                       static_cast<double>(s.prefill_tokens * s.prefill_tokens);
  time_op(
      state, [&] { ops::attention_prefill(q, k, v, out, s.batch, s.heads, first_valid); }, flops,
      16.0 * static_cast<double>(rows * width));
}

void cache_store_op(benchmark::State& state) {
  const Opt13b s = shapes();
  Tensor rows = random_tensor({s.batch, s.heads * s.head_dim}, DType::F32, 17);
  Tensor cache = random_tensor({s.batch, s.heads, s.context, s.head_dim}, DType::F16, 18);
  time_op(
      state, [&] { ops::cache_store(rows, cache, s.context - 1); }, 0.0,
      6.0 * static_cast<double>(rows.numel()));
}

// Registers `run` under `name`; an engine error ends that benchmark with its message, not the
// program.
benchmark::internal::Benchmark* add(const std::string& name,
                                    std::function<void(benchmark::State&)> run) {
  return benchmark::RegisterBenchmark(name.c_str(),
                                      [run](benchmark::State& state) {
                                        try {
                                          run(state);
                                        } catch (const std::exception& e) {
                                          state.SkipWithError(e.what());
                                        }
                                      })
      ->UseManualTime();
}

void register_benchmarks() {
  using benchmark::kMicrosecond;
  using benchmark::kMillisecond;
  for (bool to_device : {true, false}) {
    const std::string way = to_device ? "h2d" : "d2h";
    add("Link/pageable/" + way, [=](auto& s) { link_pageable(s, to_device); })->Unit(kMillisecond);
    add("Link/pinned/" + way, [=](auto& s) { link_pinned(s, to_device); })->Unit(kMillisecond);
  }
  add("Link/mapped/h2d", link_mapped)->Unit(kMillisecond);
  add("Link/pinned_alloc", pinned_alloc_rate)->Unit(kMillisecond)->Iterations(3);
  const std::pair<const char*, GatherKind> kinds[] = {
      {"device", GatherKind::Device}, {"host", GatherKind::Host}, {"bulk", GatherKind::Bulk}};
  for (const auto& [name, kind] : kinds) {
    for (int per_mille : {10, 50, 100, 300}) {
      add(std::string("Gather/") + name, [kind = kind](auto& s) { gather(s, kind); })
          ->Arg(per_mille)
          ->Unit(kMillisecond);
    }
  }
  for (int per_mille : {10, 50, 100, 300}) {
    add("Gather/selected", [](auto& s) { gather_selected(s, false); })
        ->Arg(per_mille)
        ->Unit(kMillisecond);
    add("Gather/selected_cached", [](auto& s) { gather_selected(s, true); })
        ->Arg(per_mille)
        ->Unit(kMillisecond);
  }
  for (int blocks : {4, 8, 16, 1056}) {
    add("GatherKernel/rows", [](auto& s) { gather_kernel(s, 0); })->Arg(blocks)->Unit(kMillisecond);
  }
  for (int blocks : {8, 1056}) {
    add("GatherKernel/blocks", [](auto& s) { gather_kernel(s, 128); })
        ->Arg(blocks)
        ->Unit(kMillisecond);
  }
  add("GatherKernel/few_large", [](auto& s) { gather_kernel(s, 256, 1300); })
      ->Arg(0)
      ->Unit(kMillisecond);
  for (int blocks : {0, 16, 1056}) {
    add("ComputeBesideGather", compute_beside_gather)->Arg(blocks)->Unit(kMicrosecond);
  }
  const char* linears[] = {"d_d", "fc1", "fc2"};
  for (bool prefill : {false, true}) {
    const std::string phase = prefill ? "prefill/" : "decode/";
    for (int which = 0; which < 3; ++which) {
      add("Op/linear/" + phase + linears[which], [=](auto& s) {
        linear_op(s, which, prefill);
      })->Unit(kMicrosecond);
    }
    add("Op/layer_norm/" + phase.substr(0, phase.size() - 1), [=](auto& s) {
      layer_norm_op(s, prefill);
    })->Unit(kMicrosecond);
  }
  add("Op/attention/decode", attention_decode_op)->Unit(kMicrosecond);
  for (int64_t tokens : {128, 1920}) {
    add("Op/attention/prefill/" + std::to_string(tokens), [=](auto& s) {
      attention_prefill_op(s, tokens);
    })->Unit(kMicrosecond);
  }
  for (int64_t rows : {4, 16, 128}) {
    add("Op/attention/extend/" + std::to_string(rows), [=](auto& s) {
      attention_extend_op(s, rows);
    })->Unit(kMicrosecond);
  }
  add("Op/cache_store/decode", cache_store_op)->Unit(kMicrosecond);
}

}  // namespace
}  // namespace infinigen

int main(int argc, char** argv) {
  std::vector<char*> args;
  for (int i = 0; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) {
      infinigen::g_shrink = 8;
    } else {
      args.push_back(argv[i]);
    }
  }
  if (infinigen::cuda_devices().empty()) {
    std::fprintf(stderr, "gpu_bench: no CUDA device%s%s\n",
                 infinigen::cuda_discovery_error().empty() ? "" : ": ",
                 infinigen::cuda_discovery_error().c_str());
    return 1;
  }
  int count = static_cast<int>(args.size());
  infinigen::register_benchmarks();
  benchmark::Initialize(&count, args.data());
  if (benchmark::ReportUnrecognizedArguments(count, args.data())) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
