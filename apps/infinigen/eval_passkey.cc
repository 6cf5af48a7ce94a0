// apps/infinigen: the passkey task of `infinigen eval`.
#include "apps/infinigen/eval_passkey.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "apps/infinigen/option_flags.h"
#include "apps/infinigen/plot_script.h"
#include "core/output_directory.h"

namespace infinigen::cli {
namespace {

namespace fs = std::filesystem;

struct PasskeyPoint {
  EvalSetting setting;
  PasskeyResult result;
};

// The contents of a file a flag names; one-line Error when it cannot be read.
std::string read_flag_file(const std::string& flag, const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  INFINIGEN_CHECK(in.good() && !fs::is_directory(path), flag, " ", path,
                  ": no such file or not readable");
  std::ostringstream content;
  content << in.rdbuf();
  return content.str();
}

std::string percent(double share) {
  char text[16];
  std::snprintf(text, sizeof text, "%.1f%%", 100.0 * share);
  return text;
}

// "25%", "12.5%".
std::string depth_text(double depth) {
  return number(100.0 * depth) + "%";
}

std::string interval_text(const Interval& interval) {
  return "[" + percent(interval.low) + ", " + percent(interval.high) + "]";
}

// What a cell's score means with `trials` trials: the 95% Wilson intervals at 90% and at 100%.
nlohmann::json interval_json(int64_t trials) {
  const int64_t at_90 = std::llround(0.9 * static_cast<double>(trials));
  const Interval low = wilson_interval(at_90, trials), high = wilson_interval(trials, trials);
  return {{"trials", trials},
          {"confidence", 0.95},
          {"at_90", {{"correct", at_90}, {"low", low.low}, {"high", low.high}}},
          {"at_100", {{"correct", trials}, {"low", high.low}, {"high", high.high}}}};
}

nlohmann::json point_json(const PasskeyPoint& p) {
  const PasskeyResult& r = p.result;
  const Interval overall = wilson_interval(r.correct, r.trials);
  nlohmann::json j = {{"policy", p.setting.policy},
                      {"settings", p.setting.settings},
                      {"score", r.score()},
                      {"correct", r.correct},
                      {"trials", r.trials},
                      {"wilson_low", overall.low},
                      {"wilson_high", overall.high},
                      {"kv_fetched", r.fetched},
                      {"kv_fetched_speculated_layers", r.speculated_fetched},
                      {"seconds", r.seconds},
                      {"cells", nlohmann::json::array()},
                      {"misses", nlohmann::json::array()}};
  if (r.mean_recall >= 0) j["mean_recall"] = r.mean_recall;
  if (!r.needle_fetched.empty()) {
    // Per layer; null for a layer that loads every token.
    nlohmann::json& layers = j["layer_needle_fetched"] = nlohmann::json::array();
    for (const double share : r.needle_fetched) {
      layers.push_back(share >= 0 ? nlohmann::json(share) : nlohmann::json(nullptr));
    }
  }
  for (const PasskeyCellScore& cell : r.cells) {
    const Interval interval = cell.interval();
    j["cells"].push_back({{"length", cell.length},
                          {"depth", cell.depth},
                          {"trials", cell.trials},
                          {"correct", cell.correct},
                          {"score", cell.score()},
                          {"wilson_low", interval.low},
                          {"wilson_high", interval.high}});
  }
  for (const PasskeyMiss& miss : r.misses) {
    j["misses"].push_back({{"length", miss.length},
                           {"depth", miss.depth},
                           {"key", miss.key},
                           {"answer", miss.answer}});
  }
  return j;
}

std::string points_csv(const std::vector<PasskeyPoint>& points) {
  std::ostringstream csv;
  csv << "policy,settings,length,depth,trials,correct,score,wilson_low,wilson_high\n";
  for (const PasskeyPoint& p : points) {
    for (const PasskeyCellScore& cell : p.result.cells) {
      const Interval interval = cell.interval();
      csv << p.setting.policy << ",\"" << p.setting.settings << "\"," << cell.length << ","
          << cell.depth << "," << cell.trials << "," << cell.correct << "," << cell.score() << ","
          << interval.low << "," << interval.high << "\n";
    }
  }
  return csv.str();
}

// One setting's table: a row per length, a column per depth, each cell the % of exact answers.
void print_setting(const PasskeyPoint& p, const std::vector<double>& depths) {
  const PasskeyResult& r = p.result;
  std::printf("%s\n  %8s", p.setting.label().c_str(), "length");
  for (const double depth : depths) std::printf(" %6s", depth_text(depth).c_str());
  for (size_t c = 0; c < r.cells.size(); ++c) {
    if (c % depths.size() == 0) std::printf("\n  %8lld", static_cast<long long>(r.cells[c].length));
    std::printf(" %6.0f", 100.0 * r.cells[c].score());
  }
  std::printf("\n  score %s (%lld of %lld), 95%% interval %s; KV loaded %s, speculated layers %s",
              percent(r.score()).c_str(), static_cast<long long>(r.correct),
              static_cast<long long>(r.trials),
              interval_text(wilson_interval(r.correct, r.trials)).c_str(),
              percent(r.fetched).c_str(), percent(r.speculated_fetched).c_str());
  if (r.mean_recall >= 0) std::printf(", recall %.3f", r.mean_recall);
  std::printf("; %.1f s\n", r.seconds);
  if (!r.needle_fetched.empty()) {
    // The share of the needle's tokens each speculated layer selected at the first decode step.
    std::printf("  needle fetched at the first step, by layer:");
    for (size_t l = 0; l < r.needle_fetched.size(); ++l) {
      if (r.needle_fetched[l] >= 0) std::printf(" %zu %s", l, percent(r.needle_fetched[l]).c_str());
    }
    std::printf("\n");
  }
  if (!r.misses.empty()) {
    const PasskeyMiss& miss = r.misses.front();
    std::printf("  first miss: length %lld, depth %s, key %s, generated %s\n",
                static_cast<long long>(miss.length), depth_text(miss.depth).c_str(),
                miss.key.c_str(), nlohmann::json(miss.answer).dump().c_str());
  }
  std::printf("\n");
}

}  // namespace

std::vector<const CLI::Option*> add_passkey_flags(CLI::App& app, EvalPasskeyOptions& o) {
  const PasskeyOptions defaults;
  std::string depths;
  for (const double depth : defaults.depths) depths += (depths.empty() ? "" : ",") + number(depth);
  return {
      app.add_option("--lengths", o.task.lengths,
                     "passkey: prompt lengths in tokens, BOS included (default: 1/8, 1/4, 1/2 "
                     "and 3/4 of the model's context and the longest that leaves room for the "
                     "answer)")
          ->delimiter(','),
      app.add_option("--depths", o.task.depths,
                     "passkey: where the key goes, as fractions of the filler (0: its start, 1: "
                     "its end)")
          ->delimiter(',')
          ->default_str(depths),
      app.add_option("--trials", o.task.trials, "passkey: keys per (length, depth) cell")
          ->capture_default_str(),
      app.add_option_function<std::string>(
             "--key-kind",
             [&o](const std::string& kind) { o.task.key_kind = parse_passkey_key_kind(kind); },
             "passkey: digits (5 random digits) or word (a random common English word)")
          ->default_str(passkey_key_kind_name(defaults.key_kind)),
      app.add_option("--seed", o.task.seed, "passkey: seed of the keys and where the filler starts")
          ->check(unsigned_integer())
          ->capture_default_str(),
      app.add_option("--filler", o.filler,
                     "passkey: text file the filler is taken from, cycled (default: the bundled "
                     "calibration text)"),
      app.add_option("--passkey-template", o.template_path,
                     "passkey: JSON file of \"intro\", \"needle\" (holding {key}) and \"question\" "
                     "replacing the built-in strings")};
}

int eval_passkey(const EvalCommonOptions& common, const EvalPasskeyOptions& o) {
  const DType kv_dtype = parse_float_dtype(common.kv_dtype);  // checked by its flag
  const std::vector<EvalSetting> settings = eval_settings(common);
  const Device device = eval_device(settings, common.device);
  ModelLoadOptions load_options;
  load_options.device = device;
  const ModelSource model = resolve_model(common.model, load_options);
  INFINIGEN_CHECK(model.tokenizer.has_value(), model.description,
                  " has no tokenizer (tokenizer.json, or vocab.json and merges.txt) to write the "
                  "passkey prompts with");
  const PasskeyOptions& options = o.task;
  const int64_t max_positions = model.config.max_positions;
  options.validate(max_positions);
  const std::vector<int64_t> lengths = options.lengths_or_default(max_positions);
  const PasskeyTemplate text =
      o.template_path.empty()
          ? PasskeyTemplate::built_in()
          : PasskeyTemplate::from_json(read_flag_file("--passkey-template", o.template_path),
                                       "--passkey-template " + o.template_path);
  // A filler of several contexts' tokens: enough for every trial to start somewhere else.
  const size_t filler_tokens =
      static_cast<size_t>(4 * *std::max_element(lengths.begin(), lengths.end()));
  const PasskeyFiller filler =
      o.filler.empty() ? passkey_filler(*model.tokenizer, bundled_passkey_filler(),
                                        "the bundled text", filler_tokens)
                       : passkey_filler(*model.tokenizer, read_flag_file("--filler", o.filler),
                                        o.filler, filler_tokens);
  const std::vector<PasskeyCell> cells =
      passkey_cells(*model.tokenizer, prompt_bos(model), text, filler, options, max_positions);

  const int64_t per_length = options.trials * std::ssize(options.depths);
  // A prompt past the context runs what fits of it (--past-context).
  plan_eval_settings(settings, model.config, std::min(options.batch, per_length),
                     std::min(*std::max_element(lengths.begin(), lengths.end()),
                              max_positions - options.generated_bound()),
                     options.generated_bound(), kv_dtype, device);
  create_eval_out(common.out);
  std::vector<PasskeyPoint> points;
  for (const EvalSetting& setting : settings) points.push_back({setting, {}});
  run_eval_settings(points.size(), counted(cells.size() * options.trials, "passkey prompt"),
                    common.out, [&](size_t i, const EvalProgress& progress) {
                      points[i].result =
                          measure_passkey(model, cells, options, points[i].setting.offload, device,
                                          kv_dtype, progress);
                    });

  nlohmann::json report = eval_report_head("passkey", common, model, device);
  report["lengths"] = lengths;
  report["depths"] = options.depths;
  report["trials"] = options.trials;
  report["key_kind"] = passkey_key_kind_name(options.key_kind);
  report["seed"] = options.seed;
  report["batch"] = options.batch;
  report["filler"] = filler.name;
  report["past_context"] = past_context_name(options.past.mode);
  report["keep_prefix"] = options.past.keep_prefix;
  report["template"] = {
      {"intro", text.intro}, {"needle", text.needle}, {"question", text.question}};
  report["interval"] = interval_json(options.trials);
  report["points"] = nlohmann::json::array();
  for (const PasskeyPoint& p : points) report["points"].push_back(point_json(p));
  const fs::path json_path = fs::path(common.out) / "eval.json";
  const fs::path csv_path = fs::path(common.out) / "eval.csv";
  write_text_file(json_path, report.dump(2) + "\n");
  write_text_file(csv_path, points_csv(points));
  if (!common.no_plot) plot("plot_eval.py", json_path, fs::path(common.out) / "eval.png");
  if (common.json) {
    std::printf("%s\n", report.dump(2).c_str());
    return 0;
  }

  std::printf(
      "model: %s\npasskey retrieval: %s x %s, %s per cell (%s keys, seed %llu), filler "
      "from %s\n",
      model.description.c_str(), counted(lengths.size(), "length").c_str(),
      counted(options.depths.size(), "depth").c_str(),
      counted(static_cast<size_t>(options.trials), "trial").c_str(),
      passkey_key_kind_name(options.key_kind), static_cast<unsigned long long>(options.seed),
      filler.name.c_str());
  if (options.dropped(*std::max_element(lengths.begin(), lengths.end()), max_positions) > 0) {
    std::printf("past the context of %lld: %s, keeping the first %lld tokens\n",
                static_cast<long long>(max_positions), past_context_name(options.past.mode),
                static_cast<long long>(options.past.keep_prefix));
  }
  // What a cell's score can tell: its 95% interval at 90% (when the trials can score that) and
  // at 100%.
  const nlohmann::json& at_90 = report["interval"]["at_90"];
  const nlohmann::json& at_100 = report["interval"]["at_100"];
  std::printf("a cell's 95%% Wilson interval:");
  if (at_90["correct"].get<int64_t>() < options.trials) {
    std::printf(" %s at %lld of %lld correct,",
                interval_text({at_90["low"], at_90["high"]}).c_str(),
                static_cast<long long>(at_90["correct"].get<int64_t>()),
                static_cast<long long>(options.trials));
  }
  std::printf(" %s at %lld of %lld\n\n", interval_text({at_100["low"], at_100["high"]}).c_str(),
              static_cast<long long>(options.trials), static_cast<long long>(options.trials));
  for (const PasskeyPoint& p : points) print_setting(p, options.depths);
  std::printf("wrote %s\nwrote %s\n", csv_path.c_str(), json_path.c_str());
  if (!common.no_plot) std::printf("wrote %s\n", (fs::path(common.out) / "eval.png").c_str());
  return 0;
}

}  // namespace infinigen::cli
