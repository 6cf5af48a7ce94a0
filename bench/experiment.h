// bench: the paper's latency experiments as data. Each figure is a YAML file in
// configs/experiments/ (see docs/reproduction.md): defaults for one run, a list of points that
// override them, the policies to compare at every point, and the paper's published numbers.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/model_config.h"
#include "offload/offload_options.h"

namespace infinigen {

// The settings of one generation run. YAML keys: model, those of integer_settings() (batch,
// prompt_len, gen_len, history_len, shared_prefix_len, shared_prefix_groups), and every option
// of offload_option_table() by its key (policy, alpha, h2o_budget, ...).
struct BenchSettings {
  std::string model = "opt-13b";  // a preset (synthetic weights) or a checkpoint directory
  int64_t batch = 1;
  int64_t prompt_len = 128;
  int64_t gen_len = 32;
  // > 0: the run is a conversation's next turn, resumed from a session on disk whose sequences
  // hold history_len tokens (a first turn of that many, saved before the timed one); its
  // prompt_len tokens extend them. Prefill latency is then the turn's time to first token.
  int64_t history_len = 0;
  // > 0: the synthetic prompts share their first shared_prefix_len tokens (a system prompt or a
  // document), which a policy with share_prefix on computes and keeps once in whole KV blocks.
  int64_t shared_prefix_len = 0;
  // The prompts sharing a prefix form this many groups, each with a prefix of its own (sequence
  // b in group b % shared_prefix_groups); 1: the whole batch shares one.
  int64_t shared_prefix_groups = 1;
  OffloadOptions offload;  // the runtime's options, with its defaults
};

// The integer settings of a run by their YAML keys, in file order.
struct IntegerSetting {
  const char* key;
  int64_t BenchSettings::*member;
};
const std::vector<IntegerSetting>& integer_settings();

// One point of a figure: the settings it runs, and where it is drawn.
struct ExperimentPoint {
  std::string panel;  // sub-figure (e.g. "alpha" or "partial_ratio" in fig17); may be empty
  std::string x;      // the x-axis value as text (e.g. "8" for batch 8, "opt-30b")
  BenchSettings settings;
};

// A number the paper publishes for one point: `metric` (e.g. throughput_tok_s,
// speedup_vs_full, transfer_share, slowdown_vs_gpu) for the points whose settings match every
// key of `match`.
struct PaperValue {
  std::map<std::string, std::string> match;  // settings key -> value as text
  std::string metric;
  double value = 0.0;
};

struct Experiment {
  std::string name;    // file stem, e.g. "fig14"
  std::string figure;  // e.g. "Fig. 14"
  std::string title;
  std::string x_key;  // settings key on the x axis ("policy", "batch", "total_len", ...)
  std::string plot;   // latency | speedup | fetched | block | ttft (tools/plot_bench.py)
  int repeats = 3;
  double link_gbps = 12.0;              // link emulated by CPU-backend runs (PCIe 3.0 x16, pinned)
  std::vector<ExperimentPoint> points;  // every (point, policy) pair, in file order
  std::string paper_source;
  std::vector<PaperValue> paper;
};

// Reads configs/experiments/<name>.yaml by path, or a bundled experiment by name (e.g. "fig14").
// Unknown keys, wrong types and impossible values are one-line Errors naming the file and key.
Experiment load_experiment(const std::string& path_or_name);
// The same from the file's text; `source` names it in errors, `stem` is the experiment's name.
Experiment parse_experiment(const std::string& text, const std::string& source,
                            const std::string& stem);
std::vector<std::string> bundled_experiment_names();

// `settings` as the YAML key/value text the paper's matches use (e.g. "batch" -> "8").
std::string settings_value(const BenchSettings& settings, const std::string& key);
// The paper's values whose match keys all equal this point's settings.
std::map<std::string, double> paper_values_for(const Experiment& experiment,
                                               const BenchSettings& settings);

// A figure's point shrunk so that it runs on a small machine: prompt and generation lengths (and
// a prompt chunk) times `scale`, the batch times sqrt(scale) rounded up (so batch sweeps keep
// distinct points), the model's layers and heads times `scale` (head size kept; FFN 4x the
// width; vocabulary times scale^2, so the LM head keeps its share of the work). Scale 1 returns the inputs unchanged.
// Minimums: 4 layers, 2 heads, batch 1, 16 prompt tokens, 4 generated, chunks of 8.
struct ScaledPoint {
  ModelConfig config;
  BenchSettings settings;
};
ScaledPoint scale_point(const ModelConfig& config, const BenchSettings& settings, double scale);
ModelConfig scaled_model_config(const ModelConfig& config, double scale);

}  // namespace infinigen
