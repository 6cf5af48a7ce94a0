// apps/infinigen: what `infinigen eval`'s tasks (perplexity, passkey) share: the options every
// task reads, the sweep of KV policies and their settings, one device for the whole sweep, every
// setting planned before the first one runs, the settings run under one progress line, and the
// head of the results JSON.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/dtype.h"
#include "core/model_loader.h"
#include "offload/offload_options.h"

namespace infinigen::cli {

// Defaults come from here and the option structs; only their spelling as flags lives in
// cmd_eval.cc.
struct EvalCommonOptions {
  std::string model = kBuiltinModel;
  std::vector<std::string> policies = {"full", "infinigen"};
  // Values per swept option of offload_option_table(), as given (e.g. "alpha" -> {"1", "4"}).
  std::map<std::string, std::vector<std::string>> sweeps;
  bool no_recall = false;
  std::string device = "auto";
  std::string kv_dtype = "f16";
  std::string out = "eval-results";
  bool no_plot = false;
  bool json = false;
  std::string command_line;
};

// One point of the sweep: a policy and the options it runs with.
struct EvalSetting {
  std::string policy;
  std::string settings;  // e.g. "alpha 4, ratio 0.3, qk" ("" for full and gpu)
  OffloadOptions offload;
  std::string label() const;  // "infinigen (alpha 4)", "full"
};

// Every combination the swept options ask for, each option only with the policies that read it;
// settings that differ only in options not in effect (an eviction policy without a pool limit)
// run once.
std::vector<EvalSetting> eval_settings(const EvalCommonOptions& o);

// One device for the whole sweep: CUDA only when it runs every policy in it (the fallback said on
// stderr).
Device eval_device(const std::vector<EvalSetting>& settings, const std::string& device_flag);

// Plans every setting for runs of `batch` sequences of `prompt_len` + `gen_len` tokens, so that one
// that cannot fit is refused now, not after the others have run for minutes.
void plan_eval_settings(const std::vector<EvalSetting>& settings, const ModelConfig& config,
                        int64_t batch, int64_t prompt_len, int64_t gen_len, DType kv_dtype,
                        Device device);

// Creates the output directory (one-line Error when it cannot).
void create_eval_out(const std::string& out);

// Progress of one setting's runs: (done, total) in the task's own units.
using EvalProgress = std::function<void(int64_t done, int64_t total)>;
// Runs measure(i, progress) for every setting in order under one progress line labelled
// "evaluating N settings on `what`"; an interrupt says which setting it stopped in and that
// nothing was written to `out`.
void run_eval_settings(size_t count, const std::string& what, const std::string& out,
                       const std::function<void(size_t, const EvalProgress&)>& measure);

// The results JSON's head: the task, the model (described, and its short name for plot titles),
// the command, commit and machine.
nlohmann::json eval_report_head(const std::string& task, const EvalCommonOptions& o,
                                const ModelSource& model, Device device);

// "1 window", "3 windows".
std::string counted(size_t count, const std::string& noun);
// A number as a stream prints it (CSV cells).
std::string number(double value);

}  // namespace infinigen::cli
