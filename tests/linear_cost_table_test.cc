// tests: the linear cost table's lookup (exact at measured cells, interpolated between them,
// clamped in K, priced by FLOPs beyond the last row count) and the cost model's use of it.
#include "predict/linear_cost_table.h"

#include <gtest/gtest.h>

#include <cmath>

#include "predict/cost_model.h"
#include "predict/hardware_profile.h"
#include "predict/op_costs.h"
#include "predict/simulator.h"
#include "tests/test_util.h"

namespace infinigen {
namespace {

using testing_util::expect_error;

// Rows {1, 4, 8} x K {512, 2048}; every cell distinct, the cache grid twice as fast.
LinearCostTable small_table() {
  LinearCostTable t;
  t.rows = {1, 4, 8};
  t.k = {512, 2048};
  t.memory.fixed_s = {{1e-6, 2e-6, 3e-6}, {4e-6, 5e-6, 6e-6}};
  t.memory.bytes_per_s = {{10e9, 20e9, 8e9}, {5e9, 10e9, 4e9}};
  t.cache.fixed_s = t.memory.fixed_s;
  t.cache.bytes_per_s = {{20e9, 40e9, 16e9}, {10e9, 20e9, 8e9}};
  check_linear_cost_table(t, "test");
  return t;
}

constexpr double kFlops = 1e11;
constexpr double kBytes = 1 << 20;

TEST(LinearCostTable, AMeasuredCellIsItsFixedTimePlusBytesOverRate) {
  const LinearCostTable t = small_table();
  EXPECT_DOUBLE_EQ(t.seconds(4, 1024, 512, kBytes, false, kFlops), 2e-6 + kBytes / 20e9);
  EXPECT_DOUBLE_EQ(t.seconds(8, 1024, 2048, kBytes, false, kFlops), 6e-6 + kBytes / 4e9);
  EXPECT_DOUBLE_EQ(t.seconds(4, 1024, 512, kBytes, true, kFlops), 2e-6 + kBytes / 40e9);
  // A faster cell at more rows (4 rows beat 1 here) is taken as measured, not smoothed away.
  EXPECT_LT(t.seconds(4, 1024, 512, kBytes, false, kFlops),
            t.seconds(1, 1024, 512, kBytes, false, kFlops));
}

TEST(LinearCostTable, BetweenCellsItInterpolatesTimePerByte) {
  const LinearCostTable t = small_table();
  // 6 rows: halfway between 4 and 8, in fixed time and in seconds per byte.
  EXPECT_DOUBLE_EQ(t.seconds(6, 1024, 512, kBytes, false, kFlops),
                   2.5e-6 + kBytes * 0.5 * (1 / 20e9 + 1 / 8e9));
  // K 1024: halfway between 512 and 2048 in log K.
  EXPECT_DOUBLE_EQ(t.seconds(1, 1024, 1024, kBytes, false, kFlops),
                   2.5e-6 + kBytes * 0.5 * (1 / 10e9 + 1 / 5e9));
}

TEST(LinearCostTable, KIsClampedAndRowsBeyondTheTableCostTheirFlops) {
  const LinearCostTable t = small_table();
  EXPECT_DOUBLE_EQ(t.seconds(4, 1024, 64, kBytes, false, kFlops),
                   t.seconds(4, 1024, 512, kBytes, false, kFlops));
  EXPECT_DOUBLE_EQ(t.seconds(4, 1024, 8192, kBytes, false, kFlops),
                   t.seconds(4, 1024, 2048, kBytes, false, kFlops));
  const double at_last = t.seconds(8, 1024, 2048, kBytes, false, kFlops);
  EXPECT_DOUBLE_EQ(t.seconds(108, 1024, 2048, kBytes, false, kFlops),
                   at_last + 100 * 2.0 * 1024 * 2048 / kFlops);
}

TEST(LinearCostTable, ABadTableIsOneLineNamingTheField) {
  LinearCostTable t = small_table();
  t.cache.bytes_per_s[1][2] = 0;
  expect_error([&] { check_linear_cost_table(t, "p.yaml"); },
               {"p.yaml", "'linear_table.cache.bytes_per_s'", "> 0"});
  t = small_table();
  t.memory.fixed_s.pop_back();
  expect_error([&] { check_linear_cost_table(t, "p.yaml"); },
               {"p.yaml", "'linear_table.memory.fixed_s'", "2 lists", "3 numbers"});
  t = small_table();
  t.k = {2048, 512};
  expect_error([&] { check_linear_cost_table(t, "p.yaml"); },
               {"p.yaml", "'linear_table.k'", "increasing"});
  t.k.clear();
  expect_error([&] { check_linear_cost_table(t, "p.yaml"); }, {"'linear_table.k'", "empty"});
}

TEST(LinearCostTable, TheCostModelPricesLinearLayersFromTheTable) {
  HardwareProfile p = load_hardware_profile("cpu-backend");
  p.linear_table = small_table();
  ScheduledOp op;
  op.op_class = OpClass::Gemm;
  op.rows = 6;
  op.out_features = 768;
  op.in_features = 1024;
  op.weight_bytes = 768.0 * 1024 * 2;
  op.flops = linear_flops(6, 768, 1024);
  op.device_bytes = linear_bytes(6, 768, 1024, 2);
  for (bool cached : {false, true}) {
    EXPECT_DOUBLE_EQ(op_seconds(op, p, cached),
                     p.linear_table.seconds(6, 768, 1024, op.weight_bytes, cached, p.gemm_flops));
  }
  // Without a table (the GPU profiles) the roofline prices it.
  p.linear_table = {};
  EXPECT_DOUBLE_EQ(op_seconds(op, p),
                   p.op_overhead_s + std::max(op.flops / p.gemm_flops,
                                              op.device_bytes / p.device_memory_bytes_per_s));
}

}  // namespace
}  // namespace infinigen
