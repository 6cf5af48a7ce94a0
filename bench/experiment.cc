// bench: reading experiment files and shrinking their points.
#include "bench/experiment.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>

#include "core/error.h"
#include "core/resources.h"
#include "core/yaml_text.h"

namespace infinigen {
namespace {

const IntegerSetting* find_integer_setting(const std::string& key) {
  for (const IntegerSetting& setting : integer_settings()) {
    if (key == setting.key) return &setting;
  }
  return nullptr;
}

// Whether `key` names a setting (the model, an integer setting or an offload option).
bool is_setting(const std::string& key) {
  return key == "model" || find_integer_setting(key) != nullptr ||
         find_option(offload_option_table(), key) != nullptr;
}

// "model, batch, prompt_len, ...": the run's keys, for messages.
std::string run_keys() {
  std::string keys = "model";
  for (const IntegerSetting& setting : integer_settings()) keys += cat(", ", setting.key);
  return keys;
}

const std::set<std::string> kPlots = {"latency", "speedup", "fetched", "block", "ttft", "transfer"};

// Reads scalars with one-line errors naming the file and key.
class Reader {
 public:
  explicit Reader(std::string source) : source_(std::move(source)) {}

  template <typename T>
  T scalar(const YAML::Node& node, const std::string& key) const {
    INFINIGEN_CHECK(node.IsScalar(), source_, ": ", key, " must be a single value");
    try {
      return node.as<T>();
    } catch (const YAML::Exception&) {
      fail(source_, ": ", key, " = '", node.Scalar(), "' is not ",
           std::is_same_v<T, std::string> ? "text" : "a number");
    }
  }

  void settings(const YAML::Node& map, BenchSettings& s, const std::string& where) const {
    INFINIGEN_CHECK(map.IsMap(), source_, ": ", where, " must be a map of settings");
    for (const auto& item : map) {
      const std::string key = yaml_key(item.first, source_);
      const std::string path = where + "." + key;
      if (key == "model") {
        s.model = scalar<std::string>(item.second, path);
      } else if (const IntegerSetting* setting = find_integer_setting(key)) {
        s.*(setting->member) = scalar<int64_t>(item.second, path);
      } else if (const OptionSpec<OffloadOptions>* spec =
                     find_option(offload_option_table(), key)) {
        try {
          spec->parse(s.offload, scalar<std::string>(item.second, path));
        } catch (const Error& e) {
          fail(source_, ": ", where, ": ", e.what());  // option keys as the file spells them
        }
      } else if (key != "panel") {
        fail(source_, ": unknown setting '", path, "' (known: ", run_keys(), ", ",
             option_keys(offload_option_table()), ")");
      }
    }
  }

  void check(const BenchSettings& s, const std::string& where) const {
    const auto need = [&](bool ok, const char* key, const auto& value, const char* what) {
      INFINIGEN_CHECK(ok, source_, ": ", where, ".", key, " = ", value, " ", what);
    };
    need(s.batch >= 1, "batch", s.batch, "must be at least 1");
    need(s.prompt_len >= 2, "prompt_len", s.prompt_len, "must be at least 2");
    need(s.gen_len >= 2, "gen_len", s.gen_len, "must be at least 2");
    need(s.history_len >= 0, "history_len", s.history_len, "must be at least 0");
    need(s.shared_prefix_len >= 0 && s.shared_prefix_len < s.prompt_len, "shared_prefix_len",
         s.shared_prefix_len, "must be at least 0 and below prompt_len");
    need(s.shared_prefix_len == 0 || s.history_len == 0, "shared_prefix_len", s.shared_prefix_len,
         "cannot be combined with history_len (a conversation's turn shares nothing)");
    need(s.shared_prefix_groups >= 1 && s.shared_prefix_groups <= s.batch, "shared_prefix_groups",
         s.shared_prefix_groups, "must be at least 1 and at most batch");
    try {
      s.offload.validate();  // the runtime's own rules
    } catch (const Error& e) {
      fail(source_, ": ", where, ": ", e.what());
    }
  }

  const std::string& source() const { return source_; }

 private:
  std::string source_;
};

}  // namespace

Experiment parse_experiment(const std::string& text, const std::string& source,
                            const std::string& stem) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    fail(source, ": not valid YAML (line ", e.mark.line + 1, ": ", e.msg, ")");
  }
  const Reader r(source);
  INFINIGEN_CHECK(root.IsMap(), source, ": expected a map of experiment keys");
  Experiment e;
  e.name = stem;
  BenchSettings defaults;
  std::vector<std::string> policies;
  YAML::Node points;
  for (const auto& item : root) {
    const std::string key = yaml_key(item.first, source);
    const YAML::Node& v = item.second;
    if (key == "name") {
      e.name = r.scalar<std::string>(v, key);
    } else if (key == "figure") {
      e.figure = r.scalar<std::string>(v, key);
    } else if (key == "title") {
      e.title = r.scalar<std::string>(v, key);
    } else if (key == "x") {
      e.x_key = r.scalar<std::string>(v, key);
    } else if (key == "plot") {
      e.plot = r.scalar<std::string>(v, key);
    } else if (key == "repeats") {
      e.repeats = r.scalar<int>(v, key);
    } else if (key == "link_gbps") {
      e.link_gbps = r.scalar<double>(v, key);
    } else if (key == "defaults") {
      r.settings(v, defaults, key);
    } else if (key == "policies") {
      INFINIGEN_CHECK(v.IsSequence() && v.size() > 0, source,
                      ": policies must be a non-empty list");
      for (const auto& p : v) policies.push_back(r.scalar<std::string>(p, key));
    } else if (key == "points") {
      INFINIGEN_CHECK(v.IsSequence() && v.size() > 0, source, ": points must be a non-empty list");
      points = v;
    } else if (key == "paper") {
      INFINIGEN_CHECK(v.IsMap(), source, ": paper must be a map with source and values");
      for (const auto& p : v) {
        const std::string pkey = yaml_key(p.first, source);
        if (pkey == "source") {
          e.paper_source = r.scalar<std::string>(p.second, "paper.source");
        } else if (pkey == "values") {
          INFINIGEN_CHECK(p.second.IsSequence(), source, ": paper.values must be a list");
          for (const auto& entry : p.second) {
            INFINIGEN_CHECK(entry.IsMap(), source, ": each paper.values entry must be a map");
            std::map<std::string, std::string> match;
            std::vector<std::pair<std::string, double>> metrics;
            for (const auto& kv : entry) {
              const std::string k = yaml_key(kv.first, source);
              if (is_setting(k) || k == "panel" || k == "total_len") {
                match[k] = r.scalar<std::string>(kv.second, "paper.values." + k);
              } else {
                metrics.emplace_back(k, r.scalar<double>(kv.second, "paper.values." + k));
              }
            }
            INFINIGEN_CHECK(!metrics.empty(), source, ": a paper.values entry has no number");
            for (const auto& [metric, value] : metrics) e.paper.push_back({match, metric, value});
          }
        } else {
          fail(source, ": unknown key 'paper.", pkey, "' (known: source, values)");
        }
      }
    } else {
      fail(source, ": unknown key '", key,
           "' (known: name, figure, title, x, plot, repeats, link_gbps, defaults, policies, "
           "points, paper)");
    }
  }
  INFINIGEN_CHECK(!e.x_key.empty(), source, ": x (the key on the x axis) is missing");
  INFINIGEN_CHECK(is_setting(e.x_key) || e.x_key == "total_len", source, ": x = '", e.x_key,
                  "' is not a setting");
  INFINIGEN_CHECK(kPlots.count(e.plot), source, ": plot = '", e.plot,
                  "' is not one of latency, speedup, fetched, block");
  INFINIGEN_CHECK(e.repeats >= 1, source, ": repeats must be at least 1, got ", e.repeats);
  INFINIGEN_CHECK(e.link_gbps > 0, source, ": link_gbps must be positive, got ", e.link_gbps);
  if (policies.empty()) policies.push_back(defaults.offload.policy);

  std::vector<std::pair<std::string, BenchSettings>> overrides;
  if (points.IsSequence()) {
    for (size_t i = 0; i < points.size(); ++i) {
      const std::string where = cat("points[", i, "]");
      BenchSettings s = defaults;
      r.settings(points[i], s, where);
      const std::string panel =
          points[i]["panel"] ? r.scalar<std::string>(points[i]["panel"], where + ".panel") : "";
      overrides.emplace_back(panel, s);
    }
  } else {
    overrides.emplace_back("", defaults);
  }
  for (size_t i = 0; i < overrides.size(); ++i) {
    for (const std::string& policy : policies) {
      ExperimentPoint p;
      p.panel = overrides[i].first;
      p.settings = overrides[i].second;
      p.settings.offload.policy = policy;
      r.check(p.settings, cat("points[", i, "]"));
      // A panel named after a setting (fig17's "partial_ratio") has that setting on its x axis.
      p.x = settings_value(p.settings, is_setting(p.panel) ? p.panel : e.x_key);
      e.points.push_back(std::move(p));
    }
  }
  return e;
}

namespace {

int64_t scaled(int64_t value, double scale, int64_t minimum) {
  return std::max<int64_t>(minimum, std::llround(static_cast<double>(value) * scale));
}

}  // namespace

const std::vector<IntegerSetting>& integer_settings() {
  static const std::vector<IntegerSetting> settings = {
      {"batch", &BenchSettings::batch},
      {"prompt_len", &BenchSettings::prompt_len},
      {"gen_len", &BenchSettings::gen_len},
      {"history_len", &BenchSettings::history_len},
      {"shared_prefix_len", &BenchSettings::shared_prefix_len},
      {"shared_prefix_groups", &BenchSettings::shared_prefix_groups}};
  return settings;
}

std::string settings_value(const BenchSettings& s, const std::string& key) {
  if (key == "model") return s.model;
  if (const IntegerSetting* setting = find_integer_setting(key)) {
    return std::to_string(s.*(setting->member));
  }
  if (key == "total_len") return std::to_string(s.prompt_len + s.gen_len);
  if (const OptionSpec<OffloadOptions>* spec = find_option(offload_option_table(), key)) {
    return spec->format(s.offload);
  }
  fail("unknown experiment setting '", key, "'");
}

std::map<std::string, double> paper_values_for(const Experiment& experiment,
                                               const BenchSettings& settings) {
  std::map<std::string, double> values;
  for (const PaperValue& v : experiment.paper) {
    bool all = true;
    for (const auto& [key, text] : v.match) {
      if (key == "panel") continue;
      // Numbers compare by value, so "0.3" matches 0.30.
      const std::string ours = settings_value(settings, key);
      char* end = nullptr;
      const double a = std::strtod(text.c_str(), &end);
      const bool numeric = end && *end == '\0' && !text.empty();
      all =
          all && (numeric ? std::abs(a - std::strtod(ours.c_str(), nullptr)) < 1e-9 : ours == text);
    }
    if (all) values[v.metric] = v.value;
  }
  return values;
}

Experiment load_experiment(const std::string& path_or_name) {
  namespace fs = std::filesystem;
  if (fs::exists(path_or_name)) {
    INFINIGEN_CHECK(fs::is_regular_file(path_or_name), option("experiment"), " ", path_or_name,
                    ": not a file");
    std::ifstream in(path_or_name);
    INFINIGEN_CHECK(in.good(), option("experiment"), " ", path_or_name, ": cannot be read");
    const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    return parse_experiment(text, path_or_name, fs::path(path_or_name).stem().string());
  }
  const auto text = embedded_config("experiments/" + path_or_name + ".yaml");
  if (!text) {
    std::string known;
    for (const std::string& name : bundled_experiment_names()) known += " " + name;
    fail(option("experiment"), " ", path_or_name,
         ": no such file, and not a bundled experiment (bundled:", known, ")");
  }
  return parse_experiment(std::string(*text), "configs/experiments/" + path_or_name + ".yaml",
                          path_or_name);
}

std::vector<std::string> bundled_experiment_names() {
  std::vector<std::string> names;
  for (const std::string& path : embedded_configs_in("experiments")) {
    const std::string file = path.substr(path.rfind('/') + 1);
    names.push_back(file.substr(0, file.size() - 5));  // strip ".yaml"
  }
  return names;
}

ModelConfig scaled_model_config(const ModelConfig& config, double scale) {
  if (scale == 1.0) return config;
  ModelConfig c = config;
  const int64_t d = config.head_dim(), group = config.num_heads / config.kv_heads();
  c.num_layers = scaled(config.num_layers, scale, 4);
  // Query heads shrink with the KV heads, so that every KV head keeps its group of queries.
  const int64_t kv_heads = scaled(config.kv_heads(), scale, group > 1 ? 1 : 2);
  c.num_heads = kv_heads * group;
  c.num_kv_heads = config.num_kv_heads > 0 ? kv_heads : 0;
  c.hidden_size = c.num_heads * d;
  c.explicit_head_dim = config.explicit_head_dim > 0 ? d : 0;
  // The FFN keeps its ratio to the width (4 for OPT, about 2.7 to 5.3 for the Llama family).
  c.ffn_dim = std::max<int64_t>(1, config.ffn_dim * c.hidden_size / config.hidden_size);
  c.vocab_size = scaled(config.vocab_size, scale * scale, 1024);
  // Special tokens stay inside the smaller vocabulary (Llama 3's are near its end).
  for (int32_t* id : {&c.bos_token_id, &c.eos_token_id, &c.pad_token_id}) {
    *id = static_cast<int32_t>(std::min<int64_t>(*id, c.vocab_size - 1));
  }
  c.name = cat(config.name, " at scale ", scale);
  return c;
}

ScaledPoint scale_point(const ModelConfig& config, const BenchSettings& settings, double scale) {
  ScaledPoint p{scaled_model_config(config, scale), settings};
  if (scale == 1.0) return p;
  // Batch shrinks by sqrt(scale), rounded up, so that a sweep over batch sizes keeps distinct
  // points (fig15's 4..20 at scale 0.05 becomes 1..5).
  p.settings.batch = std::max<int64_t>(
      1, static_cast<int64_t>(
             std::ceil(static_cast<double>(settings.batch) * std::sqrt(scale) - 1e-9)));
  p.settings.prompt_len = scaled(settings.prompt_len, scale, 16);
  p.settings.gen_len = scaled(settings.gen_len, scale, 4);
  if (settings.history_len > 0) p.settings.history_len = scaled(settings.history_len, scale, 16);
  // A prompt in chunks stays in about as many chunks.
  if (settings.offload.prefill_chunk > 0) {
    p.settings.offload.prefill_chunk = scaled(settings.offload.prefill_chunk, scale, 8);
  }
  p.settings.shared_prefix_groups = std::min(settings.shared_prefix_groups, p.settings.batch);
  if (settings.shared_prefix_len > 0) {
    p.settings.shared_prefix_len =
        std::min(scaled(settings.shared_prefix_len, scale, 1), p.settings.prompt_len - 1);
  }
  return p;
}

}  // namespace infinigen
