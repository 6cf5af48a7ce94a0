// apps/infinigen: `infinigen bench`, the paper's latency experiments (configs/experiments/) as
// CSV, JSON and a plot; `--predict` adds the cost model's figures for a hardware profile, and
// `--measure-profile` writes the profile of this machine's CPU backend.

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <vector>

#include "apps/infinigen/commands.h"
#include "apps/infinigen/option_flags.h"
#include "apps/infinigen/plot_script.h"
#include "bench/bench_results.h"
#include "bench/bench_runner.h"
#include "core/device.h"
#include "core/interrupt.h"
#include "core/output_directory.h"
#include "offload/runtime.h"
#include "predict/hardware_profile.h"
#include "predict/profile_measurement.h"

namespace infinigen::cli {
namespace {

namespace fs = std::filesystem;

struct BenchCommandOptions {
  std::string experiment;
  std::string out = "bench-results";
  double scale = 1.0;
  int repeats = 0;
  std::string device = "auto";
  double link_gbps = 0.0;
  double link_latency_us = 0.0;
  std::string predict;
  bool no_measure = false;
  double fractions_scale = 0.05;
  double fetched_fraction = 0.0;
  double fetched_again_fraction = -1.0;
  bool no_plot = false;
  uint64_t seed = 0;
  std::string measure_profile;
  bool list = false;
  std::string command_line;
};

// Rows of columns, each column as wide as its widest cell, two spaces apart (the last column
// unpadded).
void print_columns(const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> widths;
  for (const std::vector<std::string>& row : rows) {
    widths.resize(std::max(widths.size(), row.size()), 0);
    for (size_t c = 0; c < row.size(); ++c) widths[c] = std::max(widths[c], row[c].size());
  }
  for (const std::vector<std::string>& row : rows) {
    std::string line = " ";
    for (size_t c = 0; c < row.size(); ++c) {
      line += " " + row[c];
      if (c + 1 < row.size()) line += std::string(widths[c] - row[c].size() + 1, ' ');
    }
    std::printf("%s\n", line.c_str());
  }
}

int list_bundled() {
  std::printf("experiments (configs/experiments):\n");
  std::vector<std::vector<std::string>> experiments;
  for (const std::string& name : bundled_experiment_names()) {
    const Experiment e = load_experiment(name);
    experiments.push_back({name, e.figure, e.title});
  }
  print_columns(experiments);
  std::printf("hardware profiles (configs/hardware):\n");
  std::vector<std::vector<std::string>> profiles;
  for (const std::string& name : hardware_profile_names()) {
    profiles.push_back({name, load_hardware_profile(name).description});
  }
  print_columns(profiles);
  return 0;
}

// The bundled experiments' names, for --experiment's help.
std::string bundled_names() {
  std::string names;
  for (const std::string& name : bundled_experiment_names()) {
    names += (names.empty() ? "" : ", ") + name;
  }
  return names;
}

int measure_profile(const BenchCommandOptions& o) {
  const HardwareProfile profile = measure_cpu_backend_profile(
      [](const std::string& line) { std::fprintf(stderr, "infinigen: %s\n", line.c_str()); });
  write_hardware_profile(profile, o.measure_profile);
  std::printf("wrote %s (%s)\n", o.measure_profile.c_str(), profile.description.c_str());
  return 0;
}

int bench(const BenchCommandOptions& o) {
  if (o.list) return list_bundled();
  if (!o.measure_profile.empty()) return measure_profile(o);
  INFINIGEN_CHECK(!o.experiment.empty(), "--experiment is required (a file, or one of the ",
                  "bundled names listed by --list)");
  INFINIGEN_CHECK(o.link_gbps >= 0, "--emulate-link-gbps must be >= 0, got ", o.link_gbps);
  INFINIGEN_CHECK(o.link_latency_us >= 0, "--emulate-link-latency-us must be >= 0, got ",
                  o.link_latency_us);
  INFINIGEN_CHECK(o.scale > 0 && o.scale <= 1, "--scale must be in (0, 1], got ", o.scale);
  INFINIGEN_CHECK(o.repeats >= 0, "--repeats must be at least 1, got ", o.repeats);
  INFINIGEN_CHECK(!o.no_measure || !o.predict.empty(),
                  "nothing to do: --no-measure needs --predict PROFILE");
  INFINIGEN_CHECK(o.fetched_fraction >= 0 && o.fetched_fraction <= 1,
                  "--fetched-fraction must be in [0, 1], got ", o.fetched_fraction);
  INFINIGEN_CHECK(o.fetched_fraction == 0 || !o.predict.empty(),
                  "--fetched-fraction only applies to predictions: add --predict PROFILE");
  INFINIGEN_CHECK(o.fetched_again_fraction == -1 ||
                      (o.fetched_again_fraction >= 0 && o.fetched_again_fraction <= 1),
                  "--fetched-again-fraction must be in [0, 1], got ", o.fetched_again_fraction);
  INFINIGEN_CHECK(o.fetched_again_fraction == -1 || !o.predict.empty(),
                  "--fetched-again-fraction only applies to predictions: add --predict PROFILE");
  INFINIGEN_CHECK(o.fractions_scale > 0 && o.fractions_scale <= 1,
                  "--fractions-scale must be in (0, 1], got ", o.fractions_scale);
  const Experiment experiment = load_experiment(o.experiment);

  // One device for the whole experiment: CUDA only when it runs every policy in it.
  bool cuda_runs_experiment = true;
  for (const ExperimentPoint& point : experiment.points) {
    cuda_runs_experiment =
        cuda_runs_experiment && policy_runs_on(point.settings.offload.policy, Device::Cuda);
  }
  std::string fallback;
  BenchOptions options;
  options.device = resolve_device(parse_device_request(o.device), cuda_runs_experiment, &fallback,
                                  "every policy of this experiment");
  if (!fallback.empty()) std::fprintf(stderr, "infinigen: %s\n", fallback.c_str());
  options.scale = o.scale;
  options.repeats = o.repeats;
  options.link_gbps = o.link_gbps;
  options.link_latency_us = o.link_latency_us;
  options.measure = !o.no_measure;
  options.predict = o.predict;
  options.fractions_scale = o.fractions_scale;
  options.fetched_fraction = o.fetched_fraction;
  options.fetched_again_fraction = o.fetched_again_fraction;
  options.seed = o.seed;
  if (!options.predict.empty()) load_hardware_profile(options.predict);  // fail before running

  // Results overwrite earlier ones of the same experiment in --out.
  std::error_code ec;
  fs::create_directories(o.out, ec);
  INFINIGEN_CHECK(!ec && fs::is_directory(o.out), "--out ", o.out,
                  ": cannot create the directory (", ec.message(), ")");
  const fs::path stem = fs::path(o.out) / experiment.name;
  std::fprintf(stderr, "infinigen: %s (%s), %zu runs at scale %g\n", experiment.name.c_str(),
               experiment.figure.c_str(), experiment.points.size(), o.scale);
  size_t runs_done = 0;
  const BenchReport report = with_interrupt_context(
      [&] {
        return run_experiment(experiment, options, [&](const std::string& line) {
          ++runs_done;
          std::fprintf(stderr, "infinigen: %s\n", line.c_str());
        });
      },
      [&] {
        return cat(" after ", runs_done, " of ", experiment.points.size(), " runs; nothing was ",
                   "written to ", o.out);
      });
  const MachineInfo machine = this_machine(options.device);
  const fs::path json_path = stem.string() + ".json";
  const fs::path csv_path = stem.string() + ".csv";
  write_text_file(json_path, bench_json(report, machine, o.command_line).dump(2) + "\n");
  write_text_file(csv_path, bench_csv(report));
  std::printf("wrote %s\nwrote %s\n", csv_path.c_str(), json_path.c_str());
  if (!o.no_plot) {
    const fs::path png_path = stem.string() + ".png";
    plot("plot_bench.py", json_path, png_path);
    std::printf("wrote %s\n", png_path.c_str());
  }
  return 0;
}

}  // namespace

Command add_bench_command(CLI::App& app) {
  auto o = std::make_shared<BenchCommandOptions>();
  app.add_option("--experiment,-e", o->experiment,
                 "Experiment file (configs/experiments/*.yaml) or bundled name: " +
                     bundled_names() + " (--list describes them)");
  app.add_option("--out,-o", o->out, "Directory for NAME.csv, NAME.json and NAME.png")
      ->capture_default_str();
  app.add_option("--scale", o->scale,
                 "Shrink model, batch and lengths by this factor (1 = the paper's sizes)")
      ->capture_default_str();
  app.add_option("--repeats", o->repeats, "Measured runs per point, median (default: the file's)");
  app.add_option("--device", o->device, "cpu, cuda or auto")->capture_default_str();
  app.add_option("--emulate-link-gbps", o->link_gbps,
                 "CPU backend: host<->device link to emulate, GB/s (default: the file's)");
  app.add_option("--emulate-link-latency-us", o->link_latency_us,
                 "CPU backend: per-transfer latency of the emulated link")
      ->capture_default_str();
  app.add_option("--predict", o->predict,
                 "Also predict every point with the cost model for this hardware profile (a name "
                 "from --list or a YAML file)");
  app.add_flag("--no-measure", o->no_measure, "Only predict (needs --predict)");
  app.add_option("--fractions-scale", o->fractions_scale,
                 "Without measurements: model scale of the runs that measure InfiniGen's fetched "
                 "fractions for the prediction")
      ->capture_default_str();
  app.add_option("--fetched-fraction", o->fetched_fraction,
                 "Predict infinigen with this share of each speculated layer's KV loaded, instead "
                 "of measured shares (0 = measured)")
      ->capture_default_str();
  app.add_option("--fetched-again-fraction", o->fetched_again_fraction,
                 "Predict infinigen's row cache serving this share of the rows a step loads (the "
                 "rows also loaded at the step before; -1 = measured with the fetched shares, 0 "
                 "with --fetched-fraction)")
      ->capture_default_str();
  app.add_flag("--no-plot", o->no_plot, "Write CSV and JSON only");
  add_threads_flag(app);
  app.add_option("--seed", o->seed, "Seed of the synthetic weights and prompts")
      ->check(unsigned_integer())
      ->capture_default_str();
  app.add_option("--measure-profile", o->measure_profile,
                 "Measure this machine's CPU backend and write its hardware profile (YAML)");
  app.add_flag("--list", o->list, "List the bundled experiments and hardware profiles");
  return [o] {
    o->command_line = this_command_line();
    return bench(*o);
  };
}

}  // namespace infinigen::cli
