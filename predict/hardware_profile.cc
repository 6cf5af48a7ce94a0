// predict: loading, checking and writing hardware profiles (YAML).
#include "predict/hardware_profile.h"

#include <yaml-cpp/yaml.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "core/output_directory.h"
#include "core/resources.h"
#include "core/yaml_text.h"

namespace infinigen {
namespace {

// A numeric field: its member and the smallest value it may take (exclusive for rates, which
// must be positive; inclusive where zero means "none").
struct NumericField {
  const char* key;
  double HardwareProfile::*member;
  double minimum;
  bool minimum_allowed;
  const char* meaning;  // for the written file's comments
};

constexpr NumericField kNumericFields[] = {
    {"device_memory_bytes", &HardwareProfile::device_memory_bytes, 0, false, "bytes"},
    {"gemm_flops", &HardwareProfile::gemm_flops, 0, false, "FLOP/s, fp16 GEMM, fp32 accumulate"},
    {"device_memory_bytes_per_s", &HardwareProfile::device_memory_bytes_per_s, 0, false,
     "B/s, decode-shape weight streaming from device memory"},
    {"device_cache_bytes", &HardwareProfile::device_cache_bytes, 0, true,
     "bytes of last-level cache (0 = none)"},
    {"attention_flops", &HardwareProfile::attention_flops, 0, false, "FLOP/s, prefill attention"},
    {"attention_bytes_per_s", &HardwareProfile::attention_bytes_per_s, 0, false,
     "B/s of KV read by decode attention"},
    {"elementwise_bytes_per_s", &HardwareProfile::elementwise_bytes_per_s, 0, false,
     "B/s, LayerNorm, residual adds, KV row writes"},
    {"kv_codec_bytes_per_s", &HardwareProfile::kv_codec_bytes_per_s, 0, false,
     "fp16 B/s coded by int4 quantise/dequantise"},
    {"speculation_bytes_per_s", &HardwareProfile::speculation_bytes_per_s, 0, false,
     "partial-key B/s scanned by speculation"},
    {"speculation_flops", &HardwareProfile::speculation_flops, 0, false,
     "FLOP/s of speculation's query-head x partial-key products"},
    {"scoring_flops", &HardwareProfile::scoring_flops, 0, false,
     "FLOP/s of the h2o policy's per-entry score accumulation"},
    {"op_overhead_s", &HardwareProfile::op_overhead_s, 0, true, "s per op"},
    {"h2d_bytes_per_s", &HardwareProfile::h2d_bytes_per_s, 0, false, "B/s host to device"},
    {"d2h_bytes_per_s", &HardwareProfile::d2h_bytes_per_s, 0, false, "B/s device to host"},
    {"transfer_latency_s", &HardwareProfile::transfer_latency_s, 0, true, "s per transfer"},
    {"link_emulation_overhead_s", &HardwareProfile::link_emulation_overhead_s, 0, true,
     "s per emulated transfer beyond the requested time (CPU backend)"},
    {"disk_read_bytes_per_s", &HardwareProfile::disk_read_bytes_per_s, 0, true,
     "B/s of sequential disk reads of a session (0 = not given)"},
    {"host_copy_bytes_per_s", &HardwareProfile::host_copy_bytes_per_s, 0, false,
     "B/s, one host thread, contiguous runs"},
    {"host_row_copy_bytes_per_s", &HardwareProfile::host_row_copy_bytes_per_s, 0, false,
     "B/s, one host thread copying scattered KV rows"},
    {"host_gather_bytes_per_s", &HardwareProfile::host_gather_bytes_per_s, 0, false,
     "B/s, host threads gathering scattered KV rows"},
    {"compute_slowdown_under_copy", &HardwareProfile::compute_slowdown_under_copy, 1, true,
     "factor >= 1"},
    {"copy_slowdown_under_compute", &HardwareProfile::copy_slowdown_under_compute, 1, true,
     "factor >= 1"},
};

constexpr const char* kStringFields[] = {"name", "description", "backend"};

constexpr const char* kLinearTableField = "linear_table";

bool is_known_field(const std::string& key) {
  if (key == kLinearTableField) return true;
  for (const char* s : kStringFields) {
    if (key == s) return true;
  }
  for (const NumericField& f : kNumericFields) {
    if (key == f.key) return true;
  }
  return false;
}

// yaml-cpp messages can span lines; errors here are one line.
std::string one_line(std::string text) {
  for (char& c : text) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  return text;
}

std::string string_field(const YAML::Node& root, const char* key, const std::string& source) {
  const YAML::Node node = root[key];
  INFINIGEN_CHECK(node, source, ": missing field '", key, "'");
  INFINIGEN_CHECK(node.IsScalar() && !node.Scalar().empty(), source, ": field '", key,
                  "' must be a non-empty string");
  return node.Scalar();
}

double numeric_field(const YAML::Node& root, const NumericField& field, const std::string& source) {
  const YAML::Node node = root[field.key];
  INFINIGEN_CHECK(node, source, ": missing field '", field.key, "'");
  double value = NAN;
  bool parsed = node.IsScalar();
  if (parsed) {
    try {
      value = node.as<double>();
    } catch (const YAML::Exception&) {
      parsed = false;
    }
  }
  INFINIGEN_CHECK(parsed, source, ": field '", field.key, "' must be a number, got '",
                  one_line(YAML::Dump(node)), "'");
  const bool ok = field.minimum_allowed ? value >= field.minimum : value > field.minimum;
  INFINIGEN_CHECK(ok, source, ": field '", field.key, "' must be ",
                  field.minimum_allowed ? ">= " : "> ", field.minimum, ", got ", node.Scalar());
  return value;
}

bool looks_like_path(const std::string& spec) {
  return spec.find('/') != std::string::npos || spec.ends_with(".yaml") || spec.ends_with(".yml");
}

std::string number(double value) {
  if (std::isinf(value)) return value > 0 ? ".inf" : "-.inf";
  char text[64];
  std::snprintf(text, sizeof(text), "%.6g", value);
  return text;
}

// A YAML double-quoted scalar.
std::string quoted(const std::string& text) {
  std::string out = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out + "\"";
}

std::vector<double> number_list(const YAML::Node& node, const std::string& where,
                                const std::string& source) {
  INFINIGEN_CHECK(node && node.IsSequence(), source, ": field '", where,
                  "' must be a list of numbers");
  std::vector<double> out;
  for (const YAML::Node& item : node) {
    double value = NAN;
    if (item.IsScalar()) {
      try {
        value = item.as<double>();
      } catch (const YAML::Exception&) {
      }
    }
    INFINIGEN_CHECK(std::isfinite(value), source, ": field '", where, "' must hold numbers, got '",
                    one_line(YAML::Dump(item)), "'");
    out.push_back(value);
  }
  return out;
}

std::vector<int64_t> integer_list(const YAML::Node& node, const std::string& where,
                                  const std::string& source) {
  std::vector<int64_t> out;
  for (double v : number_list(node, where, source)) {
    INFINIGEN_CHECK(v == std::floor(v), source, ": field '", where, "' must hold integers, got ",
                    v);
    out.push_back(static_cast<int64_t>(v));
  }
  return out;
}

// A map's keys must all be in `known`; `where` prefixes them in the error.
void check_keys(const YAML::Node& map, std::initializer_list<const char*> known,
                const std::string& where, const std::string& source) {
  for (const auto& item : map) {
    const std::string key = yaml_key(item.first, source);
    bool ok = false;
    for (const char* k : known) ok = ok || key == k;
    INFINIGEN_CHECK(ok, source, ": unknown field '", where, key, "'");
  }
}

LinearCostGrid linear_grid(const YAML::Node& table, const char* placement,
                           const std::string& source) {
  const std::string where = cat(kLinearTableField, ".", placement);
  const YAML::Node node = table[placement];
  INFINIGEN_CHECK(node && node.IsMap(), source, ": field '", where,
                  "' must be a map with fixed_s and bytes_per_s");
  check_keys(node, {"fixed_s", "bytes_per_s"}, where + ".", source);
  LinearCostGrid grid;
  for (const auto& [key, cells] :
       {std::pair{"fixed_s", &grid.fixed_s}, std::pair{"bytes_per_s", &grid.bytes_per_s}}) {
    const std::string field = where + "." + key;
    const YAML::Node rows = node[key];
    INFINIGEN_CHECK(rows && rows.IsSequence(), source, ": field '", field,
                    "' must be a list (one per k) of lists (one per rows) of numbers");
    for (const YAML::Node& row : rows) cells->push_back(number_list(row, field, source));
  }
  return grid;
}

LinearCostTable parse_linear_table(const YAML::Node& node, const std::string& source) {
  INFINIGEN_CHECK(node.IsMap(), source, ": field '", kLinearTableField,
                  "' must be a map with rows, k, memory and cache");
  const std::string prefix = cat(kLinearTableField, ".");
  check_keys(node, {"rows", "k", "memory", "cache"}, prefix, source);
  LinearCostTable table;
  table.rows = integer_list(node["rows"], prefix + "rows", source);
  table.k = integer_list(node["k"], prefix + "k", source);
  table.memory = linear_grid(node, "memory", source);
  table.cache = linear_grid(node, "cache", source);
  check_linear_cost_table(table, source);
  return table;
}

template <typename T>
std::string flow_list(const std::vector<T>& values) {
  std::string out = "[";
  for (size_t i = 0; i < values.size(); ++i) {
    out += (i ? ", " : "") + number(static_cast<double>(values[i]));
  }
  return out + "]";
}

// The `linear_table:` lines of a profile file (none for an empty table).
std::string linear_table_yaml(const LinearCostTable& table) {
  if (table.empty()) return "";
  std::string out = cat(kLinearTableField,
                        ":  # s = fixed_s + weight bytes / bytes_per_s, per [k][rows]; see "
                        "predict/linear_cost_table.h\n");
  out += "  rows: " + flow_list(table.rows) + "\n";
  out += "  k: " + flow_list(table.k) + "\n";
  for (const auto& [name, grid] :
       {std::pair{"memory", &table.memory}, std::pair{"cache", &table.cache}}) {
    out += cat("  ", name, ":\n    fixed_s:\n");
    for (const std::vector<double>& row : grid->fixed_s) out += "      - " + flow_list(row) + "\n";
    out += "    bytes_per_s:\n";
    for (const std::vector<double>& row : grid->bytes_per_s) {
      out += "      - " + flow_list(row) + "\n";
    }
  }
  return out;
}

}  // namespace

HardwareProfile parse_hardware_profile(const std::string& yaml, const std::string& source) {
  YAML::Node root;
  try {
    root = YAML::Load(yaml);
  } catch (const YAML::Exception& e) {
    fail(source, ": not valid YAML (", one_line(e.what()), ")");
  }
  INFINIGEN_CHECK(root.IsMap(), source, ": expected a YAML map of profile fields");
  for (const auto& item : root) {
    const std::string key = yaml_key(item.first, source);
    INFINIGEN_CHECK(key == "sources" || is_known_field(key), source, ": unknown field '", key, "'");
  }
  HardwareProfile p;
  p.name = string_field(root, "name", source);
  p.description = string_field(root, "description", source);
  p.backend = string_field(root, "backend", source);
  INFINIGEN_CHECK(p.backend == "cuda" || p.backend == "cpu", source,
                  ": field 'backend' must be cuda or cpu, got '", p.backend, "'");
  for (const NumericField& field : kNumericFields)
    p.*field.member = numeric_field(root, field, source);
  if (const YAML::Node table = root[kLinearTableField]) {
    p.linear_table = parse_linear_table(table, source);
  }
  if (const YAML::Node sources = root["sources"]) {
    INFINIGEN_CHECK(sources.IsMap(), source, ": field 'sources' must be a map of field: text");
    for (const auto& item : sources) {
      const std::string key = yaml_key(item.first, source);
      INFINIGEN_CHECK(is_known_field(key), source, ": field 'sources' names unknown field '", key,
                      "'");
      INFINIGEN_CHECK(item.second.IsScalar(), source, ": field 'sources." + key,
                      "' must be a string");
      p.sources[key] = item.second.Scalar();
    }
  }
  return p;
}

std::vector<std::string> hardware_profile_names() {
  std::vector<std::string> names;
  for (const std::string& path : embedded_configs_in("hardware")) {
    if (!path.ends_with(".yaml")) continue;
    names.push_back(path.substr(9, path.size() - 9 - 5));  // strip "hardware/" and ".yaml"
  }
  return names;
}

HardwareProfile load_hardware_profile(const std::string& name_or_path) {
  if (looks_like_path(name_or_path)) {
    INFINIGEN_CHECK(std::filesystem::is_regular_file(name_or_path), name_or_path,
                    ": no such hardware profile file");
    std::ifstream in(name_or_path);
    INFINIGEN_CHECK(in.good(), name_or_path, ": cannot be read");
    std::stringstream text;
    text << in.rdbuf();
    return parse_hardware_profile(text.str(), name_or_path);
  }
  const auto text = embedded_config("hardware/" + name_or_path + ".yaml");
  if (!text) {
    std::string known;
    for (const std::string& name : hardware_profile_names()) {
      known += (known.empty() ? "" : ", ") + name;
    }
    fail("unknown hardware profile '", name_or_path, "' (profiles: ", known,
         "; or a path to a .yaml file)");
  }
  return parse_hardware_profile(std::string(*text), "configs/hardware/" + name_or_path + ".yaml");
}

std::string hardware_profile_yaml(const HardwareProfile& p) {
  std::string out =
      "# Hardware profile for the cost model (predict/cost_model.h); see docs/cost-model.md.\n";
  out += "name: " + quoted(p.name) + "\n";
  out += "description: " + quoted(p.description) + "\n";
  out += "backend: " + p.backend + "\n";
  for (const NumericField& field : kNumericFields) {
    out += std::string(field.key) + ": " + number(p.*field.member) + "  # " + field.meaning + "\n";
  }
  out += linear_table_yaml(p.linear_table);
  if (!p.sources.empty()) {
    out += "sources:\n";
    for (const auto& [key, text] : p.sources) out += "  " + key + ": " + quoted(text) + "\n";
  }
  return out;
}

void write_hardware_profile(const HardwareProfile& profile, const std::string& path) {
  write_text_file(path, hardware_profile_yaml(profile));
}

HardwareProfile with_link(HardwareProfile profile, double gbps, double latency_us) {
  INFINIGEN_CHECK(std::isfinite(gbps) && gbps >= 0, "link bandwidth ", gbps,
                  " GB/s is not a non-negative number");
  INFINIGEN_CHECK(std::isfinite(latency_us) && latency_us >= 0, "link latency ", latency_us,
                  " us is not a non-negative number");
  const double rate = gbps > 0 ? gbps * 1e9 : INFINITY;
  const bool emulated = gbps > 0 || latency_us > 0;
  profile.h2d_bytes_per_s = rate;
  profile.d2h_bytes_per_s = rate;
  profile.transfer_latency_s =
      latency_us * 1e-6 + (emulated ? profile.link_emulation_overhead_s : 0.0);
  const std::string why = gbps > 0 ? cat("link emulation of the predicted run: ", gbps, " GB/s, ",
                                         latency_us, " us per transfer")
                                   : cat("no link emulation (copies at host memory speed), ",
                                         latency_us, " us per transfer");
  profile.sources["h2d_bytes_per_s"] = why;
  profile.sources["d2h_bytes_per_s"] = why;
  profile.sources["transfer_latency_s"] = emulated ? why + ", plus link_emulation_overhead_s" : why;
  return profile;
}

}  // namespace infinigen
