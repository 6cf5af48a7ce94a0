// bench: the KV the decode steps of evaluation runs loaded.
#include "bench/kv_fetched.h"

#include <algorithm>

namespace infinigen {

KvFetchedTally::KvFetchedTally(int64_t num_layers, int64_t dense_layers)
    : dense_layers_(std::min(dense_layers, num_layers)),
      layer_loaded_(static_cast<size_t>(num_layers), 0.0),
      layer_full_(layer_loaded_),
      layer_recall_(layer_loaded_),
      layer_recall_count_(layer_loaded_) {}

void KvFetchedTally::add(const OffloadStats& stats, int64_t batch, int64_t kv_heads,
                         int64_t prompt_len) {
  const auto& steps = stats.steps();
  if (steps.size() > step_loaded_.size() + 1) {
    step_loaded_.resize(steps.size() - 1, 0.0);
    step_full_.resize(steps.size() - 1, 0.0);
  }
  for (size_t s = 1; s < steps.size(); ++s) {
    const double full =
        static_cast<double>(batch * kv_heads * (prompt_len + static_cast<int64_t>(s) - 1));
    for (size_t l = 0; l < layer_loaded_.size(); ++l) {
      const LayerTraffic& traffic = steps[s].layers[l];
      layer_loaded_[l] += static_cast<double>(traffic.tokens_fetched);
      layer_full_[l] += full;
      step_loaded_[s - 1] += static_cast<double>(traffic.tokens_fetched);
      step_full_[s - 1] += full;
      if (traffic.recall >= 0) {
        layer_recall_[l] += traffic.recall;
        layer_recall_count_[l] += 1;
      }
    }
  }
}

double KvFetchedTally::fetched() const {
  double loaded = 0, full = 0;
  for (size_t l = 0; l < layer_loaded_.size(); ++l) {
    loaded += layer_loaded_[l];
    full += layer_full_[l];
  }
  return full > 0 ? loaded / full : 0.0;
}

double KvFetchedTally::speculated_fetched() const {
  double loaded = 0, full = 0;
  for (size_t l = static_cast<size_t>(dense_layers_); l < layer_loaded_.size(); ++l) {
    loaded += layer_loaded_[l];
    full += layer_full_[l];
  }
  return full > 0 ? loaded / full : fetched();
}

std::vector<double> KvFetchedTally::layer_fetched() const {
  std::vector<double> shares;
  for (size_t l = 0; l < layer_loaded_.size(); ++l) {
    shares.push_back(layer_full_[l] > 0 ? layer_loaded_[l] / layer_full_[l] : 0.0);
  }
  return shares;
}

std::vector<double> KvFetchedTally::step_fetched() const {
  std::vector<double> shares;
  for (size_t s = 0; s < step_loaded_.size(); ++s) {
    shares.push_back(step_full_[s] > 0 ? step_loaded_[s] / step_full_[s] : 0.0);
  }
  return shares;
}

double KvFetchedTally::mean_recall() const {
  double sum = 0, count = 0;
  for (size_t l = 0; l < layer_recall_.size(); ++l) {
    sum += layer_recall_[l];
    count += layer_recall_count_[l];
  }
  return count > 0 ? sum / count : -1.0;
}

double KvFetchedTally::min_layer_recall() const {
  double worst = -1.0;
  for (size_t l = 0; l < layer_recall_.size(); ++l) {
    if (layer_recall_count_[l] == 0) continue;
    const double mean = layer_recall_[l] / layer_recall_count_[l];
    if (worst < 0 || mean < worst) worst = mean;
  }
  return worst;
}

}  // namespace infinigen
