// tests: the paged KV pool: scatter/gather round trips, chunk counts, row addresses, errors.
#include "offload/kv_pool.h"

#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "core/error.h"
#include "offload/runtime.h"
#include "tests/test_util.h"

namespace infinigen {
namespace {

void run(const std::vector<CopyChunk>& chunks) {
  for (const CopyChunk& chunk : chunks) std::memcpy(chunk.dst, chunk.src, chunk.bytes);
}

// Blocks of bt tokens that [t0, t0 + n) touches.
int64_t blocks_touched(int64_t t0, int64_t n, int64_t bt) {
  return n == 0 ? 0 : (t0 + n - 1) / bt - t0 / bt + 1;
}

// A distinct 16-bit pattern per (layer, kind, b, h, t, i) so misplaced rows show up.
uint16_t pattern(int64_t layer, KvKind kind, int64_t b, int64_t h, int64_t t, int64_t i) {
  return static_cast<uint16_t>((((layer * 2 + static_cast<int64_t>(kind)) * 7 + b) * 5 + h) * 977 +
                               t * 13 + i);
}

// A source buffer (B, H, capacity, d) of f16 bits whose rows [row0, row0 + n) hold tokens
// [t0, t0 + n) of (layer, kind).
// Other rows hold `fill`.
std::vector<uint16_t> make_source(const KvPoolShape& s, int64_t layer, KvKind kind,
                                  int64_t capacity, int64_t row0, int64_t t0, int64_t n,
                                  uint16_t fill = 0xFFFF) {
  std::vector<uint16_t> src(static_cast<size_t>(s.batch * s.num_heads * capacity * s.head_dim),
                            fill);
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.num_heads; ++h) {
      for (int64_t j = 0; j < n; ++j) {
        for (int64_t i = 0; i < s.head_dim; ++i) {
          src[static_cast<size_t>(((b * s.num_heads + h) * capacity + row0 + j) * s.head_dim + i)] =
              pattern(layer, kind, b, h, t0 + j, i);
        }
      }
    }
  }
  return src;
}

void store(KvPool& pool, int64_t layer, KvKind kind, int64_t t0, int64_t n) {
  const KvPoolShape& s = pool.shape();
  // Rows start at 3 inside a larger buffer, as a device staging buffer would hold them.
  const int64_t capacity = n + 5, row0 = 3;
  const std::vector<uint16_t> src = make_source(s, layer, kind, capacity, row0, t0, n);
  std::vector<CopyChunk> chunks;
  pool.scatter_chunks(layer, kind, src.data(), capacity, row0, t0, n, &chunks);
  EXPECT_EQ(static_cast<int64_t>(chunks.size()),
            s.batch * s.num_heads * blocks_touched(t0, n, s.block_tokens));
  run(chunks);
}

class KvPoolRoundTrip : public ::testing::TestWithParam<int64_t> {};

TEST_P(KvPoolRoundTrip, ScatterThenGatherReturnsTheSameBytes) {
  // {L, B, H, d, max_tokens, block_tokens[, dtype]}: KvPoolShape's fields, in every test here.
  const KvPoolShape s{3, 2, 3, 8, 150, GetParam()};
  KvPool pool(s);
  EXPECT_EQ(pool.num_blocks(), 0);
  EXPECT_EQ(pool.allocated_bytes(), 0u);

  // A prompt of 100 tokens, then 20 decoded one at a time, into every layer and both kinds.
  for (int64_t layer = 0; layer < s.num_layers; ++layer) {
    for (KvKind kind : {KvKind::Key, KvKind::Value}) {
      store(pool, layer, kind, 0, 100);
      for (int64_t t = 100; t < 120; ++t) store(pool, layer, kind, t, 1);
    }
  }
  const int64_t bt = s.block_tokens;
  EXPECT_EQ(pool.num_blocks(), (120 + bt - 1) / bt);
  EXPECT_EQ(pool.allocated_bytes(), static_cast<size_t>(pool.num_blocks() * 2 * s.num_layers *
                                                        s.batch * s.num_heads * bt * s.head_dim) *
                                        2);

  // Ranges that start and end inside blocks, on block edges, and hold a single token.
  const std::vector<std::pair<int64_t, int64_t>> ranges = {
      {0, 120}, {5, 107}, {63, 65}, {64, 120}, {119, 120}, {7, 14}, {30, 30}};
  for (const auto& [t0, t1] : ranges) {
    for (int64_t layer = 0; layer < s.num_layers; ++layer) {
      for (KvKind kind : {KvKind::Key, KvKind::Value}) {
        const int64_t capacity = t1 - t0 + 9, row0 = 4;
        std::vector<uint16_t> dst(
            static_cast<size_t>(s.batch * s.num_heads * capacity * s.head_dim), 0xABCD);
        std::vector<CopyChunk> chunks;
        pool.gather_chunks(layer, kind, t0, t1, dst.data(), capacity, row0, &chunks);
        ASSERT_EQ(static_cast<int64_t>(chunks.size()),
                  s.batch * s.num_heads * blocks_touched(t0, t1 - t0, bt))
            << "range [" << t0 << ", " << t1 << ")";
        run(chunks);
        // Rows outside [row0, row0 + n) are untouched by the gather.
        const std::vector<uint16_t> want =
            make_source(s, layer, kind, capacity, row0, t0, t1 - t0, 0xABCD);
        ASSERT_EQ(dst, want) << "layer " << layer << " range [" << t0 << ", " << t1 << ")";

        // row() points at the same bytes the gather copied.
        for (int64_t b = 0; b < s.batch; ++b) {
          for (int64_t h = 0; h < s.num_heads; ++h) {
            for (int64_t t = t0; t < t1; ++t) {
              const uint16_t* got = &dst[static_cast<size_t>(
                  ((b * s.num_heads + h) * capacity + row0 + t - t0) * s.head_dim)];
              ASSERT_EQ(std::memcmp(pool.row(layer, kind, b, h, t), got,
                                    static_cast<size_t>(s.head_dim) * 2),
                        0);
            }
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(BlockSizes, KvPoolRoundTrip, ::testing::Values(1, 7, 64));

TEST(KvPool, ChunksAreContiguousRunsInsideBlocks) {
  const KvPoolShape s{1, 2, 2, 4, 40, 8, DType::F32};
  KvPool pool(s);
  pool.reserve(40);
  std::vector<float> dst(static_cast<size_t>(2 * 2 * 30 * 4));
  std::vector<CopyChunk> chunks;
  pool.gather_chunks(0, KvKind::Value, 5, 27, dst.data(), 30, 0, &chunks);
  // Blocks touched: [5, 8), [8, 16), [16, 24), [24, 27) for each of the 4 (sequence, head).
  ASSERT_EQ(chunks.size(), 16u);
  const size_t row_bytes = 4 * sizeof(float);
  const size_t runs[] = {3, 8, 8, 3};
  for (size_t i = 0; i < chunks.size(); ++i) {
    const int64_t bh = static_cast<int64_t>(i / 4);
    EXPECT_EQ(chunks[i].bytes, runs[i % 4] * row_bytes);
    const int64_t t = i % 4 == 0 ? 5 : static_cast<int64_t>(8 * (i % 4));
    EXPECT_EQ(chunks[i].src, pool.row(0, KvKind::Value, bh / 2, bh % 2, t));
    EXPECT_EQ(chunks[i].dst, &dst[static_cast<size_t>((bh * 30 + t - 5) * 4)]);
  }
  // Chunks are appended, so K and V of a layer can form one transfer.
  pool.gather_chunks(0, KvKind::Key, 0, 8, dst.data(), 30, 0, &chunks);
  EXPECT_EQ(chunks.size(), 20u);
  // K and V, and different layers, live in different memory.
  EXPECT_NE(pool.row(0, KvKind::Key, 0, 0, 0), pool.row(0, KvKind::Value, 0, 0, 0));
}

TEST(KvPool, CapacityBytesRoundsUpToWholeBlocks) {
  KvPoolShape s{3, 2, 4, 8, 100, 64};
  // 2 (K, V) * L * B * H * 128 tokens * d * 2 bytes.
  EXPECT_EQ(KvPool::capacity_bytes(s), 2u * 3 * 2 * 4 * 128 * 8 * 2);
  s.block_tokens = 1;
  EXPECT_EQ(KvPool::capacity_bytes(s), 2u * 3 * 2 * 4 * 100 * 8 * 2);
  s.block_tokens = 7;  // 15 blocks = 105 tokens
  s.dtype = DType::F32;
  EXPECT_EQ(KvPool::capacity_bytes(s), 2u * 3 * 2 * 4 * 105 * 8 * 4);

  KvPool pool(s);
  pool.reserve(s.max_tokens);
  EXPECT_EQ(pool.allocated_bytes(), KvPool::capacity_bytes(s));
  pool.reserve(10);  // never shrinks
  EXPECT_EQ(pool.num_blocks(), 15);
}

TEST(KvPool, BadRangesThrowOneLineErrors) {
  const KvPoolShape s{2, 1, 2, 4, 20, 8};
  KvPool pool(s);
  std::vector<uint16_t> buffer(2 * 32 * 4);
  std::vector<CopyChunk> chunks;
  const auto expect_error = [](const std::function<void()>& call, const std::string& needle) {
    testing_util::expect_error(call, {needle});
  };

  expect_error([&] { pool.reserve(21); }, "max_tokens 20");
  expect_error([&] { pool.scatter_chunks(0, KvKind::Key, buffer.data(), 32, 0, 15, 6, &chunks); },
               "beyond max_tokens 20");
  expect_error([&] { pool.scatter_chunks(2, KvKind::Key, buffer.data(), 32, 0, 0, 4, &chunks); },
               "layer 2 out of range");
  expect_error([&] { pool.scatter_chunks(-1, KvKind::Key, buffer.data(), 32, 0, 0, 4, &chunks); },
               "layer -1 out of range");
  expect_error([&] { pool.scatter_chunks(0, KvKind::Key, buffer.data(), 10, 8, 0, 4, &chunks); },
               "source capacity 10");
  expect_error([&] { pool.scatter_chunks(0, KvKind::Key, buffer.data(), 32, 0, 0, -1, &chunks); },
               "invalid K store");
  EXPECT_TRUE(chunks.empty());
  EXPECT_EQ(pool.num_blocks(), 0);  // failed stores reserve nothing

  pool.scatter_chunks(1, KvKind::Value, buffer.data(), 32, 0, 0, 12, &chunks);
  EXPECT_EQ(pool.num_blocks(), 2);
  chunks.clear();
  expect_error([&] { pool.gather_chunks(0, KvKind::Key, 5, 3, buffer.data(), 32, 0, &chunks); },
               "invalid K token range [5, 3)");
  expect_error([&] { pool.gather_chunks(0, KvKind::Key, 0, 21, buffer.data(), 32, 0, &chunks); },
               "beyond max_tokens 20");
  expect_error([&] { pool.gather_chunks(0, KvKind::Key, 0, 17, buffer.data(), 32, 0, &chunks); },
               "beyond the 16 reserved tokens");
  expect_error([&] { pool.gather_chunks(5, KvKind::Value, 0, 4, buffer.data(), 32, 0, &chunks); },
               "layer 5 out of range");
  expect_error([&] { pool.gather_chunks(0, KvKind::Value, 0, 12, buffer.data(), 14, 3, &chunks); },
               "destination capacity 14");
  expect_error([&] { pool.row(0, KvKind::Key, 0, 0, 16); }, "token 16 is not reserved");
  expect_error([&] { pool.row(0, KvKind::Key, 1, 0, 0); }, "sequence 1 head 0 out of range");
  EXPECT_TRUE(chunks.empty());

  KvPoolShape bad = s;
  bad.block_tokens = 0;
  expect_error([&] { KvPool pool2(bad); }, "invalid shape");
}

// Sequences 0 and 2 share an 8-token prefix, 1 and 3 a 4-token one (rows [4, 8)), 4 nothing.
SharedPrefixes two_groups() {
  return SharedPrefixes({0, 1, 0, 1, -1}, {8, 4});
}

TEST(KvPool, SharedPrefixesAreKeptOncePerGroupWithReferenceCounts) {
  const KvPoolShape shape{2, 5, 2, 4, 16, 4, DType::F16};  // L 2, B 5, H 2, d 4, 16 tokens, bt 4
  KvPool pool(shape);
  pool.share(two_groups());
  // Per layer and K/V: group 0's 2 blocks and group 1's 1, of (H, bt, d) f16; padding: nothing.
  const size_t block = 2 * 4 * 4 * 2;
  EXPECT_EQ(pool.allocated_bytes(), 2 * 2 * 3 * block);
  EXPECT_EQ(pool.references(1, KvKind::Value, 2, 5), 2);
  EXPECT_EQ(pool.references(1, KvKind::Value, 3, 5), 2);
  EXPECT_EQ(pool.references(1, KvKind::Value, 1, 2), 0);  // before group 1's prefix: padding
  EXPECT_EQ(pool.references(1, KvKind::Value, 4, 5), 0);
  EXPECT_EQ(pool.row(1, KvKind::Value, 2, 1, 5), pool.row(1, KvKind::Value, 0, 1, 5));
  EXPECT_EQ(pool.row(1, KvKind::Value, 3, 1, 5), pool.row(1, KvKind::Value, 1, 1, 5));
  EXPECT_NE(pool.row(1, KvKind::Value, 1, 1, 5), pool.row(1, KvKind::Value, 0, 1, 5));
  testing_util::expect_error([&] { pool.row(1, KvKind::Value, 4, 0, 5); }, {"padding"});

  // The prefixes go in once, each from its leader's rows of a (B, H, 8, d) source.
  const std::vector<uint16_t> src = make_source(shape, 1, KvKind::Value, 8, 0, 0, 8);
  std::vector<CopyChunk> chunks;
  pool.scatter_shared_chunks(1, KvKind::Value, src.data(), 8, 0, 8, &chunks);
  EXPECT_EQ(chunks.size(), static_cast<size_t>((2 + 1) * 2));  // blocks x heads
  run(chunks);
  const auto value = [&](int64_t b, int64_t h, int64_t t) {
    return *static_cast<const uint16_t*>(pool.row(1, KvKind::Value, b, h, t));
  };
  EXPECT_EQ(value(2, 1, 5), pattern(1, KvKind::Value, 0, 1, 5, 0));
  EXPECT_EQ(value(3, 1, 5), pattern(1, KvKind::Value, 1, 1, 5, 0));

  // A gather brings each shared block once, into its leader's rows; padding blocks not at all.
  pool.reserve(12);
  EXPECT_EQ(pool.references(1, KvKind::Value, 4, 9), 1);
  chunks.clear();
  std::vector<uint16_t> staging(static_cast<size_t>(5 * 2 * 12 * 4), 0xFFFF);  // (B, H, 12, d)
  pool.gather_chunks(1, KvKind::Value, 0, 12, staging.data(), 12, 0, &chunks);
  EXPECT_EQ(chunks.size(), static_cast<size_t>((2 + 1) * 2 + 5 * 2));  // shared; then B x H own
  run(chunks);
  EXPECT_EQ(staging[static_cast<size_t>(((1 * 2 + 1) * 12 + 5) * 4)], value(1, 1, 5));
  EXPECT_EQ(staging[static_cast<size_t>(((3 * 2 + 1) * 12 + 5) * 4)], 0xFFFF);  // not a leader

  // A write of the batch's rows into block 1 gives each writer a private copy: every sequence
  // keeps its prefix, the shared blocks no table refers to any more are freed, and layer 0 and
  // block 0 stay shared.
  const size_t before = pool.allocated_bytes();
  std::vector<uint16_t> rows(static_cast<size_t>(shape.batch * shape.num_heads * shape.head_dim),
                             0xABCD);
  chunks.clear();
  pool.scatter_chunks(1, KvKind::Value, rows.data(), 1, 0, 6, 1, &chunks);
  run(chunks);
  EXPECT_EQ(pool.allocated_bytes(), before + (5 - 2) * block);
  for (int64_t b = 0; b < shape.batch; ++b) {
    EXPECT_EQ(pool.references(1, KvKind::Value, b, 6), 1);
    EXPECT_EQ(value(b, 1, 6), 0xABCD);
  }
  EXPECT_EQ(value(2, 1, 5), pattern(1, KvKind::Value, 0, 1, 5, 0));
  EXPECT_EQ(value(3, 1, 5), pattern(1, KvKind::Value, 1, 1, 5, 0));
  EXPECT_EQ(pool.references(1, KvKind::Value, 2, 1), 2);
  EXPECT_EQ(pool.row(0, KvKind::Value, 2, 1, 5), pool.row(0, KvKind::Value, 0, 1, 5));
}

TEST(KvPool, AWriteIntoASharedBlockCopiesItForAllButItsLastMember) {
  const KvPoolShape shape{1, 3, 1, 4, 16, 4, DType::F16};
  KvPool pool(shape);
  pool.share(SharedPrefixes({0, 0, 0}, {4}));
  const size_t block = 1 * 4 * 4 * 2;
  const void* shared = pool.row(0, KvKind::Key, 0, 0, 0);
  const std::vector<uint16_t> src = make_source(shape, 0, KvKind::Key, 4, 0, 0, 4);
  std::vector<CopyChunk> chunks;
  pool.scatter_shared_chunks(0, KvKind::Key, src.data(), 4, 0, 4, &chunks);
  run(chunks);
  std::vector<uint16_t> rows(static_cast<size_t>(3 * 4));
  for (int64_t b = 0; b < 3; ++b) rows[static_cast<size_t>(b * 4)] = static_cast<uint16_t>(b + 1);
  chunks.clear();
  pool.scatter_chunks(0, KvKind::Key, rows.data(), 1, 0, 2, 1, &chunks);
  run(chunks);
  // Sequences 0 and 1 took copies; sequence 2, the last to refer to it, kept the block (and the
  // values' block is still shared).
  EXPECT_EQ(pool.allocated_bytes(), (3 + 1) * block);
  EXPECT_EQ(pool.row(0, KvKind::Key, 2, 0, 0), shared);
  std::vector<uint16_t> staging(static_cast<size_t>(3 * 4 * 4), 0xFFFF);  // (B, H, 4, d)
  chunks.clear();
  pool.gather_chunks(0, KvKind::Key, 0, 4, staging.data(), 4, 0, &chunks);
  EXPECT_EQ(chunks.size(), 3u);  // one private block each now
  run(chunks);
  for (int64_t b = 0; b < 3; ++b) {
    EXPECT_EQ(pool.references(0, KvKind::Key, b, 0), 1);
    EXPECT_EQ(staging[static_cast<size_t>((b * 4 + 2) * 4)], b + 1);
    EXPECT_EQ(staging[static_cast<size_t>((b * 4 + 3) * 4)], pattern(0, KvKind::Key, 0, 0, 3, 0));
  }
}

TEST(KvPool, SharedPrefixesNeedWholeBlocksOfAnEmptyPool) {
  const KvPoolShape shape{1, 2, 1, 4, 16, 4, DType::F16};
  KvPool pool(shape);
  testing_util::expect_error(
      [&] {
        pool.share(SharedPrefixes({0, 0}, {6}));
      },
      {"not whole blocks"});
  pool.reserve(4);
  testing_util::expect_error([&] { pool.share(SharedPrefixes({0, 0}, {4})); }, {"empty pool"});
}

// --kv-pool-limit: the run's statistics hold the cap, the bytes of the pool that holds it and the
// tokens its rows dropped.
class KvPoolLimitRun : public testing_util::SmallRunTest {};

TEST_F(KvPoolLimitRun, TheCapAndItsEvictionsAreRecorded) {
  OffloadOptions options;
  options.policy = "infinigen";
  const OffloadRun whole = run_offloaded(source_, request_, options, Device::Cpu);
  options.kv_pool_limit = 0.5;  // 9 of the 18 positions: the prompt alone overflows it
  const OffloadRun capped = run_offloaded(source_, request_, options, Device::Cpu);
  const uint64_t capped_bytes = capped.stats.steps().back().host_kv_bytes;
  const PoolCapStats& cap = capped.stats.pool_cap();
  EXPECT_EQ(cap.positions, 9);
  EXPECT_EQ(cap.bytes, capped_bytes);
  const uint64_t L = source_.config.num_layers, H = source_.config.kv_heads();
  const uint64_t B = request_.prompts.size();
  const uint64_t steps = capped.stats.steps().size() - 1;
  // Every decode step stores its token over a kept one in every row; each row kept 9 of its 12
  // prompt tokens.
  EXPECT_EQ(cap.evictions, L * B * H * steps) << cap.describe();
  EXPECT_EQ(cap.prompt_not_kept, L * B * H * 3) << cap.describe();
  EXPECT_NE(cap.describe().find("9 positions per sequence and head"), std::string::npos)
      << cap.describe();
  EXPECT_EQ(whole.stats.pool_cap().positions, 0);
}

}  // namespace
}  // namespace infinigen
