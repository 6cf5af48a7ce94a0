// tests: the layer pipeline's streams on a CUDA device (the emulated one in CI): loads, stores and
// compute on three non-blocking CUDA streams, ordered by device events only.
//
// Each test races a transfer of a large buffer against a kernel on the compute stream that reads
// (or writes) its last rows, which the copy reaches last. Without the dependency the test checks
// (remove engine.compute_waits(...) below, or the compute wait in TransferEngine::enqueue), the
// kernel runs while the copy is still on its way and the test reads NaN (the emulated device
// poisons new device memory) or the old values.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <utility>
#include <vector>

#include "core/cuda_stream.h"
#include "core/device.h"
#include "core/ops.h"
#include "core/stream.h"
#include "core/tensor.h"
#include "offload/kv_pool.h"
#include "offload/transfer_engine.h"
#include "tests/test_util.h"

namespace infinigen {
namespace {

// Rows of the raced buffer: 64 MiB of fp32, so a copy takes milliseconds even on the emulation.
constexpr int64_t kRows = 16384;
constexpr int64_t kWidth = 1024;

// The last `rows` rows of a (kRows, kWidth) fp32 device tensor, as a view.
Tensor last_rows(Tensor& t, int64_t rows) {
  float* data = t.data<float>() + (kRows - rows) * kWidth;
  return Tensor::view(data, {rows, kWidth}, DType::F32, t.device(), nullptr);
}

// Pinned host memory holding kRows x kWidth floats, all `value`.
struct PinnedRows {
  explicit PinnedRows(float value)
      : data(static_cast<float*>(pinned_alloc(sizeof(float) * kRows * kWidth, "a test buffer"))) {
    std::fill(data, data + kRows * kWidth, value);
  }
  ~PinnedRows() { pinned_free(data); }
  float* data;
};

TEST(PipelineStreams, ComputeReadsStagedRowsOnlyAfterTheirLoad) {
  INFINIGEN_SKIP_WITHOUT_CUDA_DEVICE();
  TransferEngine engine(Device::Cuda, {});
  const CudaStreamScope compute(engine.compute_stream().cuda_handle());
  ASSERT_NE(engine.compute_stream().cuda_handle(), nullptr);
  const PinnedRows host(3.0f);
  Tensor staged = Tensor::empty({kRows, kWidth}, DType::F32, Device::Cuda);
  Tensor sum = Tensor::zeros({4, kWidth}, DType::F32, Device::Cuda);

  const EventPtr loaded = engine.load({{staged.raw(), host.data, sizeof(float) * kRows * kWidth}},
                                      nullptr, {"kv_load", 0});
  std::vector<double*> no_stall;
  engine.compute_waits(loaded, no_stall);
  ops::add_inplace(sum, last_rows(staged, 4));  // the rows the copy writes last

  const Tensor result = sum.to(Device::Cpu);
  for (int64_t i = 0; i < result.numel(); ++i) {
    ASSERT_EQ(result.data<float>()[i], 3.0f) << "element " << i << " read before its load";
  }
  engine.synchronize();
  engine.settle_stalls();
}

TEST(PipelineStreams, StoreReadsWhatComputeWroteBeforeIt) {
  INFINIGEN_SKIP_WITHOUT_CUDA_DEVICE();
  TransferEngine engine(Device::Cuda, {});
  const CudaStreamScope compute(engine.compute_stream().cuda_handle());
  PinnedRows host(0.0f);
  Tensor rows = Tensor::zeros({kRows, kWidth}, DType::F32, Device::Cuda);
  // Compute writes every row (1.0 after the add), then a store copies the last row to the host:
  // it must follow the kernel although it runs on another stream.
  Tensor ones = Tensor::empty({kRows, kWidth}, DType::F32, Device::Cuda);
  const std::vector<float> one_values(static_cast<size_t>(kRows * kWidth), 1.0f);
  device_copy(ones.raw(), Device::Cuda, one_values.data(), Device::Cpu, ones.nbytes());
  ops::add_inplace(rows, ones);
  const size_t row_bytes = sizeof(float) * kWidth;
  float* last_host_row = host.data + (kRows - 1) * kWidth;
  const EventPtr stored =
      engine.store({{last_host_row, rows.data<float>() + (kRows - 1) * kWidth, row_bytes}}, nullptr,
                   {"kv_store", 0});
  stored->wait();
  for (int64_t i = 0; i < kWidth; ++i) {
    ASSERT_EQ(last_host_row[i], 1.0f) << "element " << i << " stored before compute wrote it";
  }
}

TEST(PipelineStreams, ComputeWaitsAreDeviceSideAndTheirStallIsSettled) {
  INFINIGEN_SKIP_WITHOUT_CUDA_DEVICE();
  TransferEngine engine(Device::Cuda, {});
  const CudaStreamScope compute(engine.compute_stream().cuda_handle());
  const PinnedRows host(1.0f);
  Tensor staged = Tensor::empty({kRows, kWidth}, DType::F32, Device::Cuda);
  // The load starts only once compute's wait is enqueued, so compute surely stalls (on a busy
  // machine the host may otherwise reach the wait after the copy has ended).
  std::atomic<bool> released{false};
  cuda_stream::host_func(
      engine.load_stream().cuda_handle(),
      [](void* flag) {
        while (!static_cast<std::atomic<bool>*>(flag)->load()) std::this_thread::yield();
      },
      &released);
  const EventPtr loaded = engine.load({{staged.raw(), host.data, sizeof(float) * kRows * kWidth}},
                                      nullptr, {"kv_load", 0});
  double stall = 0.0;
  engine.compute_waits(loaded, {&stall});
  released = true;
  // On CUDA the host does not wait: the stall is added once the events are complete.
  EXPECT_EQ(stall, 0.0);
  engine.settle_stalls();
  // Compute had nothing else to do, so it stalled from the wait until the copy ended.
  EXPECT_GT(stall, 0.0);
  EXPECT_TRUE(loaded->ready());
  const TransferCounters counters = engine.counters();
  EXPECT_EQ(counters.h2d_bytes, sizeof(float) * kRows * kWidth);
  EXPECT_EQ(counters.h2d_transfers, 1u);
  EXPECT_GT(counters.h2d_busy_seconds, 0.0);  // from the device's events around the copy
}

// Gathers of many small chunks, each way, in both modes, scattered over a pinned "pool" in a
// shuffled order, into or out of a device buffer. Every path of the gather kernel: rows of 64,
// 256 and 512 bytes (16-byte words, several rows per warp-wide pass), of 48 (16-byte words, a
// row at a time), of 100 (bytes) and of 4 KiB + 16 (16-byte words, several per lane in flight);
// 3000 pieces leave a last group of fewer than 32 per warp, 300 and 9 give each warp of the grid
// a group of 3 or 1 (a short list of large pieces).
class PipelineGather : public ::testing::TestWithParam<GatherMode> {};

TEST_P(PipelineGather, ManySmallChunksLandInPlaceBothWays) {
  INFINIGEN_SKIP_WITHOUT_CUDA_DEVICE();
  TransferEngine engine(Device::Cuda, {}, GetParam());
  const CudaStreamScope compute(engine.compute_stream().cuda_handle());
  const std::pair<size_t, size_t> shapes[] = {{256, 3000}, {64, 3000},       {512, 3000},
                                              {48, 3000},  {100, 3000},      {4096 + 16, 3000},
                                              {256, 300},  {4096 + 16, 300}, {4096 + 16, 9}};
  for (const auto& [row, pieces] : shapes) {
    const size_t bytes = pieces * row;
    auto* pool = static_cast<uint8_t*>(pinned_alloc(2 * bytes, "a test pool"));
    auto* back = static_cast<uint8_t*>(pinned_alloc(2 * bytes, "a test pool"));
    for (size_t i = 0; i < 2 * bytes; ++i) pool[i] = static_cast<uint8_t>(i * 7 + i / 251);
    std::fill(back, back + 2 * bytes, uint8_t{0});
    void* device = device_alloc(Device::Cuda, bytes);
    // Piece i: pool row 2 * perm(i) + 1 -> device row i -> back row 2 * perm(i) + 1.
    std::vector<CopyChunk> loads, stores;
    for (size_t i = 0; i < pieces; ++i) {
      const size_t from = 2 * ((i * 1237) % pieces) + 1;  // 1237 is a prime: a permutation
      uint8_t* on_device = static_cast<uint8_t*>(device) + i * row;
      loads.push_back({on_device, pool + from * row, row});
      stores.push_back({back + from * row, on_device, row});
    }
    const EventPtr loaded = engine.load(loads, nullptr, {"kv_load", 0});
    engine.compute_waits(loaded, {});
    // The load on its own (a fault of the load that the store undid would cancel out below).
    std::vector<uint8_t> landed(bytes);
    device_copy(landed.data(), Device::Cpu, device, Device::Cuda, bytes);
    for (size_t i = 0; i < pieces; ++i) {
      const size_t from = 2 * ((i * 1237) % pieces) + 1;
      ASSERT_EQ(std::memcmp(landed.data() + i * row, pool + from * row, row), 0)
          << "piece " << i << " with rows of " << row;
    }
    const EventPtr stored = engine.store(stores, nullptr, {"kv_store", 0});
    stored->wait();
    for (size_t i = 0; i < 2 * bytes; ++i) {
      const bool moved = (i / row) % 2 == 1;
      ASSERT_EQ(back[i], moved ? pool[i] : 0) << "byte " << i << " with rows of " << row;
    }
    engine.synchronize();
    device_free(Device::Cuda, device);
    pinned_free(pool);
    pinned_free(back);
    const TransferCounters counters = engine.counters();
    EXPECT_GT(counters.h2d_busy_seconds, 0.0);
  }
}

INSTANTIATE_TEST_SUITE_P(Modes, PipelineGather,
                         ::testing::Values(GatherMode::Device, GatherMode::Host),
                         [](const auto& param_info) {
                           return param_info.param == GatherMode::Device ? "Device" : "Host";
                         });

// More device gathers in flight than the engine has gather lists (it reuses one once the kernel
// that read it has run): each lands its own rows. The first transfer is a large copy that the
// gathers queue behind, so the host runs ahead of the device through every list.
TEST(PipelineStreams, MoreGathersInFlightThanListsEachLandTheirRows) {
  INFINIGEN_SKIP_WITHOUT_CUDA_DEVICE();
  TransferEngine engine(Device::Cuda, {}, GatherMode::Device);
  const CudaStreamScope compute(engine.compute_stream().cuda_handle());
  constexpr size_t kRow = 256, kPerLoad = 200, kTransfers = 11, kBig = size_t{64} << 20;
  auto* pool =
      static_cast<uint8_t*>(pinned_alloc(kTransfers * kPerLoad * kRow + kBig, "a test pool"));
  for (size_t i = 0; i < kTransfers * kPerLoad * kRow; ++i)
    pool[i] = static_cast<uint8_t>(i * 13 + i / 509);
  auto* device =
      static_cast<uint8_t*>(device_alloc(Device::Cuda, kTransfers * kPerLoad * kRow + kBig));
  engine.load({{device + kTransfers * kPerLoad * kRow, pool + kTransfers * kPerLoad * kRow, kBig}});
  for (size_t t = 0; t < kTransfers; ++t) {
    std::vector<CopyChunk> rows;
    for (size_t r = 0; r < kPerLoad; ++r) {
      const size_t from = t * kPerLoad + (r * 7) % kPerLoad;  // 7 is prime to 200
      rows.push_back({device + (t * kPerLoad + r) * kRow, pool + from * kRow, kRow});
    }
    engine.load(std::move(rows));
  }
  engine.synchronize();
  std::vector<uint8_t> landed(kTransfers * kPerLoad * kRow);
  device_copy(landed.data(), Device::Cpu, device, Device::Cuda, landed.size());
  for (size_t t = 0; t < kTransfers; ++t) {
    for (size_t r = 0; r < kPerLoad; ++r) {
      const size_t from = t * kPerLoad + (r * 7) % kPerLoad;
      ASSERT_EQ(std::memcmp(landed.data() + (t * kPerLoad + r) * kRow, pool + from * kRow, kRow), 0)
          << "transfer " << t << ", row " << r;
    }
  }
  device_free(Device::Cuda, device);
  pinned_free(pool);
}

// InfiniGen's loads with the selection on the device: the selected-row gather reads each chosen
// row of the paged pool, through its block table as addresses in mapped memory, into the compact
// staging rows [fetch - take[b], fetch) of its (sequence, head), fetch the largest take, and
// writes nothing else.
TEST(PipelineStreams, SelectedRowsLandCompactWithTheSelectionOnTheDevice) {
  INFINIGEN_SKIP_WITHOUT_CUDA_DEVICE();
  const int64_t B = 3, H = 2, d = 64, tokens = 40, stride = 6, rows = 8;
  KvPool pool({1, B, H, d, tokens, 16, DType::F16});
  pool.reserve(tokens);
  // Row (kind, b, h, t) holds values no other row holds.
  const auto value = [](int64_t kind, int64_t b, int64_t h, int64_t t, int64_t c) {
    return static_cast<uint16_t>((kind * 20011 + b * 5003 + h * 1009 + t * 71 + c) % 30000);
  };
  for (int64_t kind = 0; kind < 2; ++kind) {
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < H; ++h) {
        for (int64_t t = 0; t < tokens; ++t) {
          auto* row = static_cast<uint16_t*>(pool.row(0, static_cast<KvKind>(kind), b, h, t));
          for (int64_t c = 0; c < d; ++c) row[c] = value(kind, b, h, t, c);
        }
      }
    }
  }
  // Sequence 1 takes nothing; each (b, h) its own ascending positions, across blocks.
  const std::vector<int32_t> take = {5, 0, 3};
  std::vector<int32_t> positions(static_cast<size_t>(B * H * stride), -7);  // -7: never read
  for (int64_t bh = 0; bh < B * H; ++bh) {
    const int64_t b = bh / H;
    for (int64_t j = 0; j < take[static_cast<size_t>(b)]; ++j) {
      positions[static_cast<size_t>(bh * stride + j)] =
          static_cast<int32_t>((bh * 3 + j * 7) % 6 + j * 6);
    }
  }
  auto* device_positions = static_cast<int32_t*>(device_alloc(Device::Cuda, positions.size() * 4));
  auto* device_take = static_cast<int32_t*>(device_alloc(Device::Cuda, take.size() * 4));
  device_copy(device_positions, Device::Cuda, positions.data(), Device::Cpu, positions.size() * 4);
  device_copy(device_take, Device::Cuda, take.data(), Device::Cpu, take.size() * 4);
  const int64_t blocks = pool.num_blocks();
  auto** tables = static_cast<const void**>(
      pinned_alloc(2 * static_cast<size_t>(B * blocks) * sizeof(void*), "a test's block tables"));
  pool.block_addresses(0, KvKind::Key, tables);
  pool.block_addresses(0, KvKind::Value, tables + B * blocks);
  Tensor keys = Tensor::zeros({B, H, rows, d}, DType::F16, Device::Cuda);
  Tensor values = Tensor::zeros({B, H, rows, d}, DType::F16, Device::Cuda);

  TransferEngine engine(Device::Cuda, {});
  cuda_stream::gather_selected_rows(
      {device_positions, device_take, B, H, stride, tables, tables + B * blocks, blocks, 16,
       keys.raw(), values.raw(), rows, static_cast<int64_t>(d * sizeof(uint16_t))},
      engine.load_stream().cuda_handle());
  engine.load_stream().synchronize();

  const Tensor staged[2] = {keys.to(Device::Cpu), values.to(Device::Cpu)};
  const int64_t fetch = 5;
  for (int64_t kind = 0; kind < 2; ++kind) {
    const auto* got = static_cast<const uint16_t*>(staged[kind].raw());
    for (int64_t bh = 0; bh < B * H; ++bh) {
      const int64_t b = bh / H, h = bh % H, n = take[static_cast<size_t>(b)];
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t j = r - (fetch - n);
        for (int64_t c = 0; c < d; ++c) {
          const uint16_t expected =
              j >= 0 && j < n
                  ? value(kind, b, h, positions[static_cast<size_t>(bh * stride + j)], c)
                  : 0;
          ASSERT_EQ(got[(bh * rows + r) * d + c], expected)
              << "kind " << kind << " sequence " << b << " head " << h << " row " << r;
        }
      }
    }
  }
  pinned_free(tables);
  device_free(Device::Cuda, device_positions);
  device_free(Device::Cuda, device_take);
}

TEST(PipelineStreams, LinkEmulationIsRefusedOnACudaDevice) {
  INFINIGEN_SKIP_WITHOUT_CUDA_DEVICE();
  try {
    TransferEngine engine(Device::Cuda, {12.0, 0.0});
    FAIL() << "a CUDA engine accepted link emulation";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("emulate"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace infinigen
