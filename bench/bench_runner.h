// bench: running an experiment. Every (point, policy) pair is measured on this machine (median of
// repeated runs, at --scale) and, given a hardware profile, predicted by the cost model
// (predict/cost_model.h) at the same scale.
#pragma once

#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "bench/experiment.h"
#include "core/device.h"

namespace infinigen {

struct BenchOptions {
  double scale = 1.0;   // shrink every point (scale_point); 1 = the paper's sizes
  int repeats = 0;      // measured runs per point (median); 0 = the experiment's
  Device device = Device::Cpu;
  double link_gbps = 0;        // CPU backend: emulated link; 0 = the experiment's link_gbps
  double link_latency_us = 0;  // CPU backend: per-transfer latency of the emulated link
  bool measure = true;         // run the points here
  std::string predict;         // hardware profile (name or YAML path); empty = no prediction
  // Without measurements, the fetched fractions the prediction of `infinigen` needs come from a
  // run of the point's model at this scale, with the point's lengths, on this machine.
  double fractions_scale = 0.05;
  int64_t fractions_gen_len = 8;  // decode steps of that run
  // When > 0: the share of each speculated layer's KV that `infinigen` loads, for the
  // prediction, instead of measured shares (e.g. a share a paper measured on a real model).
  double fetched_fraction = 0;
  // When >= 0: the share of those rows that each (sequence, KV head) had fetched at the step
  // before (what InfiniGen's row cache serves), for the prediction. -1: measured with the fetched
  // shares, or none (0) where fetched_fraction is given.
  double fetched_again_fraction = -1;
  uint64_t seed = 0;              // synthetic weights and prompts
};

// What one run shows, in seconds and bytes. Block figures are one transformer layer's share of
// a decode step: its wall time, the part spent waiting for its KV (transfer not hidden), and the
// rest (compute).
struct PointMetrics {
  double prefill_s = 0;
  double decode_s = 0;
  double total_s = 0;
  double throughput_tok_s = 0;
  double decode_step_s = 0;  // median decode step
  double h2d_bytes_per_step = 0;
  double d2h_bytes_per_step = 0;
  double host_kv_bytes = 0;     // the host KV pool after the run (pools of full, infinigen)
  double fetched_fraction = 0;  // KV rows loaded / rows in the pool, over decode steps
  double block_s = 0;
  double block_transfer_s = 0;
  double block_compute_s = 0;
  std::vector<double> layer_fetched_fraction;  // per layer, over decode steps
  // Per layer, over decode steps: of the rows loaded, the share also loaded at the step before.
  std::vector<double> layer_fetched_again_fraction;
  // Per decode step and layer: (sequence, head, token) rows loaded (measured runs only).
  std::vector<std::vector<uint64_t>> fetched_rows;
  // Per decode step and layer: of those, the rows the row cache served (measured runs only).
  std::vector<std::vector<uint64_t>> cached_rows;
};

struct PointResult {
  ExperimentPoint point;   // as the experiment file has it
  BenchSettings ran;       // the settings at --scale
  ModelConfig ran_config;  // the model at --scale
  std::string status = "ok";  // "ok", or one line saying why the point was not measured
  std::optional<PointMetrics> measured;
  std::string prediction_status = "ok";
  std::optional<PointMetrics> predicted;
  std::map<std::string, double> paper;  // the paper's numbers for this point
};

struct BenchReport {
  Experiment experiment;
  BenchOptions options;
  double link_gbps = 0;       // the emulated link the CPU-backend runs used
  std::string profile_name;   // the predicted hardware, when any
  std::string profile_description;
  std::string fractions_source;  // where the prediction's fetched fractions came from
  std::vector<PointResult> points;
};

// Runs (and/or predicts) every point. `progress` gets one line per point. A point whose memory
// plan cannot fit is reported in its status; every other failure is an Error.
BenchReport run_experiment(const Experiment& experiment, const BenchOptions& options,
                           const std::function<void(const std::string&)>& progress = {});

// Speedup of a point over the `full` policy at the same x and panel (measured or predicted
// total latency), or 0 when that point is missing.
double speedup_vs_full(const BenchReport& report, size_t index, bool predicted);
// Slowdown of a point's decode step relative to the `gpu` policy at the same x and panel.
double slowdown_vs_gpu(const BenchReport& report, size_t index, bool predicted);

}  // namespace infinigen
