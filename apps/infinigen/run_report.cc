// apps/infinigen: transfer summaries, JSON and tables for `infinigen run`.
#include "apps/infinigen/run_report.h"

#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace infinigen::cli {
namespace {

double mib(double bytes) {
  return bytes / (1024.0 * 1024.0);
}

// A measurement that may be missing (-1: not measured) as JSON: null when missing.
nlohmann::json measured(double value) {
  return value < 0 ? nlohmann::json(nullptr) : nlohmann::json(value);
}

}  // namespace

nlohmann::json json_float(float value) {
  // The shortest text that reads back as this float, read as a double: 0.8f is 0.8, not the
  // double nearest the float (0.800000011920929).
  char text[32];
  const auto end = std::to_chars(text, text + sizeof(text), value).ptr;
  return std::strtod(std::string(text, end).c_str(), nullptr);
}

nlohmann::json transfers_json(const TransferSummary& s) {
  return {{"decode_steps", s.decode_steps},
          {"h2d_bytes_per_decode_step", s.h2d_bytes_per_step},
          {"d2h_bytes_per_decode_step", s.d2h_bytes_per_step},
          {"load_busy_s_per_decode_step", s.load_busy_per_step},
          {"load_wait_s_per_decode_step", s.load_wait_per_step},
          {"load_hidden_s_per_decode_step", s.load_hidden_per_step},
          {"hidden_load_fraction", s.hidden_fraction},
          {"prefill_h2d_bytes", s.prefill_h2d_bytes},
          {"host_kv_bytes", s.host_kv_bytes},
          {"shared_prefix_tokens", s.shared_prefix_tokens},
          {"shared_prefix_groups", s.shared_prefix_groups},
          {"shared_prefix_sequences", s.shared_prefix_sequences},
          {"prefill_d2h_bytes", s.prefill_d2h_bytes},
          {"total_h2d_bytes", s.total_h2d_bytes},
          {"total_d2h_bytes", s.total_d2h_bytes},
          {"kv_fetched_fraction", s.fetched_fraction},
          {"mean_recall", measured(s.mean_recall)},
          {"min_layer_recall", measured(s.min_layer_recall)},
          {"kv_fetched_again_fraction", measured(s.fetched_again_fraction)},
          {"kv_row_cache_fraction", measured(s.row_cache_fraction)},
          {"decode_step_allocations_and_frees", s.decode_step_allocations_and_frees}};
}

nlohmann::json plan_json(const MemoryPlan& p) {
  nlohmann::json plan = {{"device_weights_bytes", p.device_weights},
                         {"device_weight_staging_bytes", p.device_weight_staging},
                         {"device_kv_bytes", p.device_kv},
                         {"device_activations_bytes", p.device_activations},
                         {"device_total_bytes", p.device_total()},
                         {"host_weights_bytes", p.host_weights},
                         {"host_kv_pool_bytes", p.host_kv_pool},
                         {"host_total_bytes", p.host_total()}};
  if (p.dense_kv) {
    OffloadOptions placed;
    placed.dense_kv = *p.dense_kv;
    plan["dense_kv"] = find_option(offload_option_table(), "dense_kv")->format(placed);
  }
  if (p.row_cache) plan["row_cache"] = *p.row_cache;
  if (p.partial_key_host_layers) plan["partial_key_host_layers"] = *p.partial_key_host_layers;
  if (p.decode_staging_rows) plan["decode_staging_rows"] = *p.decode_staging_rows;
  return plan;
}

nlohmann::json pool_cap_json(const PoolCapStats& cap) {
  if (cap.positions == 0) return nullptr;
  return {{"positions", cap.positions},
          {"bytes", cap.bytes},
          {"evictions", cap.evictions},
          {"prompt_tokens_not_kept", cap.prompt_not_kept}};
}

nlohmann::json steps_json(const OffloadStats& stats) {
  nlohmann::json steps = nlohmann::json::array();
  for (const StepStats& step : stats.steps()) {
    nlohmann::json layers = nlohmann::json::array();
    for (const LayerTraffic& l : step.layers) {
      layers.push_back({{"kv_h2d_bytes", l.kv_h2d_bytes},
                        {"kv_d2h_bytes", l.kv_d2h_bytes},
                        {"weight_h2d_bytes", l.weight_h2d_bytes},
                        {"load_wait_s", l.load_wait_seconds},
                        {"tokens_fetched", l.tokens_fetched},
                        {"tokens_stored", l.tokens_stored},
                        {"tokens_fetched_again", l.tokens_fetched_again >= 0
                                                     ? nlohmann::json(l.tokens_fetched_again)
                                                     : nlohmann::json()},
                        {"tokens_from_row_cache", l.tokens_from_row_cache},
                        {"recall", measured(l.recall)}});
    }
    steps.push_back({{"seconds", step.seconds},
                     {"h2d_bytes", step.h2d_bytes},
                     {"d2h_bytes", step.d2h_bytes},
                     {"load_busy_s", step.load_busy_seconds},
                     {"store_busy_s", step.store_busy_seconds},
                     {"load_wait_s", step.load_wait_seconds},
                     {"hidden_load_s", step.hidden_load_seconds()},
                     {"allocations", step.allocations},
                     {"frees", step.frees},
                     {"layers", layers}});
  }
  return steps;
}

void print_transfers(const TransferSummary& s, const OffloadRun& run, bool per_layer) {
  std::printf("host->device     %9.2f MiB/step  (decode mean; prefill %.2f MiB)\n",
              mib(s.h2d_bytes_per_step), mib(static_cast<double>(s.prefill_h2d_bytes)));
  std::printf("device->host     %9.2f MiB/step  (decode mean; prefill %.2f MiB)\n",
              mib(s.d2h_bytes_per_step), mib(static_cast<double>(s.prefill_d2h_bytes)));
  // The shared prefixes, in words: one the whole batch shares, or several groups'.
  const bool whole_batch =
      s.shared_prefix_groups == 1 && s.shared_prefix_sequences == run.result.batch;
  const std::string groups = cat(s.shared_prefix_groups, " groups, ", s.shared_prefix_sequences,
                                 " sequences, ", s.shared_prefix_tokens, " tokens");
  if (s.host_kv_bytes > 0) {
    std::printf("host KV pool     %9.2f MiB", mib(static_cast<double>(s.host_kv_bytes)));
    if (whole_batch) {
      std::printf("  (the batch's %lld-token shared prefix kept once)",
                  static_cast<long long>(s.shared_prefix_tokens));
    } else if (s.shared_prefix_groups > 0) {
      std::printf("  (shared prefixes kept once: %s)", groups.c_str());
    }
    std::printf("\n");
  } else if (whole_batch) {
    std::printf("shared prefix    %9lld tokens computed once\n",
                static_cast<long long>(s.shared_prefix_tokens));
  } else if (s.shared_prefix_groups > 0) {
    std::printf("shared prefixes  computed once: %s\n", groups.c_str());
  }
  if (const PoolCapStats& cap = run.stats.pool_cap(); cap.positions > 0) {
    std::printf("KV pool cap      %s\n", cap.describe().c_str());
  }
  // The load stream's transfer time and how much of it ran under compute; then compute's wait
  // for loads, split into the transfer it waited through and the time before those loads began
  // (queued behind other loads, or waiting for their inputs): TransferSummary's terms.
  if (s.load_busy_per_step > 0) {
    std::printf("loads            %9.2f ms/step transferring, %.0f%% of it under compute\n",
                1e3 * s.load_busy_per_step, 100.0 * s.hidden_fraction);
  }
  if (s.load_wait_per_step > 0) {
    std::printf(
        "load waits       %9.2f ms/step compute idle: %.2f ms on transfers, %.2f ms before "
        "the loads began\n",
        1e3 * s.load_wait_per_step, 1e3 * s.load_exposed_per_step(),
        1e3 * s.load_wait_before_start_per_step());
  }
  if (s.fetched_fraction > 0) {
    std::printf("KV fetched       %9.1f%% of the stored tokens (decode, all layers)",
                100.0 * s.fetched_fraction);
    if (s.mean_recall >= 0) {
      std::printf("; recall %.3f (worst layer %.3f)", s.mean_recall, s.min_layer_recall);
    }
    std::printf("\n");
    if (s.fetched_again_fraction >= 0) {
      std::printf("KV fetched again %9.1f%% of the rows fetched, also fetched at the step before\n",
                  100.0 * s.fetched_again_fraction);
    }
    if (s.row_cache_fraction > 0) {
      std::printf(
          "KV row cache     %9.1f%% of the rows fetched, copied on the device, not loaded\n",
          100.0 * s.row_cache_fraction);
    }
  }
  if (!per_layer) return;
  std::printf("\n%s\n", run.plan.describe().c_str());  // the table names itself
  const auto& steps = run.stats.steps();
  if (steps.size() < 2) return;
  std::printf("per layer, mean over %lld decode steps\n", static_cast<long long>(s.decode_steps));
  std::printf("  %5s %12s %12s %12s %10s %9s %8s\n", "layer", "KV in MiB", "weights MiB",
              "KV out KiB", "wait ms", "fetched", "recall");
  const size_t layers = steps[1].layers.size();
  const double n = static_cast<double>(s.decode_steps);
  for (size_t l = 0; l < layers; ++l) {
    double kv_in = 0, w_in = 0, kv_out = 0, wait = 0, fetched = 0, stored = 0, recall = 0;
    int recalls = 0;
    for (size_t i = 1; i < steps.size(); ++i) {
      const LayerTraffic& t = steps[i].layers[l];
      kv_in += static_cast<double>(t.kv_h2d_bytes);
      w_in += static_cast<double>(t.weight_h2d_bytes);
      kv_out += static_cast<double>(t.kv_d2h_bytes);
      wait += t.load_wait_seconds;
      fetched += static_cast<double>(t.tokens_fetched);
      stored += static_cast<double>(t.tokens_stored);
      if (t.recall >= 0) {
        recall += t.recall;
        ++recalls;
      }
    }
    std::printf("  %5zu %12.3f %12.3f %12.3f %10.3f %8.1f%%", l, mib(kv_in / n), mib(w_in / n),
                kv_out / n / 1024.0, 1e3 * wait / n, stored > 0 ? 100.0 * fetched / stored : 0.0);
    if (recalls > 0) {
      std::printf(" %8.3f\n", recall / recalls);
    } else {
      std::printf(" %8s\n", "-");
    }
  }
  std::printf("\nper step\n  %5s %10s %12s %12s %10s %10s\n", "step", "ms", "in MiB", "out KiB",
              "load ms", "wait ms");
  for (size_t i = 0; i < steps.size(); ++i) {
    const StepStats& st = steps[i];
    std::printf("  %5s %10.2f %12.3f %12.3f %10.2f %10.2f\n",
                i == 0 ? "pre" : std::to_string(i).c_str(), 1e3 * st.seconds,
                mib(static_cast<double>(st.h2d_bytes)), static_cast<double>(st.d2h_bytes) / 1024.0,
                1e3 * st.load_busy_seconds, 1e3 * st.load_wait_seconds);
  }
}

nlohmann::json op_profile_json(const OpProfile& profile) {
  const auto phase_json = [](const OpProfile::Phase& phase) {
    nlohmann::json ops = nlohmann::json::array();
    for (const OpProfile::Entry& e : phase.entries) {
      ops.push_back({{"name", e.name}, {"calls", e.calls}, {"seconds", e.seconds}});
    }
    return nlohmann::json{{"steps", phase.steps}, {"seconds", phase.seconds()}, {"ops", ops}};
  };
  return {{"prefill", phase_json(profile.prefill())}, {"decode", phase_json(profile.decode())}};
}

void print_op_profile(const OpProfile& profile) {
  constexpr size_t kShown = 14;  // the rest on one line
  const auto print_phase = [](const OpProfile::Phase& phase, const char* title) {
    if (phase.steps == 0 || phase.entries.empty()) return;
    const double per = 1.0 / static_cast<double>(phase.steps);
    const double total = phase.seconds();
    std::printf("\n%s (%lld step%s, %.3f ms a step; from each op's start to the next's):\n", title,
                static_cast<long long>(phase.steps), phase.steps == 1 ? "" : "s",
                1e3 * total * per);
    double rest = 0.0;
    int64_t rest_ops = 0;
    for (size_t i = 0; i < phase.entries.size(); ++i) {
      const OpProfile::Entry& e = phase.entries[i];
      if (i >= kShown) {
        rest += e.seconds;
        ++rest_ops;
        continue;
      }
      std::printf("  %-22s %10.3f ms %6.1f%%  %8.1f calls a step\n", e.name.c_str(),
                  1e3 * e.seconds * per, total > 0 ? 100.0 * e.seconds / total : 0.0,
                  static_cast<double>(e.calls) * per);
    }
    if (rest_ops > 0) {
      std::printf("  %-22s %10.3f ms %6.1f%%\n", cat(rest_ops, " more ops").c_str(),
                  1e3 * rest * per, total > 0 ? 100.0 * rest / total : 0.0);
    }
  };
  print_phase(profile.prefill(), "ops of the prefill");
  print_phase(profile.decode(), "ops of a decode step");
}

}  // namespace infinigen::cli
