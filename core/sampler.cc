// core: greedy and temperature/top-p sampling.
#include "core/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/error.h"
#include "core/trace.h"

namespace infinigen {

namespace {

// A NaN or infinity here means a kernel read memory that was never written or transferred:
// stop rather than emit a token picked from garbage, or score one against it.
void check_finite(const float* logits, int64_t V) {
  for (int64_t i = 0; i < V; ++i) {
    if (!std::isfinite(logits[i])) {
      throw NonFiniteLogit(cat("non-finite logit (", logits[i], ") for token ", i,
                               ": the forward pass read invalid data"));
    }
  }
}

// log sum exp of one row, in fp64: log softmax(logits)[i] is logits[i] minus it.
double log_normalizer(const float* logits, int64_t V) {
  check_finite(logits, V);
  const double top = *std::max_element(logits, logits + V);
  double total = 0.0;
  for (int64_t i = 0; i < V; ++i) total += std::exp(static_cast<double>(logits[i]) - top);
  return top + std::log(total);
}

}  // namespace

double token_log_probability(const float* logits, int64_t V, int32_t token) {
  INFINIGEN_CHECK(token >= 0 && token < V, "token ", token, " outside a vocabulary of ", V);
  return static_cast<double>(logits[token]) - log_normalizer(logits, V);
}

std::vector<TokenLogProb> top_log_probabilities(const float* logits, int64_t V, int64_t k,
                                                int32_t also) {
  INFINIGEN_CHECK(k >= 0 && also < V, "top_log_probabilities: k ", k, ", token ", also,
                  " with a vocabulary of ", V);
  const double normalizer = log_normalizer(logits, V);
  std::vector<int32_t> ids(static_cast<size_t>(V));
  std::iota(ids.begin(), ids.end(), 0);
  const auto more_likely = [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  };
  const int64_t kept = std::min(k, V);
  std::partial_sort(ids.begin(), ids.begin() + kept, ids.end(), more_likely);
  ids.resize(static_cast<size_t>(kept));
  if (also >= 0 && std::find(ids.begin(), ids.end(), also) == ids.end()) ids.push_back(also);
  std::vector<TokenLogProb> top;
  for (int32_t id : ids) top.push_back({id, static_cast<double>(logits[id]) - normalizer});
  return top;
}

Sampler::Sampler(const SamplingOptions& options) : options_(options), rng_(options.seed) {
  INFINIGEN_CHECK(options.temperature >= 0.0f && std::isfinite(options.temperature),
                  option("temperature"), " must be >= 0, got ", options.temperature);
  INFINIGEN_CHECK(options.top_p > 0.0f && options.top_p <= 1.0f, option("top_p"),
                  " must be in (0, 1], got ", options.top_p);
}

std::vector<int32_t> Sampler::sample(const Tensor& logits) {
  const int64_t B = logits.dim(0), V = logits.dim(1);
  if (traced("sample", {B, V})) return std::vector<int32_t>(static_cast<size_t>(B), 0);
  const float* data = logits.data<float>();
  std::vector<int32_t> out(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) out[static_cast<size_t>(b)] = sample_row(data + b * V, V);
  return out;
}

double Sampler::uniform() {
  return static_cast<double>(rng_() >> 11) * (1.0 / 9007199254740992.0);  // 53 random bits
}

int32_t Sampler::sample_row(const float* logits, int64_t V) {
  check_finite(logits, V);
  if (options_.temperature == 0.0f) {
    return static_cast<int32_t>(std::max_element(logits, logits + V) - logits);
  }
  // Softmax at temperature T, in fp64 for a stable cumulative sum.
  const float top = *std::max_element(logits, logits + V);
  std::vector<double> probs(static_cast<size_t>(V));
  double total = 0.0;
  for (int64_t i = 0; i < V; ++i) {
    probs[i] = std::exp(static_cast<double>(logits[i] - top) / options_.temperature);
    total += probs[i];
  }
  std::vector<int32_t> order(static_cast<size_t>(V));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return probs[a] > probs[b]; });
  // The nucleus: the fewest most-likely tokens whose mass reaches top_p.
  size_t keep = 0;
  double mass = 0.0;
  while (keep < order.size() && (keep == 0 || mass < options_.top_p * total)) {
    mass += probs[order[keep++]];
  }
  double target = uniform() * mass;
  for (size_t i = 0; i < keep; ++i) {
    target -= probs[order[i]];
    if (target < 0.0) return order[i];
  }
  return order[keep - 1];
}

}  // namespace infinigen
