// offload: --check-recall's diagnostic: the share of a layer's attention weight that the rows a
// selection staged carry, per query head, against attention over every entry the pool holds. It
// reads the pool and the staging on the host, so it is for checking a policy, not for speed.
#pragma once

#include <cstdint>
#include <functional>

#include "core/tensor.h"
#include "speculate/speculation.h"

namespace infinigen {

struct StagedRows {
  const Tensor& queries;      // (B, H * d) fp32, scaled: the layer's decode queries
  const Tensor& staged_keys;  // (B, H_kv, rows, d): (b, g)'s rows [fetch - take[b], fetch) hold
                              // the selected positions, row `fetch` the new token
  const PartialLayer::Selection& selection;
  int64_t positions;  // pool positions in use
  // The key at pool position p of (b, g), in the staging's dtype; null when it holds no earlier
  // token of sequence b (padding, empty, or the new token itself).
  std::function<const void*(int64_t b, int64_t g, int64_t position)> pool_key;
};

// The mean over (sequence, query head) of the softmax weight on the staged rows (the new token
// included) over the pool's entries and the new token.
double staged_recall(const StagedRows& staged);

}  // namespace infinigen
