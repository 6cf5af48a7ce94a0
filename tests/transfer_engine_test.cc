// tests: the transfer engine (gather copies, counters, ordering, link emulation, overlap) and the
// debug NaN poisoning and pinned memory it relies on.
#include "offload/transfer_engine.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <future>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/device.h"
#include "core/error.h"
#include "core/stream.h"
#include "core/tensor.h"

namespace infinigen {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

double now_seconds() {
  return std::chrono::duration<double>(Clock::now().time_since_epoch()).count();
}

std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> bytes(n);
  for (uint8_t& b : bytes) b = static_cast<uint8_t>(rng());
  return bytes;
}

TEST(TransferEngine, GatherCopiesLandAndCountersAreExact) {
  TransferEngine engine(Device::Cpu, {});
  // Three sources of odd sizes (one empty) gathered into one contiguous destination.
  const std::vector<size_t> sizes = {100, 0, 4103};
  std::vector<std::vector<uint8_t>> sources;
  for (size_t i = 0; i < sizes.size(); ++i) {
    sources.push_back(random_bytes(sizes[i], static_cast<uint32_t>(i + 1)));
  }
  const size_t total = std::accumulate(sizes.begin(), sizes.end(), size_t{0});
  std::vector<uint8_t> device_side(total, 0);
  std::vector<CopyChunk> gather;
  size_t offset = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    gather.push_back({device_side.data() + offset, sources[i].data(), sizes[i]});
    offset += sizes[i];
  }
  engine.load(gather);
  engine.load(gather);
  engine.synchronize();
  offset = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    const std::vector<uint8_t> landed(device_side.begin() + offset,
                                      device_side.begin() + offset + sizes[i]);
    EXPECT_EQ(landed, sources[i]) << "chunk " << i;
    offset += sizes[i];
  }

  // And back: scatter the contiguous buffer into host chunks in reverse order.
  std::vector<uint8_t> back(total, 0);
  engine.store({{back.data() + 4103, device_side.data(), 100},
                {back.data(), device_side.data() + 100, 4103}});
  engine.synchronize();
  EXPECT_EQ(std::memcmp(back.data() + 4103, sources[0].data(), 100), 0);
  EXPECT_EQ(std::memcmp(back.data(), sources[2].data(), 4103), 0);

  const TransferCounters counters = engine.counters();
  EXPECT_EQ(counters.h2d_bytes, 2 * total);
  EXPECT_EQ(counters.h2d_transfers, 2u);
  EXPECT_EQ(counters.d2h_bytes, total);
  EXPECT_EQ(counters.d2h_transfers, 1u);
  EXPECT_GE(counters.h2d_busy_seconds, 0.0);
  EXPECT_GE(counters.d2h_busy_seconds, 0.0);
}

TEST(TransferEngine, EmptyTransferStillCountsAndCompletes) {
  TransferEngine engine(Device::Cpu, {});
  EventPtr done = engine.load({});
  done->wait();
  EXPECT_EQ(engine.counters().h2d_transfers, 1u);
  EXPECT_EQ(engine.counters().h2d_bytes, 0u);
}

TEST(TransferEngine, RejectsNullChunksAndBadLinks) {
  TransferEngine engine(Device::Cpu, {});
  uint8_t byte = 0;
  EXPECT_THROW(engine.load({{nullptr, &byte, 1}}), Error);
  EXPECT_THROW(engine.store({{&byte, nullptr, 1}}), Error);
  EXPECT_NO_THROW(engine.load({{nullptr, nullptr, 0}}));
  EXPECT_THROW(TransferEngine(Device::Cpu, {-1.0, 0.0}), Error);
  EXPECT_THROW(TransferEngine(Device::Cpu, {1.0, std::nan("")}), Error);
  engine.synchronize();
}

TEST(TransferEngine, LoadRunsAfterTheEventOfAnotherStream) {
  TransferEngine engine(Device::Cpu, {});
  Stream producer("producer");
  std::promise<void> gate;
  std::shared_future<void> opened = gate.get_future().share();
  std::vector<uint8_t> host(1 << 16, 0);
  std::vector<uint8_t> device_side(host.size(), 0);
  producer.enqueue([&] {
    opened.wait();
    std::memset(host.data(), 0xab, host.size());
  });
  EventPtr produced = producer.record();
  EventPtr loaded = engine.load({{device_side.data(), host.data(), host.size()}}, produced);
  // The load must not copy the zeros that are there now.
  std::this_thread::sleep_for(20ms);
  EXPECT_FALSE(loaded->ready());
  gate.set_value();
  loaded->wait();
  for (uint8_t b : device_side) ASSERT_EQ(b, 0xab);

  // A store ordered after that load (the engine's two streams) reads what the load wrote.
  std::vector<uint8_t> stored(host.size(), 0);
  engine.store({{stored.data(), device_side.data(), stored.size()}}, loaded)->wait();
  EXPECT_EQ(stored, device_side);
  producer.synchronize();
}

TEST(TransferEngine, FailedAfterEventPoisonsTheTransfer) {
  TransferEngine engine(Device::Cpu, {});
  Stream producer("producer");
  producer.enqueue([] { fail("producer failed"); });
  uint8_t src = 1;
  uint8_t dst = 0;
  EventPtr loaded = engine.load({{&dst, &src, 1}}, producer.record());
  EXPECT_THROW(loaded->wait(), Error);
  EXPECT_THROW(engine.synchronize(), Error);
  EXPECT_EQ(dst, 0);
  EXPECT_EQ(engine.counters().h2d_transfers, 0u);
}

TEST(TransferEngine, LinkEmulationTakesAtLeastBytesOverBandwidth) {
  TransferEngine engine(Device::Cpu, {1.0, 0.0});  // 1 GB/s, no latency
  std::vector<uint8_t> src(8'000'000, 1);
  std::vector<uint8_t> dst(src.size(), 0);
  const auto start = Clock::now();
  engine.load({{dst.data(), src.data(), src.size()}});
  engine.synchronize();
  const double wall = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_GE(wall, 0.0075);
  EXPECT_GE(engine.counters().h2d_busy_seconds, 0.0075);
  EXPECT_EQ(dst, src);
}

TEST(TransferEngine, LinkEmulationAddsLatencyPerTransfer) {
  TransferEngine engine(Device::Cpu, {0.0, 5000.0});  // 5 ms per transfer, unlimited bandwidth
  uint8_t src = 3;
  uint8_t dst = 0;
  const auto start = Clock::now();
  for (int i = 0; i < 3; ++i) engine.store({{&dst, &src, 1}});
  engine.synchronize();
  const double wall = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_GE(wall, 3 * 0.0049);
  EXPECT_GE(engine.counters().d2h_busy_seconds, 3 * 0.0049);
  EXPECT_EQ(dst, 3);
}

TEST(TransferEngine, LoadsAndStoresOverlap) {
  // 10 MB at 0.1 GB/s: 100 ms each way.
  constexpr double kTransferSeconds = 0.1;
  TransferEngine engine(Device::Cpu, {0.1, 0.0});
  std::vector<uint8_t> a(10'000'000, 1);
  std::vector<uint8_t> b(a.size(), 0);
  std::vector<uint8_t> c(a.size(), 2);
  std::vector<uint8_t> d(a.size(), 0);
  const double issued = now_seconds();
  EventPtr loaded = engine.load({{b.data(), a.data(), a.size()}});
  EventPtr stored = engine.store({{d.data(), c.data(), c.size()}});
  engine.synchronize();
  const double load_done = loaded->completed_at();
  const double store_done = stored->completed_at();
  EXPECT_GE(load_done - issued, kTransferSeconds * 0.99);
  EXPECT_GE(store_done - issued, kTransferSeconds * 0.99);
  // Run one after the other, the second would finish at least a full transfer time after the
  // first; run side by side they finish together. The bound sits far from both.
  EXPECT_LT(std::abs(store_done - load_done), kTransferSeconds * 0.75)
      << "load and store did not overlap";
  EXPECT_GE(engine.counters().h2d_busy_seconds, kTransferSeconds * 0.99);
  EXPECT_GE(engine.counters().d2h_busy_seconds, kTransferSeconds * 0.99);
  EXPECT_EQ(b, a);
  EXPECT_EQ(d, c);
}

TEST(TransferEngine, CudaDeviceFailsCleanlyOrRoundTrips) {
  if (!cuda_compiled()) {
    EXPECT_THROW(TransferEngine(Device::Cuda, {}), Error);
    return;
  }
  if (cuda_devices().empty()) {
    // No device for its CUDA streams: an Error at construction, not a crash in a copy.
    EXPECT_THROW(TransferEngine(Device::Cuda, {}), Error);
    return;
  }
  TransferEngine engine(Device::Cuda, {});
  const std::vector<uint8_t> src = random_bytes(1 << 20, 7);
  std::vector<uint8_t> back(src.size(), 0);
  void* device_buffer = device_alloc(Device::Cuda, src.size());
  const size_t half = src.size() / 2;
  // Two chunks each way, crossing halves, so chunk offsets are exercised on a real device.
  EventPtr loaded = engine.load({{static_cast<uint8_t*>(device_buffer) + half, src.data(), half},
                                 {device_buffer, src.data() + half, src.size() - half}});
  engine.store({{back.data() + half, device_buffer, src.size() - half},
                {back.data(), static_cast<uint8_t*>(device_buffer) + half, half}},
               loaded);
  engine.synchronize();
  device_free(Device::Cuda, device_buffer);
  EXPECT_EQ(back, src);
}

// Restores the poison flag whatever the test does.
class PoisonGuard {
 public:
  explicit PoisonGuard(bool enabled) : saved_(debug_poison()) { set_debug_poison(enabled); }
  ~PoisonGuard() { set_debug_poison(saved_); }

 private:
  bool saved_;
};

template <typename T>
std::vector<T> bit_patterns(const Tensor& t) {
  std::vector<T> bits(static_cast<size_t>(t.numel()));
  std::memcpy(bits.data(), t.raw(), t.nbytes());
  return bits;
}

TEST(DebugPoison, EmptyTensorsAreNanWhenOn) {
  PoisonGuard guard(true);
  EXPECT_TRUE(debug_poison());
  const Tensor f32 = Tensor::empty({33, 7}, DType::F32);
  for (float v : f32.to_floats()) ASSERT_TRUE(std::isnan(v));
  for (uint32_t bits : bit_patterns<uint32_t>(f32)) ASSERT_EQ(bits, 0x7fc00000u);
  const Tensor f16 = Tensor::empty({1001}, DType::F16);
  for (float v : f16.to_floats()) ASSERT_TRUE(std::isnan(v));
  for (uint16_t bits : bit_patterns<uint16_t>(f16)) ASSERT_EQ(bits, 0x7e00u);
  const Tensor bf16 = Tensor::empty({5, 5}, DType::BF16);
  for (uint16_t bits : bit_patterns<uint16_t>(bf16)) ASSERT_EQ(bits, 0x7fc0u);
  // Integer tensors are not poisoned (there is no NaN), and allocating them must still work.
  EXPECT_NO_THROW(Tensor::empty({4}, DType::I32));
  // zeros() is still zeros.
  for (float v : Tensor::zeros({16}, DType::F32).to_floats()) ASSERT_EQ(v, 0.0f);
}

TEST(DebugPoison, SetDebugPoisonTurnsItOff) {
  PoisonGuard guard(false);
  EXPECT_FALSE(debug_poison());
  set_debug_poison(true);
  EXPECT_TRUE(debug_poison());
  set_debug_poison(false);
  EXPECT_FALSE(debug_poison());
}

TEST(DebugPoison, FillNanCoversEveryFloatTypeAndRejectsIntegers) {
  Tensor bf16 = Tensor::zeros({3, 4}, DType::BF16);
  fill_nan(bf16);
  for (uint16_t bits : bit_patterns<uint16_t>(bf16)) ASSERT_EQ(bits, 0x7fc0u);
  for (float v : bf16.to_floats()) ASSERT_TRUE(std::isnan(v));
  Tensor f32 = Tensor::zeros({10}, DType::F32);
  fill_nan(f32);
  for (float v : f32.to_floats()) ASSERT_TRUE(std::isnan(v));
  Tensor f16 = Tensor::zeros({10}, DType::F16);
  fill_nan(f16);
  for (float v : f16.to_floats()) ASSERT_TRUE(std::isnan(v));
  // A view fills only its own rows.
  Tensor rows = Tensor::zeros({4, 2}, DType::F32);
  Tensor middle = rows.slice_rows(1, 3);
  fill_nan(middle);
  const std::vector<float> values = rows.to_floats();
  EXPECT_EQ(values[1], 0.0f);
  EXPECT_TRUE(std::isnan(values[2]) && std::isnan(values[5]));
  EXPECT_EQ(values[6], 0.0f);

  Tensor i32 = Tensor::zeros({4}, DType::I32);
  EXPECT_THROW(fill_nan(i32), Error);
  Tensor i64 = Tensor::zeros({4}, DType::I64);
  EXPECT_THROW(fill_nan(i64), Error);
}

TEST(PinnedMemory, IsAlignedWritableAndFreed) {
  for (size_t bytes : {size_t{0}, size_t{1}, size_t{63}, size_t{1} << 20}) {
    void* p = pinned_alloc(bytes, "a test buffer");
    ASSERT_NE(p, nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p) % 64, 0u) << bytes << " bytes";
    std::memset(p, 0x5a, bytes);
    pinned_free(p);
  }
  pinned_free(nullptr);
}

TEST(PinnedMemory, ImpossibleSizeThrowsNamingIt) {
  const size_t huge = std::numeric_limits<size_t>::max() - 1;
  try {
    pinned_alloc(huge, "a test buffer");
    ADD_FAILURE() << "pinned_alloc of an impossible size returned";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(std::to_string(huge)), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace infinigen
