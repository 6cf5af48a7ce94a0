// tests: measuring the CPU backend's hardware profile (quick effort): every constant is
// positive and sourced, the linear table is well formed, the profile survives a write and a
// load, and the cost model predicts with it.
#include "predict/profile_measurement.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "core/model_config.h"
#include "predict/cost_model.h"
#include "predict/hardware_profile.h"
#include "tests/test_util.h"

namespace infinigen {
namespace {

TEST(ProfileMeasurement, AQuickMeasurementIsAProfileTheCostModelCanUse) {
  std::vector<std::string> lines;
  const HardwareProfile p = measure_cpu_backend_profile(
      [&](const std::string& line) { lines.push_back(line); }, ProfileEffort::Quick);
  EXPECT_GT(lines.size(), 10u);  // progress on the long work
  EXPECT_EQ(p.name, "cpu-backend");
  EXPECT_EQ(p.backend, "cpu");
  for (double rate :
       {p.gemm_flops, p.device_memory_bytes_per_s, p.attention_flops, p.attention_bytes_per_s,
        p.elementwise_bytes_per_s, p.kv_codec_bytes_per_s, p.speculation_bytes_per_s,
        p.speculation_flops, p.scoring_flops, p.host_copy_bytes_per_s, p.host_row_copy_bytes_per_s,
        p.host_gather_bytes_per_s}) {
    EXPECT_TRUE(std::isfinite(rate) && rate > 0) << rate;
  }
  EXPECT_GE(p.compute_slowdown_under_copy, 1);
  EXPECT_GE(p.copy_slowdown_under_compute, 1);
  EXPECT_TRUE(std::isinf(p.h2d_bytes_per_s));  // the link is the run's emulation, set later
  ASSERT_FALSE(p.linear_table.empty());
  check_linear_cost_table(p.linear_table, "measured");
  EXPECT_TRUE(p.sources.contains("linear_table"));

  // Written and loaded back, it is a valid profile file with a source for every constant.
  testing_util::TempDir dir("profile-measurement");
  const std::string path = (dir.path() / "cpu.yaml").string();
  write_hardware_profile(p, path);
  const HardwareProfile loaded = load_hardware_profile(path);
  EXPECT_EQ(loaded.linear_table.rows, p.linear_table.rows);
  for (const char* key : {"gemm_flops", "attention_bytes_per_s", "host_row_copy_bytes_per_s",
                          "compute_slowdown_under_copy", "link_emulation_overhead_s"}) {
    EXPECT_TRUE(loaded.sources.contains(key)) << key;
  }

  // The cost model predicts a small offloaded run with it.
  const CostModelInput in =
      testing_util::preset_request<CostModelInput>("opt-tiny", 2, 16, 4, "full");
  const PredictedRun run = predict_run(in, with_link(loaded, 12.0, 0.0));
  ASSERT_TRUE(run.fits) << run.does_not_fit;
  EXPECT_GT(run.decode_s, 0);
  EXPECT_GT(run.throughput_tok_s, 0);
}

}  // namespace
}  // namespace infinigen
