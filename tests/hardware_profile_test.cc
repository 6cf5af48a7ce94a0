// tests: hardware profiles: every bundled one loads with a source per constant, files round-trip,
// and each bad input is one line naming the file and the field.
#include "predict/hardware_profile.h"

#include <gtest/gtest.h>

#include <cmath>
#include <fstream>

#include "tests/test_util.h"

namespace infinigen {
namespace {

using testing_util::expect_error;
using testing_util::TempDir;

constexpr const char* kNumericKeys[] = {"device_memory_bytes",
                                        "gemm_flops",
                                        "device_memory_bytes_per_s",
                                        "device_cache_bytes",
                                        "attention_flops",
                                        "attention_bytes_per_s",
                                        "elementwise_bytes_per_s",
                                        "kv_codec_bytes_per_s",
                                        "speculation_bytes_per_s",
                                        "speculation_flops",
                                        "scoring_flops",
                                        "op_overhead_s",
                                        "h2d_bytes_per_s",
                                        "d2h_bytes_per_s",
                                        "transfer_latency_s",
                                        "link_emulation_overhead_s",
                                        "host_copy_bytes_per_s",
                                        "host_row_copy_bytes_per_s",
                                        "host_gather_bytes_per_s",
                                        "compute_slowdown_under_copy",
                                        "copy_slowdown_under_compute"};

class HardwareProfileFile : public ::testing::Test {
 protected:
  // A valid profile's text with `key`'s line replaced by `line` (removed when empty).
  std::string variant(const std::string& key, const std::string& line) const {
    const std::string text = hardware_profile_yaml(load_hardware_profile("rtx-a6000-pcie3"));
    std::string out;
    size_t start = 0;
    while (start < text.size()) {
      const size_t end = text.find('\n', start);
      const std::string current = text.substr(start, end - start);
      if (current.starts_with(key + ":")) {
        if (!line.empty()) out += line + "\n";
      } else {
        out += current + "\n";
      }
      start = end + 1;
    }
    return out;
  }
  std::string write(const std::string& text) const {
    const std::string path = (dir_.path() / "profile.yaml").string();
    std::ofstream(path) << text;
    return path;
  }
  TempDir dir_{"hardware-profile"};
};

TEST(HardwareProfile, EveryBundledProfileLoadsWithASourcePerConstant) {
  const std::vector<std::string> names = hardware_profile_names();
  for (const char* expected : {"rtx-a6000-pcie3", "a100-pcie4", "h100-pcie5", "cpu-backend"}) {
    EXPECT_NE(std::find(names.begin(), names.end(), expected), names.end()) << expected;
  }
  for (const std::string& name : names) {
    const HardwareProfile p = load_hardware_profile(name);
    EXPECT_EQ(p.name, name);
    EXPECT_FALSE(p.description.empty()) << name;
    EXPECT_GT(p.gemm_flops, 0) << name;
    EXPECT_GE(p.compute_slowdown_under_copy, 1) << name;
    for (const char* key : kNumericKeys) {
      EXPECT_TRUE(p.sources.contains(key) && !p.sources.at(key).empty())
          << name << " has no source for " << key;
    }
  }
  EXPECT_EQ(load_hardware_profile("rtx-a6000-pcie3").backend, "cuda");
  const HardwareProfile cpu = load_hardware_profile("cpu-backend");
  EXPECT_EQ(cpu.backend, "cpu");
  // The CPU backend's linear layers come from its measured table, with its source.
  EXPECT_FALSE(cpu.linear_table.empty());
  EXPECT_TRUE(cpu.sources.contains("linear_table"));
  EXPECT_TRUE(load_hardware_profile("a100-pcie4").linear_table.empty());
  EXPECT_DOUBLE_EQ(load_hardware_profile("rtx-a6000-pcie3").h2d_bytes_per_s, 12e9);
  EXPECT_DOUBLE_EQ(load_hardware_profile("a100-pcie4").h2d_bytes_per_s, 25e9);
  EXPECT_DOUBLE_EQ(load_hardware_profile("h100-pcie5").h2d_bytes_per_s, 50e9);
}

TEST_F(HardwareProfileFile, WrittenProfilesLoadBackUnchanged) {
  HardwareProfile p = load_hardware_profile("a100-pcie4");
  p.name = "copy";
  p.description = "with \"quotes\" and: colons";
  const std::string path = (dir_.path() / "copy.yaml").string();
  write_hardware_profile(p, path);
  const HardwareProfile q = load_hardware_profile(path);
  EXPECT_EQ(q.name, p.name);
  EXPECT_EQ(q.description, p.description);
  EXPECT_EQ(q.backend, p.backend);
  EXPECT_EQ(q.sources, p.sources);
  EXPECT_NEAR(q.gemm_flops, p.gemm_flops, 1e-5 * p.gemm_flops);
  EXPECT_NEAR(q.transfer_latency_s, p.transfer_latency_s, 1e-5 * p.transfer_latency_s);
}

TEST_F(HardwareProfileFile, ALinearTableRoundTrips) {
  const HardwareProfile p = load_hardware_profile("cpu-backend");
  const std::string path = (dir_.path() / "cpu.yaml").string();
  write_hardware_profile(p, path);
  const LinearCostTable& a = p.linear_table;
  const LinearCostTable b = load_hardware_profile(path).linear_table;
  EXPECT_EQ(b.rows, a.rows);
  EXPECT_EQ(b.k, a.k);
  ASSERT_EQ(b.memory.bytes_per_s.size(), a.k.size());
  for (size_t i = 0; i < a.k.size(); ++i) {
    for (size_t j = 0; j < a.rows.size(); ++j) {
      EXPECT_NEAR(b.memory.bytes_per_s[i][j], a.memory.bytes_per_s[i][j],
                  1e-5 * a.memory.bytes_per_s[i][j]);
      EXPECT_NEAR(b.cache.fixed_s[i][j], a.cache.fixed_s[i][j], 1e-5 * a.cache.fixed_s[i][j]);
    }
  }
}

TEST_F(HardwareProfileFile, EachBadLinearTableIsOneLineNamingTheField) {
  const std::string base = hardware_profile_yaml(load_hardware_profile("a100-pcie4"));
  const auto table = [&](const std::string& rows, const std::string& k,
                         const std::string& memory_fixed) {
    return write(base + "linear_table:\n  rows: " + rows + "\n  k: " + k +
                 "\n  memory:\n    fixed_s: " + memory_fixed +
                 "\n    bytes_per_s: [[1e10, 1e10]]\n  cache:\n    fixed_s: [[0, 0]]\n"
                 "    bytes_per_s: [[2e10, 2e10]]\n");
  };
  // A valid one loads.
  EXPECT_EQ(load_hardware_profile(table("[1, 4]", "[1024]", "[[1e-6, 2e-6]]")).linear_table.rows,
            (std::vector<int64_t>{1, 4}));
  std::string path = table("[1, 4]", "[1024]", "[[1e-6]]");
  expect_error([&] { load_hardware_profile(path); },
               {path, "'linear_table.memory.fixed_s'", "1 lists", "2 numbers"});
  path = table("[2, 4]", "[1024]", "[[1e-6, 2e-6]]");
  expect_error([&] { load_hardware_profile(path); }, {path, "'linear_table.rows'", "start at 1"});
  path = table("[1, 1]", "[1024]", "[[1e-6, 2e-6]]");
  expect_error([&] { load_hardware_profile(path); }, {path, "'linear_table.rows'", "increasing"});
  path = table("[1, 4]", "[1024.5]", "[[1e-6, 2e-6]]");
  expect_error([&] { load_hardware_profile(path); }, {path, "'linear_table.k'", "integers"});
  path = table("[1, 4]", "[1024]", "[[-1e-6, 2e-6]]");
  expect_error([&] { load_hardware_profile(path); },
               {path, "'linear_table.memory.fixed_s'", ">= 0", "-1e-06"});
  path = table("[1, 4]", "[1024]", "[[fast, 2e-6]]");
  expect_error([&] { load_hardware_profile(path); },
               {path, "'linear_table.memory.fixed_s'", "numbers", "fast"});
  path = write(base + "linear_table: 3\n");
  expect_error([&] { load_hardware_profile(path); }, {path, "'linear_table'", "map"});
  path = write(base + "linear_table:\n  row: [1]\n");
  expect_error([&] { load_hardware_profile(path); }, {path, "unknown field 'linear_table.row'"});
}

TEST_F(HardwareProfileFile, WithLinkSetsBothDirectionsAndUnlimitedIsInfinite) {
  const HardwareProfile p = with_link(load_hardware_profile("cpu-backend"), 4.0, 20.0);
  EXPECT_DOUBLE_EQ(p.h2d_bytes_per_s, 4e9);
  EXPECT_DOUBLE_EQ(p.d2h_bytes_per_s, 4e9);
  EXPECT_DOUBLE_EQ(p.transfer_latency_s, 20e-6 + p.link_emulation_overhead_s);
  const HardwareProfile unlimited = with_link(p, 0.0, 0.0);
  EXPECT_TRUE(std::isinf(unlimited.h2d_bytes_per_s));
  // An unlimited link survives a write and a load.
  const std::string path = (dir_.path() / "unlimited.yaml").string();
  write_hardware_profile(unlimited, path);
  EXPECT_TRUE(std::isinf(load_hardware_profile(path).h2d_bytes_per_s));
  expect_error([&] { with_link(p, -1.0, 0.0); }, {"link bandwidth", "-1"});
}

TEST_F(HardwareProfileFile, EachBadInputIsOneLineNamingFileAndField) {
  expect_error([] { load_hardware_profile("/nonexistent/dir/gpu.yaml"); },
               {"/nonexistent/dir/gpu.yaml", "no such"});
  expect_error([] { load_hardware_profile("tpu-v9"); },
               {"unknown hardware profile 'tpu-v9'", "rtx-a6000-pcie3", "a100-pcie4", "h100-pcie5",
                "cpu-backend"});
  std::string path = write(variant("gemm_flops", ""));
  expect_error([&] { load_hardware_profile(path); }, {path, "missing field 'gemm_flops'"});
  path = write(variant("gemm_flops", "gemm_flops: 0"));
  expect_error([&] { load_hardware_profile(path); }, {path, "'gemm_flops'", "> 0", "0"});
  path = write(variant("h2d_bytes_per_s", "h2d_bytes_per_s: -12e9"));
  expect_error([&] { load_hardware_profile(path); }, {path, "'h2d_bytes_per_s'", "-12e9"});
  path = write(variant("gemm_flops", "gemm_flops: fast"));
  expect_error([&] { load_hardware_profile(path); },
               {path, "'gemm_flops' must be a number", "fast"});
  path = write(variant("gemm_flops", "gemm_flops: [1, 2]"));
  expect_error([&] { load_hardware_profile(path); }, {path, "'gemm_flops' must be a number"});
  path = write(variant("compute_slowdown_under_copy", "compute_slowdown_under_copy: 0.5"));
  expect_error([&] { load_hardware_profile(path); },
               {path, "'compute_slowdown_under_copy'", ">= 1"});
  path = write(variant("backend", "backend: tpu"));
  expect_error([&] { load_hardware_profile(path); }, {path, "'backend'", "cuda or cpu", "tpu"});
  path = write(variant("name", ""));
  expect_error([&] { load_hardware_profile(path); }, {path, "missing field 'name'"});
  path = write(variant("gemm_flops", "gemm_flops: 1e14\ngemm_flop: 1e14"));
  expect_error([&] { load_hardware_profile(path); }, {path, "unknown field 'gemm_flop'"});
  HardwareProfile unsourced = load_hardware_profile("a100-pcie4");
  unsourced.sources.clear();
  path = write(hardware_profile_yaml(unsourced) + "sources: [a, b]\n");
  expect_error([&] { load_hardware_profile(path); }, {path, "'sources'"});
  path = write("name: [unclosed\n");
  expect_error([&] { load_hardware_profile(path); }, {path, "not valid YAML"});
  path = write(hardware_profile_yaml(unsourced) + "? [gemm_flops]\n: 1\n");
  expect_error([&] { load_hardware_profile(path); }, {path, "a key must be plain text"});
  path = write("- a list\n- not a map\n");
  expect_error([&] { load_hardware_profile(path); }, {path, "map"});
}

}  // namespace
}  // namespace infinigen
