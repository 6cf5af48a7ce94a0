// tests: `infinigen bench`: experiment files, shrinking points, results files, and every bundled
// experiment end to end at a scale the CPU backend runs in seconds.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>

#include "bench/bench_results.h"
#include "bench/bench_runner.h"
#include "bench/experiment.h"
#include "core/error.h"
#include "predict/hardware_profile.h"
#include "tests/test_util.h"

namespace infinigen {
namespace {

using testing_util::CommandResult;
using testing_util::expect_error;
using testing_util::run_infinigen;
using testing_util::TempDir;

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::string write_experiment(const TempDir& dir, const std::string& text) {
  const std::string path = (dir.path() / "exp.yaml").string();
  std::ofstream(path) << text;
  return path;
}

const char* const kMinimal = "x: batch\nplot: latency\ndefaults: {model: opt-125m}\n";

TEST(Experiment, EveryBundledExperimentLoads) {
  const std::vector<std::string> names = bundled_experiment_names();
  EXPECT_EQ(names, (std::vector<std::string>{"fig14", "fig15", "fig16a", "fig16b", "fig17", "fig18",
                                             "gpu-check", "llama-gqa", "long-context", "sessions",
                                             "shared_prefix", "shared_prefix_groups"}));
  for (const std::string& name : names) {
    const Experiment e = load_experiment(name);
    EXPECT_EQ(e.name, name);
    EXPECT_FALSE(e.points.empty()) << name;
    EXPECT_FALSE(e.paper_source.empty() && !e.paper.empty()) << name;
  }
}

TEST(Experiment, PointsAreEveryOverrideTimesEveryPolicy) {
  const Experiment fig15 = load_experiment("fig15");
  ASSERT_EQ(fig15.points.size(), 5u * 4u);
  EXPECT_EQ(fig15.points[0].x, "4");
  EXPECT_EQ(fig15.points[0].settings.offload.policy, "full");
  EXPECT_EQ(fig15.points[3].settings.offload.policy, "infinigen");
  EXPECT_EQ(fig15.points[19].settings.batch, 20);
  EXPECT_EQ(fig15.points[19].settings.prompt_len, 1920);

  const Experiment fig16b = load_experiment("fig16b");
  EXPECT_EQ(fig16b.points.back().settings.model, "opt-30b");
  EXPECT_DOUBLE_EQ(fig16b.points.back().settings.offload.weights_gpu_percent, 70.0);

  // fig17's second panel has the partial ratio on its x axis.
  const Experiment fig17 = load_experiment("fig17");
  ASSERT_EQ(fig17.points.size(), 19u);
  EXPECT_EQ(fig17.points[0].panel, "alpha");
  EXPECT_EQ(fig17.points[0].x, "1");
  EXPECT_EQ(fig17.points[9].panel, "partial_ratio");
  EXPECT_EQ(fig17.points[9].x, "0.1");
  EXPECT_DOUBLE_EQ(fig17.points[9].settings.offload.speculation.alpha, 4.0);
}

TEST(Experiment, PaperValuesMatchTheirPoints) {
  const Experiment fig15 = load_experiment("fig15");
  BenchSettings s = fig15.points[0].settings;
  s.offload.policy = "infinigen";
  s.batch = 20;
  EXPECT_DOUBLE_EQ(paper_values_for(fig15, s).at("throughput_tok_s"), 41.99);
  s.batch = 8;
  EXPECT_TRUE(paper_values_for(fig15, s).empty());
  const Experiment fig16a = load_experiment("fig16a");
  BenchSettings longest = fig16a.points.back().settings;  // 1920 + 128, infinigen
  EXPECT_DOUBLE_EQ(paper_values_for(fig16a, longest).at("speedup_vs_full"), 5.28);
}

TEST(Experiment, BadFilesGetOneLineNamingTheKey) {
  TempDir dir("bench-bad");
  const auto load = [&](const std::string& text) {
    return [&dir, text] { load_experiment(write_experiment(dir, text)); };
  };
  expect_error(load(std::string(kMinimal) + "colour: red\n"), {"exp.yaml", "unknown key 'colour'"});
  expect_error(load(std::string(kMinimal) + "points: [{batch: many}]\n"),
               {"exp.yaml", "points[0].batch", "'many' is not a number"});
  expect_error(load(std::string(kMinimal) + "points: [{batch: 0}]\n"),
               {"exp.yaml", "points[0].batch = 0", "at least 1"});
  expect_error(load(std::string(kMinimal) + "policies: [full, magic]\n"),
               {"exp.yaml", "points[0]: policy", "unknown policy 'magic'"});
  expect_error(load(std::string(kMinimal) + "points: [{temperature: 2}]\n"),
               {"exp.yaml", "unknown setting 'points[0].temperature'"});
  expect_error(load("plot: latency\n"), {"exp.yaml", "x (the key on the x axis) is missing"});
  expect_error(load("x: batch\nplot: pie\n"), {"exp.yaml", "plot = 'pie'"});
  expect_error(load("x: [batch\n"), {"exp.yaml", "not valid YAML"});
  // Keys that are not text (found by fuzzing: yaml-cpp's own "bad conversion" escaped).
  expect_error(load(std::string(kMinimal) + "[a, b]: 1\n"),
               {"exp.yaml", "line 4", "a key must be plain text"});
  expect_error(load(std::string(kMinimal) + "points: [{{batch: 1}: 2}]\n"),
               {"exp.yaml", "a key must be plain text"});
  expect_error([] { load_experiment("fig99"); }, {"fig99", "not a bundled experiment", "fig14"});
}

TEST(Experiment, ScalingShrinksModelAndSizesWithFloors) {
  const ModelConfig opt13b = load_preset("opt-13b");
  const BenchSettings paper = load_experiment("fig14").points[0].settings;
  const ScaledPoint same = scale_point(opt13b, paper, 1.0);
  EXPECT_EQ(same.config.num_layers, 40);
  EXPECT_EQ(same.settings.batch, 20);

  const ScaledPoint small = scale_point(opt13b, paper, 0.05);
  EXPECT_EQ(small.config.num_layers, 4);    // 2 -> floor of 4
  EXPECT_EQ(small.config.num_heads, 2);     // 2
  EXPECT_EQ(small.config.head_dim(), 128);  // kept
  EXPECT_EQ(small.config.hidden_size, 256);
  EXPECT_EQ(small.config.ffn_dim, 1024);
  EXPECT_EQ(small.config.vocab_size, 1024);  // 126 -> floor
  EXPECT_EQ(small.settings.batch, 5);        // ceil(20 * sqrt(0.05)) = ceil(4.47)
  EXPECT_EQ(small.settings.prompt_len, 96);
  EXPECT_EQ(small.settings.gen_len, 6);
  EXPECT_EQ(small.settings.offload.policy, paper.offload.policy);
}

TEST(Experiment, ScalingKeepsGroupedQueriesAndSpecialTokens) {
  const ModelConfig llama = load_preset("llama-3.1-8b");  // 32 query heads, 8 KV heads
  const ModelConfig small = scaled_model_config(llama, 0.25);
  EXPECT_EQ(small.kv_heads(), 2);
  EXPECT_EQ(small.num_heads, 8);  // every KV head keeps its 4 query heads
  EXPECT_EQ(small.head_dim(), 128);
  EXPECT_EQ(small.hidden_size, 1024);
  EXPECT_EQ(small.ffn_dim, 14336 / 4);  // the FFN keeps its ratio to the width
  EXPECT_LT(small.bos_token_id, small.vocab_size);
  EXPECT_LT(small.eos_token_id, small.vocab_size);
  EXPECT_EQ(small.rope.scaling, RopeConfig::Scaling::Llama3);
}

// A report with two points (full and infinigen at one x) to check derived columns.
BenchReport two_point_report() {
  BenchReport report;
  report.experiment = load_experiment("fig14");
  report.options.scale = 0.5;
  for (const char* policy : {"full", "infinigen"}) {
    PointResult p;
    p.point.x = policy;
    p.point.settings.offload.policy = policy;
    p.ran = p.point.settings;
    p.ran_config = load_preset("opt-125m");
    PointMetrics m;
    m.prefill_s = 1.0;
    m.decode_s = std::string(policy) == "full" ? 9.0 : 3.0;
    m.total_s = m.prefill_s + m.decode_s;
    m.block_s = 0.01;
    m.block_transfer_s = 0.004;
    m.block_compute_s = 0.006;
    p.measured = m;
    PointMetrics predicted = m;
    predicted.decode_s *= 1.1;
    p.predicted = predicted;
    p.paper = paper_values_for(report.experiment, p.point.settings);
    report.points.push_back(p);
  }
  return report;
}

TEST(BenchResults, SpeedupsAndErrorsAreDerivedFromTheRightPoints) {
  const BenchReport report = two_point_report();
  EXPECT_DOUBLE_EQ(speedup_vs_full(report, 0, false), 1.0);
  EXPECT_DOUBLE_EQ(speedup_vs_full(report, 1, false), 10.0 / 4.0);
  EXPECT_DOUBLE_EQ(slowdown_vs_gpu(report, 1, false), 0.0);  // no gpu point

  const nlohmann::json j = bench_json(report, this_machine(Device::Cpu), "infinigen bench");
  EXPECT_EQ(j["points"].size(), 2u);
  EXPECT_NEAR(j["points"][1]["decode_error"].get<double>(), 0.1, 1e-12);
  EXPECT_DOUBLE_EQ(j["points"][1]["paper"]["throughput_tok_s"].get<double>(), 41.99);
  EXPECT_FALSE(j["commit"].get<std::string>().empty());

  const std::string csv = bench_csv(report);
  std::istringstream lines(csv);
  std::string header, full, infinigen;
  std::getline(lines, header);
  std::getline(lines, full);
  std::getline(lines, infinigen);
  EXPECT_NE(header.find("measured_speedup_vs_full"), std::string::npos);
  EXPECT_NE(header.find("paper_throughput_tok_s"), std::string::npos);
  EXPECT_EQ(std::count(header.begin(), header.end(), ','),
            std::count(infinigen.begin(), infinigen.end(), ','));
  EXPECT_NE(infinigen.find(",2.5,"), std::string::npos);  // the speedup
  EXPECT_NE(infinigen.find(",41.99"), std::string::npos);
}

// Every bundled experiment, end to end through the CLI at a tiny scale: CSV, JSON and PNG.
TEST(BenchCli, EveryExperimentRunsAndPlotsAtSmallScale) {
  TempDir out("bench-out");
  for (const std::string& name : bundled_experiment_names()) {
    const CommandResult r =
        run_infinigen({"bench", "--experiment", name, "--scale", "0.02", "--repeats", "1", "--out",
                       out.str(), "--predict", "cpu-backend"});
    ASSERT_EQ(r.exit_code, 0) << name << ": " << r.err;
    for (const char* ext : {".csv", ".json", ".png"}) {
      EXPECT_TRUE(std::filesystem::exists(out.path() / (name + ext))) << name << ext;
    }
    const nlohmann::json j = nlohmann::json::parse(read_file(out.path() / (name + ".json")));
    EXPECT_EQ(j["points"].size(), load_experiment(name).points.size());
    for (const auto& point : j["points"]) {
      EXPECT_EQ(point["status"], "ok") << name;
      EXPECT_TRUE(point.contains("measured")) << name;
      EXPECT_TRUE(point.contains("predicted")) << name;
      EXPECT_GT(point["measured"]["decode_s"].get<double>(), 0.0) << name;
    }
  }
}

TEST(BenchCli, PredictionAloneNeedsNoMeasurement) {
  TempDir out("bench-predict");
  const CommandResult r = run_infinigen({"bench", "--experiment", "fig14", "--no-measure",
                                         "--predict", "rtx-a6000-pcie3", "--fractions-scale",
                                         "0.02", "--no-plot", "--out", out.str()});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(read_file(out.path() / "fig14.json"));
  for (const auto& point : j["points"]) {
    EXPECT_FALSE(point.contains("measured"));
    ASSERT_TRUE(point.contains("predicted")) << point["prediction_status"];
    EXPECT_GT(point["predicted"]["throughput_tok_s"].get<double>(), 0.0);
    EXPECT_EQ(point["ran"]["batch"], 20);  // the paper's sizes
  }
}

TEST(BenchCli, BadInputsGetOneLineAndNonZeroExit) {
  TempDir out("bench-bad-cli");
  const auto one_line = [](const CommandResult& r, const std::string& fragment) {
    EXPECT_NE(r.exit_code, 0);
    EXPECT_NE(r.err.find(fragment), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  };
  one_line(run_infinigen({"bench", "--out", out.str()}), "--experiment is required");
  one_line(run_infinigen({"bench", "--experiment", "nope.yaml", "--out", out.str()}),
           "nope.yaml: no such file");
  one_line(run_infinigen({"bench", "--experiment", "fig14", "--scale", "0", "--out", out.str()}),
           "--scale must be in (0, 1]");
  one_line(
      run_infinigen({"bench", "--experiment", "fig14", "--predict", "abacus", "--out", out.str()}),
      "abacus");
  one_line(run_infinigen({"bench", "--experiment", "fig14", "--no-measure", "--out", out.str()}),
           "--no-measure needs --predict");
}

// Progress lines round their times ("12.34 s", "845.2 ms"), not six significant digits.
TEST(BenchRunner, ProgressLinesRoundTheirTimes) {
  TempDir dir("bench-progress");
  const Experiment experiment = parse_experiment(
      "x: batch\nplot: latency\ndefaults: {model: opt-125m, prompt_len: 64, gen_len: 8}\n"
      "points: [{batch: 1}, {batch: 2}]\npolicies: [full, infinigen]\n",
      "exp.yaml", "exp");
  BenchOptions options;
  options.measure = false;
  options.predict = "rtx-a6000-pcie3";
  options.fetched_fraction = 0.1;
  std::vector<std::string> lines;
  run_experiment(experiment, options, [&](const std::string& line) { lines.push_back(line); });
  ASSERT_EQ(lines.size(), experiment.points.size());
  const std::regex rounded(R"(, predicted ([0-9]+\.[0-9]{2} s|[0-9]+\.[0-9] ms|[0-9]+ us)$)");
  for (const std::string& line : lines) EXPECT_TRUE(std::regex_search(line, rounded)) << line;
}

// --help names every bundled experiment; --list puts each column of its tables at one offset.
TEST(BenchCli, HelpAndListShowEveryExperimentInColumns) {
  const CommandResult help = run_infinigen({"bench", "--help"});
  ASSERT_EQ(help.exit_code, 0) << help.err;
  std::string flat = help.out;  // CLI11 wraps the help text
  std::replace(flat.begin(), flat.end(), '\n', ' ');
  for (const std::string& name : bundled_experiment_names()) {
    EXPECT_NE(flat.find(name), std::string::npos) << name << " not in\n" << help.out;
  }
  const CommandResult list = run_infinigen({"bench", "--list"});
  ASSERT_EQ(list.exit_code, 0) << list.err;
  std::istringstream lines(list.out);
  std::set<size_t> figure_at, title_at, description_at;
  for (std::string line; std::getline(lines, line);) {
    for (const std::string& name : bundled_experiment_names()) {
      if (line.rfind("  " + name + " ", 0) != 0) continue;
      const Experiment e = load_experiment(name);
      figure_at.insert(line.find(e.figure, name.size() + 2));
      title_at.insert(line.rfind(e.title));
    }
    for (const std::string& name : hardware_profile_names()) {
      if (line.rfind("  " + name + " ", 0) == 0) {
        description_at.insert(line.rfind(load_hardware_profile(name).description));
      }
    }
  }
  EXPECT_EQ(figure_at.size(), 1u) << list.out;
  EXPECT_EQ(title_at.size(), 1u) << list.out;
  EXPECT_EQ(description_at.size(), 1u) << list.out;
}

// The plot's title describes the paper's numbers as drawn: every diamond is hollow, in the
// points beside ours and in the paper's own subplot (a result at scale 0.5 gets one).
TEST(BenchPlot, PaperDiamondsAreHollowAsTheTitleSays) {
  if (std::system("/usr/bin/python3 -c 'import matplotlib' 2>/dev/null") != 0) {
    GTEST_SKIP() << "no /usr/bin/python3 with matplotlib";
  }
  TempDir dir("bench-plot");
  const std::string script = (dir.path() / "check.py").string();
  std::ofstream(script) << R"(import sys
sys.path.insert(0, sys.argv[1])
import plot_bench
point = lambda policy, x, tput: {
    "policy": policy, "x": x, "panel": "", "paper": {"throughput_tok_s": tput},
    "settings": {"batch": int(x), "gen_len": 32},
    "measured": {"total_s": 1.0, "prefill_s": 0.2, "decode_s": 0.8}}
for x_key in ("batch", "policy"):
    result = {"experiment": {"x": x_key, "plot": "latency", "figure": "Fig. 0", "title": "t",
                             "paper_source": "Table 0"},
              "settings": {"scale": 0.5, "device": "cpu", "emulated_link_gbps": 12},
              "machine": {"device": "cpu", "cpu": "a cpu"}, "commit": "abc",
              "points": [point("full", "1", 10.0), point("infinigen", "2", 20.0)]}
    fig = plot_bench.draw(result)
    assert "hollow diamonds" in fig._suptitle.get_text(), fig._suptitle.get_text()
    for ax in fig.axes:
        for line in ax.get_lines():
            if line.get_marker() == "D":
                assert line.get_markerfacecolor() == "none", (x_key, line.get_label())
print("ok")
)";
  const std::string command = "/usr/bin/python3 " + script + " " INFINIGEN_SOURCE_DIR "/tools";
  EXPECT_EQ(std::system(command.c_str()), 0) << command;
}

}  // namespace
}  // namespace infinigen
