// apps/infinigen: `infinigen eval`, perplexity through the engine's decode loop for a sweep of KV
// policies and their settings (bench/perplexity.h), as a table, CSV, JSON and a plot.

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "apps/infinigen/commands.h"
#include "apps/infinigen/option_flags.h"
#include "apps/infinigen/plot_script.h"
#include "apps/infinigen/progress.h"
#include "bench/machine_info.h"
#include "bench/perplexity.h"
#include "core/interrupt.h"
#include "core/model_loader.h"
#include "core/output_directory.h"
#include "offload/kv_policy.h"
#include "offload/runtime.h"

namespace infinigen::cli {
namespace {

namespace fs = std::filesystem;

// Defaults come from the option structs below; only their spelling as flags lives here.
struct EvalCommandOptions {
  std::string model = kBuiltinModel;
  std::vector<std::string> texts;
  PerplexityOptions perplexity;
  int64_t max_windows = 0;
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

struct SweepPoint {
  std::string policy;
  std::string settings;  // e.g. "alpha 4, ratio 0.3, qk" ("" for full and gpu)
  OffloadOptions offload;
  PerplexityResult result;
};

// "1 window", "3 windows".
std::string counted(size_t count, const std::string& noun) {
  return cat(count, " ", noun, count == 1 ? "" : "s");
}

std::string number(double value) {
  std::ostringstream out;
  out << value;
  return out.str();
}

// Every combination the swept options ask for, each option only with the policies that read it;
// settings that differ only in options not in effect (an eviction policy without a pool limit)
// run once.
std::vector<SweepPoint> sweep(const EvalCommandOptions& o) {
  INFINIGEN_CHECK(!o.policies.empty(), option("policy"), ": the sweep is empty");
  std::vector<SweepPoint> points;
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
      SweepPoint p{policy, "", {}, {}};
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

// The held-out texts, each tokenized no further than the windows can use: with --max-windows,
// max_windows windows of `window` tokens (a 50 MB line is not tokenized whole for two windows).
std::vector<EvalText> read_texts(const EvalCommandOptions& o, const ModelSource& model,
                                 int64_t window) {
  INFINIGEN_CHECK(!o.texts.empty(), "--text is required: a file of held-out text to score");
  INFINIGEN_CHECK(model.tokenizer.has_value(), model.description,
                  " has no tokenizer (vocab.json, merges.txt) to read --text with");
  std::vector<EvalText> texts;
  for (const std::string& path : o.texts) {
    std::ifstream in(path, std::ios::binary);
    INFINIGEN_CHECK(in.good() && !fs::is_directory(path), "--text ", path,
                    ": no such file or not readable");
    std::ostringstream content;
    content << in.rdbuf();
    if (o.max_windows == 0) {
      texts.push_back({path, model.tokenizer->encode(content.str())});
      continue;
    }
    const size_t usable = static_cast<size_t>(o.max_windows * window);
    std::vector<int32_t> ids = model.tokenizer->encode_bounded(content.str(), usable);
    if (ids.size() > usable) ids.resize(usable);
    texts.push_back({path, std::move(ids)});
  }
  return texts;
}

nlohmann::json point_json(const SweepPoint& p, double full_perplexity) {
  const PerplexityResult& r = p.result;
  nlohmann::json j = {{"policy", p.policy},
                      {"settings", p.settings},
                      {"perplexity", r.perplexity()},
                      {"tokens", r.tokens},
                      {"windows", r.windows},
                      {"kv_fetched", r.fetched},
                      {"kv_fetched_speculated_layers", r.speculated_fetched},
                      {"layer_kv_fetched", r.layer_fetched},
                      {"step_kv_fetched", r.step_fetched},
                      {"chunk_start", r.chunk_start},
                      {"chunk_perplexity", r.chunk_perplexity},
                      {"seconds", r.seconds}};
  if (full_perplexity > 0) j["vs_full"] = r.perplexity() / full_perplexity - 1.0;
  if (r.mean_recall >= 0) {
    j["mean_recall"] = r.mean_recall;
    j["min_layer_recall"] = r.min_layer_recall;
  }
  return j;
}

std::string points_csv(const std::vector<SweepPoint>& points, double full_perplexity) {
  std::ostringstream csv;
  csv << "policy,settings,perplexity,vs_full,kv_fetched,kv_fetched_speculated_layers,"
         "mean_recall,min_layer_recall,tokens,seconds\n";
  for (const SweepPoint& p : points) {
    const PerplexityResult& r = p.result;
    csv << p.policy << ",\"" << p.settings << "\"," << r.perplexity() << ","
        << (full_perplexity > 0 ? number(r.perplexity() / full_perplexity - 1.0) : "") << ","
        << r.fetched << "," << r.speculated_fetched << ","
        << (r.mean_recall >= 0 ? number(r.mean_recall) : "") << ","
        << (r.min_layer_recall >= 0 ? number(r.min_layer_recall) : "") << "," << r.tokens << ","
        << r.seconds << "\n";
  }
  return csv.str();
}

int eval(EvalCommandOptions& o) {
  INFINIGEN_CHECK(o.max_windows >= 0, "--max-windows must be at least 1, got ", o.max_windows);
  const DType kv_dtype = parse_float_dtype(o.kv_dtype);  // checked by its flag
  std::vector<SweepPoint> points = sweep(o);

  // One device for the whole sweep: CUDA only when it runs every policy in it.
  bool cuda_runs_sweep = true;
  for (const SweepPoint& p : points) {
    cuda_runs_sweep = cuda_runs_sweep && policy_runs_on(p.offload.policy, Device::Cuda);
  }
  std::string fallback;
  const Device device = resolve_device(parse_device_request(o.device), cuda_runs_sweep, &fallback,
                                       "every policy of this sweep");
  if (!fallback.empty()) std::fprintf(stderr, "infinigen: %s\n", fallback.c_str());
  ModelLoadOptions load_options;
  load_options.device = device;
  const ModelSource model = resolve_model(o.model, load_options);
  o.perplexity.validate(model.config.max_positions);
  const int64_t window =
      o.perplexity.prefill + o.perplexity.decode_length(model.config.max_positions);

  const std::vector<EvalText> texts = read_texts(o, model, window);
  std::vector<std::vector<int32_t>> windows = eval_windows(texts, window, prompt_bos(model));
  const std::string what = texts.size() == 1
                               ? "--text " + texts[0].name + ": " +
                                     std::to_string(texts[0].ids.size()) + " tokens, shorter than"
                               : std::string("--text: no file holds");
  INFINIGEN_CHECK(!windows.empty(), what, " one window of ", window, " tokens (--prefill ",
                  o.perplexity.prefill, " + --decode ", window - o.perplexity.prefill, ")");
  for (const EvalText& text : texts) {
    if (static_cast<int64_t>(text.ids.size()) + 1 >= window) continue;
    std::fprintf(stderr, "infinigen: skipping %s: %zu tokens, shorter than a window of %lld\n",
                 text.name.c_str(), text.ids.size(), static_cast<long long>(window));
  }
  if (o.max_windows > 0 && static_cast<int64_t>(windows.size()) > o.max_windows) {
    windows.resize(static_cast<size_t>(o.max_windows));
  }
  // Every setting is planned before the first one runs: one that cannot fit is refused now, not
  // after the others have run for minutes.
  const int64_t batch = std::min<int64_t>(o.perplexity.batch, std::ssize(windows));
  for (const SweepPoint& p : points) {
    try {
      plan_offloaded_run(offload_memory_request(model.config, batch, o.perplexity.prefill,
                                                window - o.perplexity.prefill, kv_dtype, p.offload),
                         p.offload, device);
    } catch (const Error& e) {
      throw Error(
          cat(p.policy, p.settings.empty() ? "" : " (" + p.settings + ")", ": ", e.message()));
    }
  }
  fs::create_directories(o.out);
  INFINIGEN_CHECK(fs::is_directory(o.out), "--out ", o.out, ": cannot create the directory");
  {
    Progress progress(cat("evaluating ", counted(points.size(), "setting"), " on ",
                          counted(windows.size(), "window")));
    for (size_t i = 0; i < points.size(); ++i) {
      points[i].result = with_interrupt_context(
          [&] {
            return measure_perplexity(model, windows, o.perplexity, points[i].offload, device,
                                      kv_dtype, [&](int64_t done, int64_t total) {
                                        progress.update(
                                            static_cast<int64_t>(i) * total + done,
                                            static_cast<int64_t>(points.size()) * total);
                                      });
          },
          [&] {
            return cat(" in setting ", i + 1, " of ", points.size(), "; nothing was written to ",
                       o.out);
          });
    }
  }
  // The reference is the first policy that computes over every token (the full cache's result).
  double full_perplexity = 0;
  for (const SweepPoint& p : points) {
    if (full_perplexity == 0 && kv_policy(p.policy).exact) full_perplexity = p.result.perplexity();
  }

  const MachineInfo machine = this_machine(device);
  // The plot's title names the model briefly: its directory's name, not the whole path.
  const std::string model_name = is_builtin_model(o.model) ? "built-in model " + o.model
                                                           : fs::path(o.model).filename().string();
  nlohmann::json report = {{"model", model.description},
                           {"model_name", model_name.empty() ? o.model : model_name},
                           {"texts", o.texts},
                           {"windows", windows.size()},
                           {"prefill", o.perplexity.prefill},
                           {"decode", window - o.perplexity.prefill},
                           {"chunk", o.perplexity.chunk},
                           {"kv_dtype", dtype_name(kv_dtype)},
                           {"command", o.command_line},
                           {"commit", source_commit()},
                           {"machine", {{"cpu", machine.cpu}, {"device", machine.device}}},
                           {"points", nlohmann::json::array()}};
  for (const SweepPoint& p : points) report["points"].push_back(point_json(p, full_perplexity));
  const fs::path json_path = fs::path(o.out) / "eval.json";
  const fs::path csv_path = fs::path(o.out) / "eval.csv";
  write_text_file(json_path, report.dump(2) + "\n");
  write_text_file(csv_path, points_csv(points, full_perplexity));
  if (!o.no_plot) plot("plot_eval.py", json_path, fs::path(o.out) / "eval.png");
  if (o.json) {
    std::printf("%s\n", report.dump(2).c_str());
    return 0;
  }

  // The windows, once (the progress display names them only while it runs).
  std::printf("model: %s\n%s of %lld tokens: %lld prefilled, %lld scored one decode step each\n\n",
              model.description.c_str(), counted(windows.size(), "window").c_str(),
              static_cast<long long>(window), static_cast<long long>(o.perplexity.prefill),
              static_cast<long long>(window - o.perplexity.prefill));
  // KV loaded: share of the full KV (every earlier token, every head) loaded per decode step,
  // over all layers and over the speculated ones (past --dense-layers).
  std::printf("%-10s %-36s %10s %8s %10s %12s %7s\n", "policy", "settings", "perplexity", "vs full",
              "KV loaded", "speculated", "recall");
  for (const SweepPoint& p : points) {
    const PerplexityResult& r = p.result;
    char vs_full[16] = "-", recall[16] = "-";
    if (full_perplexity > 0) {
      std::snprintf(vs_full, sizeof vs_full, "%+.2f%%",
                    100.0 * (r.perplexity() / full_perplexity - 1.0));
    }
    if (r.mean_recall >= 0) std::snprintf(recall, sizeof recall, "%.3f", r.mean_recall);
    std::printf("%-10s %-36s %10.3f %8s %9.1f%% %11.1f%% %7s\n", p.policy.c_str(),
                p.settings.c_str(), r.perplexity(), vs_full, 100.0 * r.fetched,
                100.0 * r.speculated_fetched, recall);
  }
  std::printf("\nwrote %s\nwrote %s\n", csv_path.c_str(), json_path.c_str());
  if (!o.no_plot) std::printf("wrote %s\n", (fs::path(o.out) / "eval.png").c_str());
  return 0;
}

}  // namespace

Command add_eval_command(CLI::App& app) {
  auto o = std::make_shared<EvalCommandOptions>();
  app.add_option("--model,-m", o->model, "Checkpoint directory, or 'builtin' / 'builtin-llama'")
      ->capture_default_str();
  app.add_option("--text,-t", o->texts,
                 "Held-out text file(s); each is cut into windows from its start");
  app.add_option("--prefill", o->perplexity.prefill,
                 "Tokens of each window given as the prompt (BOS included)")
      ->capture_default_str();
  app.add_option("--decode", o->perplexity.decode,
                 "Tokens scored after the prompt, one decode step each (default: the rest of the "
                 "model's context)");
  app.add_option("--chunk", o->perplexity.chunk, "Positions per point of the chunked curve")
      ->capture_default_str();
  app.add_option("--batch,-b", o->perplexity.batch, "Windows decoded together")
      ->capture_default_str();
  app.add_option("--max-windows", o->max_windows, "Score at most this many windows (0 = all)")
      ->capture_default_str();
  app.add_option_function<std::vector<std::string>>(
         "--policy",
         [o](const std::vector<std::string>& names) {
           for (const std::string& name : names) kv_policy(name);
           o->policies = names;
         },
         policy_list_help("KV policies to compare (comma-separated):"))
      ->delimiter(',')
      ->default_str("full,infinigen");
  add_option_list_flags(app, offload_option_table(), o->sweeps, {"policy"});
  app.add_flag("--no-recall", o->no_recall,
               "infinigen: skip measuring the share of attention weight the fetched tokens carry");
  app.add_option("--device", o->device, "cpu, cuda or auto")->capture_default_str();
  app.add_option("--kv-dtype", o->kv_dtype, "KV cache element type: f16 or f32")
      ->check(float_type_in({DType::F16, DType::F32}))
      ->capture_default_str();
  add_threads_flag(app);
  app.add_option("--out,-o", o->out, "Directory for eval.csv, eval.json and eval.png")
      ->capture_default_str();
  app.add_flag("--no-plot", o->no_plot, "Write CSV and JSON only");
  app.add_flag("--json", o->json, "Print the results as JSON on stdout");
  return [o] {
    o->command_line = this_command_line();
    return eval(*o);
  };
}

}  // namespace infinigen::cli
