// core: next-token selection from logits: greedy, or seeded temperature / nucleus (top-p).
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "core/error.h"
#include "core/tensor.h"

namespace infinigen {

struct SamplingOptions {
  float temperature = 0.0f;  // 0 = greedy (argmax, lowest id on ties)
  float top_p = 1.0f;        // nucleus mass in (0, 1]
  uint64_t seed = 0;
};

// A logit that is a NaN or an infinity: a kernel read memory never written, or the weights
// themselves are not finite (offload/runtime.cc then names the tensor).
class NonFiniteLogit : public Error {
 public:
  using Error::Error;
};

// log softmax(logits)[token] of one row of V logits, in fp64; NonFiniteLogit when a logit is not
// finite.
double token_log_probability(const float* logits, int64_t vocab, int32_t token);

struct TokenLogProb {
  int32_t token = 0;
  double log_prob = 0.0;
};
// The k most likely tokens of one row of V logits with their log softmax, most likely first
// (ties: the lower id first), and `also` appended when it is not among them (-1: nothing);
// NonFiniteLogit as above.
std::vector<TokenLogProb> top_log_probabilities(const float* logits, int64_t vocab, int64_t k,
                                                int32_t also = -1);

class Sampler {
 public:
  explicit Sampler(const SamplingOptions& options);
  // logits (B, V) fp32 on the CPU -> one token per row. Draws are a pure function of the seed
  // and the sequence of calls (the same on every platform: no std distributions).
  std::vector<int32_t> sample(const Tensor& logits);
  // One row of `vocab` logits -> its token (one draw when sampling).
  int32_t sample_row(const float* logits, int64_t vocab);

 private:
  double uniform();  // [0, 1)

  SamplingOptions options_;
  std::mt19937_64 rng_;
};

}  // namespace infinigen
