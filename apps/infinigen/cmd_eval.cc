// apps/infinigen: `infinigen eval`, what a sweep of KV policies and their settings costs in
// accuracy, as a table, CSV, JSON and a plot: perplexity through the engine's decode loop
// (bench/perplexity.h; the default task) or passkey retrieval (eval_passkey.h).

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "apps/infinigen/commands.h"
#include "apps/infinigen/eval_common.h"
#include "apps/infinigen/eval_passkey.h"
#include "apps/infinigen/option_flags.h"
#include "apps/infinigen/plot_script.h"
#include "bench/perplexity.h"
#include "core/model_loader.h"
#include "core/output_directory.h"
#include "offload/kv_policy.h"
#include "offload/runtime.h"

namespace infinigen::cli {
namespace {

namespace fs = std::filesystem;

// Defaults come from the option structs below; only their spelling as flags lives here.
struct EvalCommandOptions {
  EvalCommonOptions common;
  std::string task = "perplexity";
  std::vector<std::string> texts;
  PerplexityOptions perplexity;
  int64_t max_windows = 0;
  EvalPasskeyOptions passkey;
  // The flags only one task reads, refused with the other.
  std::vector<const CLI::Option*> perplexity_flags, passkey_flags;
};

struct SweepPoint {
  EvalSetting setting;
  PerplexityResult result;
};

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
  nlohmann::json j = {{"policy", p.setting.policy},
                      {"settings", p.setting.settings},
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
    csv << p.setting.policy << ",\"" << p.setting.settings << "\"," << r.perplexity() << ","
        << (full_perplexity > 0 ? number(r.perplexity() / full_perplexity - 1.0) : "") << ","
        << r.fetched << "," << r.speculated_fetched << ","
        << (r.mean_recall >= 0 ? number(r.mean_recall) : "") << ","
        << (r.min_layer_recall >= 0 ? number(r.min_layer_recall) : "") << "," << r.tokens << ","
        << r.seconds << "\n";
  }
  return csv.str();
}

int eval_perplexity(EvalCommandOptions& o) {
  INFINIGEN_CHECK(o.max_windows >= 0, "--max-windows must be at least 1, got ", o.max_windows);
  const EvalCommonOptions& common = o.common;
  const DType kv_dtype = parse_float_dtype(common.kv_dtype);  // checked by its flag
  const std::vector<EvalSetting> settings = eval_settings(common);
  std::vector<SweepPoint> points;
  for (const EvalSetting& setting : settings) points.push_back({setting, {}});
  const Device device = eval_device(settings, common.device);
  ModelLoadOptions load_options;
  load_options.device = device;
  const ModelSource model = resolve_model(common.model, load_options);
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
  plan_eval_settings(settings, model.config,
                     std::min<int64_t>(o.perplexity.batch, std::ssize(windows)),
                     o.perplexity.planned_prompt(model.config.max_positions),
                     window - o.perplexity.prefill, kv_dtype, device);
  create_eval_out(common.out);
  run_eval_settings(points.size(), counted(windows.size(), "window"), common.out,
                    [&](size_t i, const EvalProgress& progress) {
                      points[i].result =
                          measure_perplexity(model, windows, o.perplexity,
                                             points[i].setting.offload, device, kv_dtype, progress);
                    });
  // The reference is the first policy that computes over every token (the full cache's result).
  double full_perplexity = 0;
  for (const SweepPoint& p : points) {
    if (full_perplexity == 0 && kv_policy(p.setting.policy).exact) {
      full_perplexity = p.result.perplexity();
    }
  }

  nlohmann::json report = eval_report_head("perplexity", common, model, device);
  report["texts"] = o.texts;
  report["windows"] = windows.size();
  report["prefill"] = o.perplexity.prefill;
  report["decode"] = window - o.perplexity.prefill;
  report["chunk"] = o.perplexity.chunk;
  report["past_context"] = past_context_name(o.perplexity.past.mode);
  report["keep_prefix"] = o.perplexity.past.keep_prefix;
  report["points"] = nlohmann::json::array();
  for (const SweepPoint& p : points) report["points"].push_back(point_json(p, full_perplexity));
  const fs::path json_path = fs::path(common.out) / "eval.json";
  const fs::path csv_path = fs::path(common.out) / "eval.csv";
  write_text_file(json_path, report.dump(2) + "\n");
  write_text_file(csv_path, points_csv(points, full_perplexity));
  if (!common.no_plot) plot("plot_eval.py", json_path, fs::path(common.out) / "eval.png");
  if (common.json) {
    std::printf("%s\n", report.dump(2).c_str());
    return 0;
  }

  // The windows, once (the progress display names them only while it runs).
  std::printf("model: %s\n%s of %lld tokens: %lld prefilled, %lld scored one decode step each\n",
              model.description.c_str(), counted(windows.size(), "window").c_str(),
              static_cast<long long>(window), static_cast<long long>(o.perplexity.prefill),
              static_cast<long long>(window - o.perplexity.prefill));
  if (const int64_t dropped = o.perplexity.dropped(model.config.max_positions); dropped > 0) {
    std::printf("past the context of %lld: %s, %lld tokens dropped after the first %lld\n",
                static_cast<long long>(model.config.max_positions),
                past_context_name(o.perplexity.past.mode), static_cast<long long>(dropped),
                static_cast<long long>(o.perplexity.past.keep_prefix));
  }
  std::printf("\n");
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
    std::printf("%-10s %-36s %10.3f %8s %9.1f%% %11.1f%% %7s\n", p.setting.policy.c_str(),
                p.setting.settings.c_str(), r.perplexity(), vs_full, 100.0 * r.fetched,
                100.0 * r.speculated_fetched, recall);
  }
  std::printf("\nwrote %s\nwrote %s\n", csv_path.c_str(), json_path.c_str());
  if (!common.no_plot) std::printf("wrote %s\n", (fs::path(common.out) / "eval.png").c_str());
  return 0;
}

// Refuses a flag that the chosen task does not read.
void check_task_flags(const EvalCommandOptions& o) {
  const bool passkey = o.task == "passkey";
  for (const CLI::Option* flag : passkey ? o.perplexity_flags : o.passkey_flags) {
    INFINIGEN_CHECK(flag->count() == 0, flag->get_name(), " is for --task ",
                    passkey ? "perplexity" : "passkey", ", not --task ", o.task);
  }
}

int eval(EvalCommandOptions& o) {
  check_task_flags(o);
  if (o.task == "passkey") {
    o.passkey.task.batch = o.perplexity.batch;  // --batch and --past-context, read by both tasks
    o.passkey.task.past = o.perplexity.past;
    return eval_passkey(o.common, o.passkey);
  }
  return eval_perplexity(o);
}

}  // namespace

Command add_eval_command(CLI::App& app) {
  auto o = std::make_shared<EvalCommandOptions>();
  EvalCommonOptions& common = o->common;
  app.add_option("--task", o->task,
                 "perplexity (held-out text, teacher-forced) or passkey (a key hidden in filler "
                 "text, retrieved by greedy generation)")
      ->check(CLI::IsMember({"perplexity", "passkey"}))
      ->capture_default_str();
  app.add_option("--model,-m", common.model, "Checkpoint directory, or 'builtin' / 'builtin-llama'")
      ->capture_default_str();
  o->perplexity_flags = {
      app.add_option("--text,-t", o->texts,
                     "perplexity: held-out text file(s); each is cut into windows from its start"),
      app.add_option("--prefill", o->perplexity.prefill,
                     "perplexity: tokens of each window given as the prompt (BOS included)")
          ->capture_default_str(),
      app.add_option("--decode", o->perplexity.decode,
                     "perplexity: tokens scored after the prompt, one decode step each (default: "
                     "the rest of the model's context)"),
      app.add_option("--chunk", o->perplexity.chunk,
                     "perplexity: positions per point of the chunked curve")
          ->capture_default_str(),
      app.add_option("--max-windows", o->max_windows,
                     "perplexity: score at most this many windows (0 = all)")
          ->capture_default_str()};
  o->passkey_flags = add_passkey_flags(app, o->passkey);
  app.add_option("--batch,-b", o->perplexity.batch,
                 "Windows (perplexity), or prompts of one length (passkey), decoded together")
      ->capture_default_str();
  // Read by both tasks: a window (perplexity) or a prompt (passkey) past the model's context.
  const PastContextOptions past_defaults;
  app.add_option_function<std::string>(
         "--past-context",
         [o](const std::string& mode) { o->perplexity.past.mode = parse_past_context(mode); },
         "A window (perplexity: --prefill plus --decode) or a prompt (passkey: --lengths) past "
         "the model's context is refused, runs as two turns of a session whose second drops the "
         "oldest history after --keep-prefix (drop-oldest: the kept KV moved, "
         "docs/sessions.md), or runs once over the same kept tokens (recompute)")
      ->default_str(past_context_name(past_defaults.mode));
  app.add_option("--keep-prefix", o->perplexity.past.keep_prefix,
                 "Tokens a window or prompt past the context keeps before what it drops")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str();
  app.add_option_function<std::vector<std::string>>(
         "--policy",
         [o](const std::vector<std::string>& names) {
           for (const std::string& name : names) kv_policy(name);
           o->common.policies = names;
         },
         policy_list_help("KV policies to compare (comma-separated):"))
      ->delimiter(',')
      ->default_str("full,infinigen");
  add_option_list_flags(app, offload_option_table(), common.sweeps, {"policy"});
  app.add_flag("--no-recall", common.no_recall,
               "infinigen: skip measuring the share of attention weight the fetched tokens carry");
  app.add_option("--device", common.device, "cpu, cuda or auto")->capture_default_str();
  app.add_option("--kv-dtype", common.kv_dtype, "KV cache element type: f16 or f32")
      ->check(float_type_in({DType::F16, DType::F32}))
      ->capture_default_str();
  add_threads_flag(app);
  app.add_option("--out,-o", common.out, "Directory for eval.csv, eval.json and eval.png")
      ->capture_default_str();
  app.add_flag("--no-plot", common.no_plot, "Write CSV and JSON only");
  app.add_flag("--json", common.json, "Print the results as JSON on stdout");
  return [o] {
    o->common.command_line = this_command_line();
    return eval(*o);
  };
}

}  // namespace infinigen::cli
