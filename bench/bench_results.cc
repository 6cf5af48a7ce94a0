// bench: writing results.
#include "bench/bench_results.h"

#include <charconv>
#include <set>
#include <sstream>

namespace infinigen {
namespace {

using nlohmann::json;

// Every setting by its key; options whose text is a number as JSON numbers.
json settings_json(const BenchSettings& s) {
  json j = {{"model", s.model}};
  for (const IntegerSetting& setting : integer_settings()) j[setting.key] = s.*(setting.member);
  for (const OptionSpec<OffloadOptions>& spec : offload_option_table()) {
    const std::string text = spec.format(s.offload);
    double value = 0;
    const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
    if (error == std::errc() && end == text.data() + text.size()) {
      j[spec.key] = value;
    } else {
      j[spec.key] = text;
    }
  }
  return j;
}

json metrics_json(const PointMetrics& m) {
  return {{"prefill_s", m.prefill_s},
          {"decode_s", m.decode_s},
          {"total_s", m.total_s},
          {"throughput_tok_s", m.throughput_tok_s},
          {"decode_step_s", m.decode_step_s},
          {"h2d_bytes_per_step", m.h2d_bytes_per_step},
          {"d2h_bytes_per_step", m.d2h_bytes_per_step},
          {"host_kv_bytes", m.host_kv_bytes},
          {"fetched_fraction", m.fetched_fraction},
          {"block_s", m.block_s},
          {"block_transfer_s", m.block_transfer_s},
          {"block_compute_s", m.block_compute_s},
          {"layer_fetched_fraction", m.layer_fetched_fraction}};
}

// Predicted decode latency relative to the measured one, minus 1 (0 when either is missing).
double decode_error(const PointResult& p) {
  if (!p.measured || !p.predicted || p.measured->decode_s <= 0) return 0.0;
  return p.predicted->decode_s / p.measured->decode_s - 1.0;
}

std::string csv_field(const std::string& text) {
  if (text.find_first_of(",\"\n") == std::string::npos) return text;
  std::string quoted = "\"";
  for (char c : text) {
    if (c == '"') quoted += '"';
    quoted += c;
  }
  quoted += '"';
  return quoted;
}

std::string number(double value) {
  std::ostringstream out;
  out.precision(6);
  out << value;
  return out.str();
}

// The CSV columns of one side (measured or predicted).
void metric_cells(std::vector<std::string>& row, const std::optional<PointMetrics>& m,
                  double speedup, double slowdown) {
  if (!m) {
    row.insert(row.end(), 14, "");
    return;
  }
  for (double v : {m->prefill_s, m->decode_s, m->total_s, m->throughput_tok_s,
                   1e3 * m->decode_step_s, m->h2d_bytes_per_step / (1024.0 * 1024.0),
                   m->host_kv_bytes / (1024.0 * 1024.0), m->fetched_fraction, 1e3 * m->block_s,
                   1e3 * m->block_transfer_s, 1e3 * m->block_compute_s}) {
    row.push_back(number(v));
  }
  row.push_back(speedup > 0 ? number(speedup) : "");
  row.push_back(slowdown > 0 ? number(slowdown) : "");
  row.push_back(m->decode_s > 0 ? number(m->decode_s / m->total_s) : "");
}

}  // namespace

json bench_json(const BenchReport& report, const MachineInfo& machine,
                const std::string& command_line) {
  const Experiment& e = report.experiment;
  json points = json::array();
  for (size_t i = 0; i < report.points.size(); ++i) {
    const PointResult& p = report.points[i];
    json point = {{"panel", p.point.panel},
                  {"x", p.point.x},
                  {"policy", p.point.settings.offload.policy},
                  {"settings", settings_json(p.point.settings)},
                  {"ran", settings_json(p.ran)},
                  {"ran_model",
                   {{"layers", p.ran_config.num_layers},
                    {"heads", p.ran_config.num_heads},
                    {"hidden_size", p.ran_config.hidden_size},
                    {"ffn_dim", p.ran_config.ffn_dim},
                    {"vocab_size", p.ran_config.vocab_size}}},
                  {"status", p.status},
                  {"prediction_status", p.prediction_status},
                  {"paper", p.paper}};
    if (p.measured) {
      point["measured"] = metrics_json(*p.measured);
      point["measured"]["speedup_vs_full"] = speedup_vs_full(report, i, false);
      point["measured"]["slowdown_vs_gpu"] = slowdown_vs_gpu(report, i, false);
    }
    if (p.predicted) {
      point["predicted"] = metrics_json(*p.predicted);
      point["predicted"]["speedup_vs_full"] = speedup_vs_full(report, i, true);
      point["predicted"]["slowdown_vs_gpu"] = slowdown_vs_gpu(report, i, true);
    }
    if (p.measured && p.predicted) point["decode_error"] = decode_error(p);
    points.push_back(std::move(point));
  }
  return {{"experiment",
           {{"name", e.name},
            {"figure", e.figure},
            {"title", e.title},
            {"x", e.x_key},
            {"plot", e.plot},
            {"paper_source", e.paper_source}}},
          {"machine",
           {{"cpu", machine.cpu},
            {"cpu_threads", machine.cpu_threads},
            {"memory_gib", machine.memory_gib},
            {"device", machine.device},
            {"omp_threads", machine.omp_threads}}},
          {"commit", source_commit()},
          {"command", command_line},
          {"settings",
           {{"scale", report.options.scale},
            {"repeats", report.options.repeats > 0 ? report.options.repeats : e.repeats},
            {"measured", report.options.measure},
            {"device", std::string(device_name(report.options.device))},
            {"emulated_link_gbps", report.options.device == Device::Cpu ? report.link_gbps : 0.0},
            {"emulated_link_latency_us", report.options.link_latency_us},
            {"predicted_hardware", report.profile_name},
            {"predicted_hardware_description", report.profile_description},
            {"fetched_fractions_from", report.fractions_source}}},
          {"points", points}};
}

std::string bench_csv(const BenchReport& report) {
  std::set<std::string> paper_metrics;
  for (const PaperValue& v : report.experiment.paper) paper_metrics.insert(v.metric);
  std::vector<std::string> header = {"experiment",  "panel",         "x",
                                     "policy",      "model",         "batch",
                                     "prompt_len",  "gen_len",       "weights_gpu_percent",
                                     "alpha",       "partial_ratio", "h2o_budget",
                                     "scale",       "ran_batch",     "ran_prompt_len",
                                     "ran_gen_len", "ran_layers",    "ran_heads",
                                     "status"};
  for (const char* side : {"measured", "predicted"}) {
    for (const char* column :
         {"prefill_s", "decode_s", "total_s", "throughput_tok_s", "decode_step_ms",
          "h2d_mib_per_step", "host_kv_mib", "fetched_fraction", "block_ms", "block_transfer_ms",
          "block_compute_ms", "speedup_vs_full", "slowdown_vs_gpu", "decode_share"}) {
      header.push_back(std::string(side) + "_" + column);
    }
    if (std::string(side) == "measured") header.push_back("prediction_status");
  }
  header.push_back("decode_error");
  for (const std::string& metric : paper_metrics) header.push_back("paper_" + metric);

  std::string out;
  const auto emit = [&](const std::vector<std::string>& row) {
    for (size_t i = 0; i < row.size(); ++i) {
      if (i > 0) out += ',';
      out += csv_field(row[i]);
    }
    out += "\n";
  };
  emit(header);
  for (size_t i = 0; i < report.points.size(); ++i) {
    const PointResult& p = report.points[i];
    const BenchSettings& s = p.point.settings;
    std::vector<std::string> row = {report.experiment.name,
                                    p.point.panel,
                                    p.point.x,
                                    s.offload.policy,
                                    s.model,
                                    std::to_string(s.batch),
                                    std::to_string(s.prompt_len),
                                    std::to_string(s.gen_len),
                                    settings_value(s, "weights_gpu_percent"),
                                    settings_value(s, "alpha"),
                                    settings_value(s, "partial_ratio"),
                                    settings_value(s, "h2o_budget"),
                                    number(report.options.scale),
                                    std::to_string(p.ran.batch),
                                    std::to_string(p.ran.prompt_len),
                                    std::to_string(p.ran.gen_len),
                                    std::to_string(p.ran_config.num_layers),
                                    std::to_string(p.ran_config.num_heads),
                                    p.status};
    metric_cells(row, p.measured, speedup_vs_full(report, i, false),
                 slowdown_vs_gpu(report, i, false));
    row.push_back(p.prediction_status);
    metric_cells(row, p.predicted, speedup_vs_full(report, i, true),
                 slowdown_vs_gpu(report, i, true));
    row.push_back(p.measured && p.predicted ? number(decode_error(p)) : "");
    for (const std::string& metric : paper_metrics) {
      const auto it = p.paper.find(metric);
      row.push_back(it != p.paper.end() ? number(it->second) : "");
    }
    emit(row);
  }
  return out;
}

}  // namespace infinigen
