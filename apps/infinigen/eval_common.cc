// apps/infinigen: the sweep, device, planning, progress and report head of `infinigen eval`.
#include "apps/infinigen/eval_common.h"

#include <cstdio>
#include <filesystem>
#include <set>
#include <sstream>

#include "apps/infinigen/progress.h"
#include "bench/machine_info.h"
#include "core/interrupt.h"
#include "offload/kv_policy.h"
#include "offload/runtime.h"

namespace infinigen::cli {

namespace fs = std::filesystem;

std::string EvalSetting::label() const {
  return settings.empty() ? policy : policy + " (" + settings + ")";
}

std::vector<EvalSetting> eval_settings(const EvalCommonOptions& o) {
  INFINIGEN_CHECK(!o.policies.empty(), option("policy"), ": the sweep is empty");
  std::vector<EvalSetting> points;
  std::set<std::string> seen;
  for (const std::string& policy : o.policies) {
    std::vector<const OptionSpec<OffloadOptions>*> swept;
    for (const OptionSpec<OffloadOptions>& spec : offload_option_table()) {
      if (o.sweeps.contains(spec.key) && policy_reads_option(policy, spec.key)) {
        swept.push_back(&spec);
      }
    }
    std::vector<size_t> at(swept.size(), 0);  // an odometer over the swept lists
    while (true) {
      EvalSetting p{policy, "", {}};
      p.offload.policy = policy;
      p.offload.check_recall = !o.no_recall && policy_reads_option(policy, "check_recall");
      for (size_t i = 0; i < swept.size(); ++i) {
        swept[i]->parse(p.offload, o.sweeps.at(swept[i]->key)[at[i]]);
      }
      for (const OptionSpec<OffloadOptions>* spec : swept) {
        if (spec->in_effect && !spec->in_effect(p.offload)) continue;
        p.settings += (p.settings.empty() ? "" : ", ") + spec->key + " " + spec->format(p.offload);
      }
      p.offload.validate();
      if (seen.insert(policy + ": " + p.settings).second) points.push_back(p);
      size_t i = 0;
      while (i < swept.size() && ++at[i] == o.sweeps.at(swept[i]->key).size()) at[i++] = 0;
      if (i == swept.size()) break;
    }
  }
  return points;
}

Device eval_device(const std::vector<EvalSetting>& settings, const std::string& device_flag) {
  bool cuda_runs_sweep = true;
  for (const EvalSetting& p : settings) {
    cuda_runs_sweep = cuda_runs_sweep && policy_runs_on(p.offload.policy, Device::Cuda);
  }
  std::string fallback;
  const Device device = resolve_device(parse_device_request(device_flag), cuda_runs_sweep,
                                       &fallback, "every policy of this sweep");
  if (!fallback.empty()) std::fprintf(stderr, "infinigen: %s\n", fallback.c_str());
  return device;
}

void plan_eval_settings(const std::vector<EvalSetting>& settings, const ModelConfig& config,
                        int64_t batch, int64_t prompt_len, int64_t gen_len, DType kv_dtype,
                        Device device) {
  for (const EvalSetting& p : settings) {
    try {
      plan_offloaded_run(
          offload_memory_request(config, batch, prompt_len, gen_len, kv_dtype, p.offload),
          p.offload, device);
    } catch (const Error& e) {
      throw Error(cat(p.label(), ": ", e.message()));
    }
  }
}

void create_eval_out(const std::string& out) {
  fs::create_directories(out);
  INFINIGEN_CHECK(fs::is_directory(out), "--out ", out, ": cannot create the directory");
}

void run_eval_settings(size_t count, const std::string& what, const std::string& out,
                       const std::function<void(size_t, const EvalProgress&)>& measure) {
  Progress progress(cat("evaluating ", counted(count, "setting"), " on ", what));
  for (size_t i = 0; i < count; ++i) {
    with_interrupt_context(
        [&] {
          measure(i, [&](int64_t done, int64_t total) {
            progress.update(static_cast<int64_t>(i) * total + done,
                            static_cast<int64_t>(count) * total);
          });
        },
        [&] {
          return cat(" in setting ", i + 1, " of ", count, "; nothing was written to ", out);
        });
  }
}

nlohmann::json eval_report_head(const std::string& task, const EvalCommonOptions& o,
                                const ModelSource& model, Device device) {
  const MachineInfo machine = this_machine(device);
  // The plot's title names the model briefly: its directory's name, not the whole path.
  const std::string model_name = is_builtin_model(o.model) ? "built-in model " + o.model
                                                           : fs::path(o.model).filename().string();
  return {{"task", task},
          {"model", model.description},
          {"model_name", model_name.empty() ? o.model : model_name},
          {"kv_dtype", dtype_name(parse_float_dtype(o.kv_dtype))},
          {"command", o.command_line},
          {"commit", source_commit()},
          {"machine", {{"cpu", machine.cpu}, {"device", machine.device}}}};
}

std::string counted(size_t count, const std::string& noun) {
  return cat(count, " ", noun, count == 1 ? "" : "s");
}

std::string number(double value) {
  std::ostringstream out;
  out << value;
  return out.str();
}

}  // namespace infinigen::cli
