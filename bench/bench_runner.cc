// bench: measuring and predicting an experiment's points.
#include "bench/bench_runner.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>

#include "core/error.h"
#include "core/file_io.h"
#include "core/generation.h"
#include "core/model_loader.h"
#include "offload/kv_policy.h"
#include "offload/run_summary.h"
#include "offload/runtime.h"
#include "offload/session.h"
#include "predict/cost_model.h"
#include "predict/hardware_profile.h"

namespace infinigen {
namespace {

double median(std::vector<double> values) {
  if (values.empty()) return 0.0;
  std::sort(values.begin(), values.end());
  const size_t mid = values.size() / 2;
  return values.size() % 2 == 1 ? values[mid] : 0.5 * (values[mid - 1] + values[mid]);
}

OffloadOptions offload_options(const BenchSettings& s, const LinkEmulation& link) {
  OffloadOptions o = s.offload;
  o.link = link;
  return o;
}

// The model a point runs: a preset shrunk to `config` on synthetic weights, or a checkpoint.
ModelSource point_source(const BenchSettings& s, const ModelConfig& config, double scale,
                         uint64_t seed) {
  ModelLoadOptions load;
  load.seed = seed;
  ModelSource source = resolve_model(s.model, load);
  if (scale != 1.0) {
    INFINIGEN_CHECK(source.synthetic, option("scale"), " ", scale,
                    " needs a preset model (synthetic ", "weights); ", s.model, " is a checkpoint");
    source.config = config;
    source.description =
        cat(s.model, " at scale ", scale, " on synthetic weights (seed ", seed, ")");
  }
  return source;
}

PointMetrics metrics_of(const OffloadRun& run, int64_t num_layers) {
  const TransferSummary summary = summarize(run);
  PointMetrics m;
  m.prefill_s = run.result.prefill_seconds;
  m.decode_s = run.result.decode_seconds;
  m.total_s = run.result.total_seconds();
  m.throughput_tok_s = run.result.throughput();
  m.decode_step_s = summary.median_step_seconds;
  m.h2d_bytes_per_step = summary.h2d_bytes_per_step;
  m.d2h_bytes_per_step = summary.d2h_bytes_per_step;
  m.host_kv_bytes = static_cast<double>(summary.host_kv_bytes);
  m.fetched_fraction = summary.fetched_fraction;
  m.layer_fetched_fraction = summary.layer_fetched_fraction;
  m.layer_fetched_again_fraction = summary.layer_fetched_again_fraction;
  const auto& steps = run.stats.steps();
  for (size_t i = 1; i < steps.size(); ++i) {
    std::vector<uint64_t> rows, cached;
    for (const LayerTraffic& layer : steps[i].layers) {
      rows.push_back(layer.tokens_fetched);
      cached.push_back(layer.tokens_from_row_cache);
    }
    m.fetched_rows.push_back(std::move(rows));
    m.cached_rows.push_back(std::move(cached));
  }
  const double layers = static_cast<double>(num_layers);
  m.block_s = m.decode_step_s / layers;
  m.block_transfer_s = std::min(m.block_s, summary.load_wait_per_step / layers);
  m.block_compute_s = m.block_s - m.block_transfer_s;
  return m;
}

// Median of every scalar over the repeats; per-layer fractions of the median-latency run.
PointMetrics median_metrics(const std::vector<PointMetrics>& runs) {
  const auto pick = [&](double PointMetrics::*field) {
    std::vector<double> values;
    for (const PointMetrics& m : runs) values.push_back(m.*field);
    return median(values);
  };
  PointMetrics m;
  for (double PointMetrics::*field :
       {&PointMetrics::prefill_s, &PointMetrics::decode_s, &PointMetrics::total_s,
        &PointMetrics::throughput_tok_s, &PointMetrics::decode_step_s,
        &PointMetrics::h2d_bytes_per_step, &PointMetrics::d2h_bytes_per_step,
        &PointMetrics::host_kv_bytes, &PointMetrics::fetched_fraction, &PointMetrics::block_s,
        &PointMetrics::block_transfer_s, &PointMetrics::block_compute_s}) {
    m.*field = pick(field);
  }
  const auto closest =
      std::min_element(runs.begin(), runs.end(), [&](const auto& a, const auto& b) {
        return std::abs(a.total_s - m.total_s) < std::abs(b.total_s - m.total_s);
      });
  m.layer_fetched_fraction = closest->layer_fetched_fraction;
  m.layer_fetched_again_fraction = closest->layer_fetched_again_fraction;
  m.fetched_rows = closest->fetched_rows;
  m.cached_rows = closest->cached_rows;
  return m;
}

struct RunInputs {
  ModelSource source;
  BenchSettings settings;  // the batch and lengths; prompts are built only for a run
  OffloadOptions options;
  uint64_t seed = 0;
};

RunInputs run_inputs(const BenchSettings& s, const ModelConfig& config, double scale,
                     const LinkEmulation& link, uint64_t seed) {
  return {point_source(s, config, scale, seed), s, offload_options(s, link), seed};
}

// Plans the run here; the planner's one line when it cannot fit. Nothing proportional to the
// point's sizes is built before this says "ok".
std::string plan_status(const RunInputs& in, Device device) {
  try {
    const int64_t tokens = in.settings.history_len + in.settings.prompt_len;
    check_context(in.source.config, tokens, in.settings.gen_len);
    plan_offloaded_run(offload_memory_request(in.source.config, in.settings.batch, tokens,
                                              in.settings.gen_len, DType::F16, in.options),
                       in.options, device);
  } catch (const Error& e) {
    return cat("does not fit here: ", e.what());
  }
  return "ok";
}

// The point's requests: synthetic prompts of its batch and length.
GenerationRequest generation_request(const RunInputs& in) {
  GenerationRequest request;
  request.prompts =
      synthetic_prompts(in.settings.batch, in.settings.prompt_len, in.source.config.bos_token_id,
                        static_cast<int32_t>(in.source.config.vocab_size), in.seed);
  share_leading_tokens(request.prompts, in.settings.shared_prefix_len,
                       in.settings.shared_prefix_groups);
  request.gen_len = in.settings.gen_len;
  request.kv_dtype = DType::F16;
  return request;
}

// A resumed turn (history_len > 0): a first turn of history_len tokens (and one generated)
// saved in a fresh session, its files dropped from the page cache, then the point's turn of
// prompt_len tokens (the first turn's last token and prompt_len - 1 new ones) resumed from it.
OffloadRun run_resumed_turn(const RunInputs& in, Device device, int repeat) {
  namespace fs = std::filesystem;
  const fs::path directory =
      fs::temp_directory_path() / cat("infinigen-bench-session-", getpid(), "-", repeat);
  fs::remove_all(directory);
  struct Cleanup {
    fs::path path;
    ~Cleanup() {
      std::error_code ignored;
      fs::remove_all(path, ignored);
    }
  } cleanup{directory};
  const SessionKey key = session_key(in.source, in.options, DType::F16, device);
  const ModelConfig& config = in.source.config;
  const auto vocab = static_cast<int32_t>(config.vocab_size);
  {
    auto session = DiskSession::create(directory, key);
    GenerationRequest first;
    first.prompts = session->turn_prompts(synthetic_prompts(
        in.settings.batch, in.settings.history_len, config.bos_token_id, vocab, in.seed));
    first.gen_len = 1;
    run_offloaded(in.source, first, in.options, device, {}, session.get());
  }
  drop_from_page_cache(directory);
  auto session = DiskSession::open(directory, key);
  GenerationRequest request;
  std::vector<std::vector<int32_t>> prompts = synthetic_prompts(
      in.settings.batch, in.settings.prompt_len, config.bos_token_id, vocab, in.seed + 1);
  for (auto& prompt : prompts) prompt.erase(prompt.begin());  // no BOS mid-conversation
  request.prompts = session->turn_prompts(prompts);
  request.gen_len = in.settings.gen_len;
  return run_offloaded(in.source, request, in.options, device, {}, session.get());
}

// Median metrics of `repeats` runs; only for inputs plan_status accepted.
PointMetrics measure(const RunInputs& in, Device device, int repeats) {
  const GenerationRequest request = generation_request(in);
  std::vector<PointMetrics> runs;
  for (int r = 0; r < repeats; ++r) {
    const OffloadRun run = in.settings.history_len > 0
                               ? run_resumed_turn(in, device, r)
                               : run_offloaded(in.source, request, in.options, device);
    runs.push_back(metrics_of(run, in.source.config.num_layers));
  }
  return median_metrics(runs);
}

PointMetrics metrics_of(const PredictedRun& p) {
  PointMetrics m;
  m.host_kv_bytes = static_cast<double>(p.host_kv_bytes);
  m.prefill_s = p.prefill_s;
  m.decode_s = p.decode_s;
  m.total_s = p.prefill_s + p.decode_s;
  m.throughput_tok_s = p.throughput_tok_s;
  m.decode_step_s = p.middle_decode_step.seconds;
  m.h2d_bytes_per_step = p.mean_h2d_bytes_per_decode_step;
  m.d2h_bytes_per_step = static_cast<double>(p.middle_decode_step.d2h_bytes);
  const double layers = static_cast<double>(p.middle_decode_step.layers.size());
  double exposed = 0;
  for (const PredictedLayer& l : p.middle_decode_step.layers) exposed += l.exposed_load_wait_s;
  m.block_s = m.decode_step_s / layers;
  m.block_transfer_s = std::min(m.block_s, exposed / layers);
  m.block_compute_s = m.block_s - m.block_transfer_s;
  return m;
}

// Points that differ only in their policy (the baselines a speedup is relative to).
// What the prediction assumed: 1 for policies that load everything they keep; for infinigen
// the share over all layers of the predicted model, its dense layers loading everything and the
// others the mean of the shares given for speculated layers (the input's first dense_layers
// entries are the measured run's dense layers).
double mean_fetched_fraction(const CostModelInput& model) {
  if (!kv_policy(model.options.policy).selects_loads || model.fetched.fraction.empty()) {
    return 1.0;
  }
  const size_t dense = static_cast<size_t>(model.options.speculation.dense_layers);
  double sum = 0;
  size_t count = 0;
  for (size_t l = dense; l < model.fetched.fraction.size(); ++l, ++count) {
    sum += model.fetched.fraction[l];
  }
  if (count == 0) return 1.0;
  const double layers = static_cast<double>(model.config.num_layers);
  const double dense_layers = std::min(layers, static_cast<double>(dense));
  return (dense_layers + (layers - dense_layers) * sum / static_cast<double>(count)) / layers;
}

bool same_group(const PointResult& a, const PointResult& b) {
  if (a.point.panel != b.point.panel) return false;
  for (const char* key : {"model", "batch", "prompt_len", "gen_len"}) {
    if (settings_value(a.point.settings, key) != settings_value(b.point.settings, key)) {
      return false;
    }
  }
  for (const OptionSpec<OffloadOptions>& spec : offload_option_table()) {
    if (spec.key == "policy") continue;
    if (spec.format(a.point.settings.offload) != spec.format(b.point.settings.offload)) {
      return false;
    }
  }
  return true;
}

const PointMetrics* metrics(const PointResult& p, bool predicted) {
  const auto& m = predicted ? p.predicted : p.measured;
  return m ? &*m : nullptr;
}

// A duration for a progress line, rounded to what a reader compares: "12.34 s", "845.2 ms",
// "73 us".
std::string format_seconds(double seconds) {
  char text[40];
  if (seconds >= 1.0) {
    std::snprintf(text, sizeof(text), "%.2f s", seconds);
  } else if (seconds >= 1e-3) {
    std::snprintf(text, sizeof(text), "%.1f ms", seconds * 1e3);
  } else {
    std::snprintf(text, sizeof(text), "%.0f us", seconds * 1e6);
  }
  return text;
}

}  // namespace

BenchReport run_experiment(const Experiment& experiment, const BenchOptions& options,
                           const std::function<void(const std::string&)>& progress) {
  INFINIGEN_CHECK(options.scale > 0 && options.scale <= 1, option("scale"),
                  " must be in (0, 1], got ", options.scale);
  INFINIGEN_CHECK(options.repeats >= 0, option("repeats"), " must be at least 1, got ",
                  options.repeats);
  INFINIGEN_CHECK(options.measure || !options.predict.empty(),
                  "nothing to do: ", option("no_measure"), " needs ", option("predict"),
                  " PROFILE");
  BenchReport report;
  report.experiment = experiment;
  report.options = options;
  report.link_gbps = options.link_gbps > 0 ? options.link_gbps : experiment.link_gbps;
  const int repeats = options.repeats > 0 ? options.repeats : experiment.repeats;
  // Only the CPU backend emulates a link; a GPU's copies take the time the real link takes.
  const LinkEmulation link = options.device == Device::Cpu
                                 ? LinkEmulation{report.link_gbps, options.link_latency_us}
                                 : LinkEmulation{};
  std::optional<HardwareProfile> profile;
  if (!options.predict.empty()) {
    profile = load_hardware_profile(options.predict);
    if (profile->backend == "cpu") profile = with_link(*profile, link.gbps, link.latency_us);
    report.profile_name = profile->name;
    report.profile_description = profile->description;
    report.fractions_source =
        options.fetched_fraction > 0
            ? cat("given: ", options.fetched_fraction, " of each speculated layer's KV, ",
                  std::max(0.0, options.fetched_again_fraction),
                  " of it fetched at the step before too")
        : options.measure ? "the measured runs of each point"
                          : cat("runs of each point's model at scale ", options.fractions_scale,
                                " with the point's lengths, ", options.fractions_gen_len,
                                " decode steps, on this machine");
  }

  const size_t total = experiment.points.size();
  bool warmed_up = false;
  for (size_t i = 0; i < total; ++i) {
    const ExperimentPoint& point = experiment.points[i];
    const ModelConfig preset = resolve_model(point.settings.model, {}).config;
    const ScaledPoint scaled = scale_point(preset, point.settings, options.scale);
    PointResult result;
    result.point = point;
    result.ran = scaled.settings;
    result.ran_config = scaled.config;
    result.paper = paper_values_for(experiment, point.settings);
    const std::string name = cat(experiment.name, " [", i + 1, "/", total, "] ",
                                 point.panel.empty() ? "" : point.panel + " ", experiment.x_key,
                                 "=", point.x, " ", point.settings.offload.policy);
    const RunInputs in =
        run_inputs(scaled.settings, scaled.config, options.scale, link, options.seed);
    if (options.measure) {
      result.status = plan_status(in, options.device);
      if (result.status == "ok") {
        // The first run of a process pays for thread pools and first-touch page faults: one
        // untimed run keeps that out of the first point's numbers.
        if (!warmed_up) measure(in, options.device, 1);
        warmed_up = true;
        result.measured = measure(in, options.device, repeats);
      }
    }
    if (profile) {
      CostModelInput model;
      model.config = scaled.config;
      model.batch = scaled.settings.batch;
      model.prompt_len = scaled.settings.prompt_len;
      model.gen_len = scaled.settings.gen_len;
      model.history_len = scaled.settings.history_len;
      model.shared_prefix_len = scaled.settings.shared_prefix_len;
      model.shared_prefix_groups = scaled.settings.shared_prefix_groups;
      model.kv_dtype = DType::F16;
      model.options = in.options;
      if (kv_policy(in.options.policy).selects_loads) {
        if (options.fetched_fraction > 0) {
          model.fetched.fraction.assign(static_cast<size_t>(scaled.config.num_layers),
                                        options.fetched_fraction);
        } else if (result.measured) {
          model.fetched.fraction = result.measured->layer_fetched_fraction;
          model.fetched.rows = result.measured->fetched_rows;
          model.fetched.again = result.measured->layer_fetched_again_fraction;
          // Measured with the row cache on: the rows it served, step by step.
          if (in.options.row_cache != RowCacheUse::Off) {
            model.fetched.again_rows = result.measured->cached_rows;
          }
        } else {
          // The fetched share depends on the attention pattern and the context length, not on
          // the model's width: measure it on a narrow model with the point's lengths.
          BenchSettings small = scaled.settings;
          small.batch =
              std::max<int64_t>(1, std::llround(scaled.settings.batch * options.fractions_scale));
          small.gen_len = std::min(scaled.settings.gen_len, options.fractions_gen_len);
          small.shared_prefix_groups = std::min(small.shared_prefix_groups, small.batch);
          const ModelConfig narrow = scaled_model_config(preset, options.fractions_scale);
          const RunInputs probe =
              run_inputs(small, narrow, options.fractions_scale, {}, options.seed);
          if (const std::string probe_status = plan_status(probe, options.device);
              probe_status == "ok") {
            const PointMetrics fractions = measure(probe, options.device, 1);
            model.fetched.fraction = fractions.layer_fetched_fraction;
            model.fetched.again = fractions.layer_fetched_again_fraction;
          } else {
            result.prediction_status =
                cat("its fetched fractions could not be measured: ", probe_status);
          }
        }
      }
      if (options.fetched_again_fraction >= 0) {
        model.fetched.again.assign(static_cast<size_t>(scaled.config.num_layers),
                                   options.fetched_again_fraction);
      }
      if (result.prediction_status == "ok") {
        const PredictedRun predicted = predict_run(model, *profile);
        if (predicted.fits) {
          result.predicted = metrics_of(predicted);
          // The fetched share is an input of the prediction, not an output: carry it along.
          result.predicted->fetched_fraction =
              result.measured ? result.measured->fetched_fraction : mean_fetched_fraction(model);
        } else {
          result.prediction_status =
              cat("does not fit on ", profile->name, ": ", predicted.does_not_fit);
        }
      }
    }
    if (progress) {
      std::string line = name;
      if (result.measured) {
        line += ": measured " + format_seconds(result.measured->total_s);
      } else if (result.status != "ok") {
        line += ": " + result.status;
      }
      if (result.predicted) line += ", predicted " + format_seconds(result.predicted->total_s);
      progress(line);
    }
    report.points.push_back(std::move(result));
  }
  return report;
}

double speedup_vs_full(const BenchReport& report, size_t index, bool predicted) {
  const PointResult& p = report.points[index];
  const PointMetrics* m = metrics(p, predicted);
  if (!m) return 0.0;
  for (const PointResult& other : report.points) {
    if (other.point.settings.offload.policy != "full" || !same_group(p, other)) continue;
    const PointMetrics* full = metrics(other, predicted);
    return full && m->total_s > 0 ? full->total_s / m->total_s : 0.0;
  }
  return 0.0;
}

double slowdown_vs_gpu(const BenchReport& report, size_t index, bool predicted) {
  const PointResult& p = report.points[index];
  const PointMetrics* m = metrics(p, predicted);
  if (!m) return 0.0;
  for (const PointResult& other : report.points) {
    if (other.point.settings.offload.policy != "gpu" || !same_group(p, other)) continue;
    const PointMetrics* gpu = metrics(other, predicted);
    return gpu && gpu->decode_step_s > 0 ? m->decode_step_s / gpu->decode_step_s : 0.0;
  }
  return 0.0;
}

}  // namespace infinigen
