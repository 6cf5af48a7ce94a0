// offload: summing up a run's per-step statistics.
#include "offload/run_summary.h"

#include <algorithm>

namespace infinigen {

TransferSummary summarize(const OffloadRun& run) {
  TransferSummary s;
  const auto& steps = run.stats.steps();
  if (!steps.empty()) {
    s.prefill_h2d_bytes = steps[0].h2d_bytes;
    s.prefill_d2h_bytes = steps[0].d2h_bytes;
    s.host_kv_bytes = steps.back().host_kv_bytes;
  }
  const SharedPrefixes& shared = run.shared_prefixes;
  s.shared_prefix_tokens = shared.kept_tokens();
  s.shared_prefix_groups = shared.num_groups();
  for (int32_t group : shared.groups()) s.shared_prefix_sequences += group >= 0 ? 1 : 0;
  double busy = 0, wait = 0, hidden = 0, fetched = 0, stored = 0, recall_sum = 0;
  double again = 0, fetched_where_known = 0, from_row_cache = 0;
  std::vector<double> layer_again, layer_known;
  int64_t recall_count = 0;
  std::vector<double> layer_recall, layer_recall_n, layer_fetched, layer_stored, step_seconds;
  for (size_t i = 1; i < steps.size(); ++i) {
    const size_t num_layers = steps[i].layers.size();
    layer_recall.resize(num_layers, 0.0);
    layer_recall_n.resize(num_layers, 0.0);
    layer_fetched.resize(num_layers, 0.0);
    layer_stored.resize(num_layers, 0.0);
    layer_again.resize(num_layers, 0.0);
    layer_known.resize(num_layers, 0.0);
    s.layer_load_wait.resize(num_layers, 0.0);
    step_seconds.push_back(steps[i].seconds);
    for (size_t l = 0; l < num_layers; ++l) {
      const LayerTraffic& t = steps[i].layers[l];
      fetched += static_cast<double>(t.tokens_fetched);
      stored += static_cast<double>(t.tokens_stored);
      layer_fetched[l] += static_cast<double>(t.tokens_fetched);
      layer_stored[l] += static_cast<double>(t.tokens_stored);
      s.layer_load_wait[l] += t.load_wait_seconds;
      if (t.tokens_fetched_again >= 0) {
        again += static_cast<double>(t.tokens_fetched_again);
        fetched_where_known += static_cast<double>(t.tokens_fetched);
        from_row_cache += static_cast<double>(t.tokens_from_row_cache);
        layer_again[l] += static_cast<double>(t.tokens_fetched_again);
        layer_known[l] += static_cast<double>(t.tokens_fetched);
      }
      if (t.recall >= 0) {
        recall_sum += t.recall;
        ++recall_count;
        layer_recall[l] += t.recall;
        layer_recall_n[l] += 1;
      }
    }
    s.h2d_bytes_per_step += static_cast<double>(steps[i].h2d_bytes);
    s.d2h_bytes_per_step += static_cast<double>(steps[i].d2h_bytes);
    s.decode_step_allocations_and_frees += steps[i].allocations + steps[i].frees;
    busy += steps[i].load_busy_seconds;
    wait += steps[i].load_wait_seconds;
    // Per step: a step's wait cannot hide another step's transfer.
    hidden += steps[i].hidden_load_seconds();
  }
  s.decode_steps = steps.empty() ? 0 : static_cast<int64_t>(steps.size()) - 1;
  if (s.decode_steps > 0) {
    const double n = static_cast<double>(s.decode_steps);
    s.h2d_bytes_per_step /= n;
    s.d2h_bytes_per_step /= n;
    s.load_busy_per_step = busy / n;
    s.load_wait_per_step = wait / n;
    s.load_hidden_per_step = hidden / n;
    s.hidden_fraction = busy > 0 ? hidden / busy : 0.0;
    for (double& w : s.layer_load_wait) w /= n;
    std::sort(step_seconds.begin(), step_seconds.end());
    const size_t mid = step_seconds.size() / 2;
    s.median_step_seconds = step_seconds.size() % 2 == 1
                                ? step_seconds[mid]
                                : 0.5 * (step_seconds[mid - 1] + step_seconds[mid]);
  }
  for (size_t l = 0; l < layer_fetched.size(); ++l) {
    s.layer_fetched_fraction.push_back(layer_stored[l] > 0 ? layer_fetched[l] / layer_stored[l]
                                                           : 0.0);
  }
  s.fetched_fraction = stored > 0 ? fetched / stored : 0.0;
  if (fetched_where_known > 0) {
    s.fetched_again_fraction = again / fetched_where_known;
    s.row_cache_fraction = from_row_cache / fetched_where_known;
  }
  for (size_t l = 0; l < layer_again.size(); ++l) {
    s.layer_fetched_again_fraction.push_back(layer_known[l] > 0 ? layer_again[l] / layer_known[l]
                                                                : 0.0);
  }
  if (recall_count > 0) {
    s.mean_recall = recall_sum / static_cast<double>(recall_count);
    for (size_t l = 0; l < layer_recall.size(); ++l) {
      if (layer_recall_n[l] == 0) continue;
      const double mean = layer_recall[l] / layer_recall_n[l];
      if (s.min_layer_recall < 0 || mean < s.min_layer_recall) s.min_layer_recall = mean;
    }
  }
  s.total_h2d_bytes = run.totals.h2d_bytes;
  s.total_d2h_bytes = run.totals.d2h_bytes;
  return s;
}

}  // namespace infinigen
