// offload: the recall of a staged selection.
#include "offload/staged_recall.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace infinigen {

double staged_recall(const StagedRows& staged) {
  const Tensor& keys = staged.staged_keys;
  const PartialLayer::Selection& sel = staged.selection;
  const int64_t B = keys.dim(0), H = keys.dim(1), rows = keys.dim(2), d = keys.dim(3);
  const int64_t heads = staged.queries.dim(1) / d, group = heads / H;
  const size_t row_bytes = static_cast<size_t>(d) * dtype_size(keys.dtype());
  const float* q = staged.queries.data<float>();  // (B, heads * d), scaled
  std::vector<float> key(static_cast<size_t>(d));
  std::vector<double> logits;
  double total_recall = 0.0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t take = sel.take[static_cast<size_t>(b)];
    for (int64_t g = 0; g < H; ++g) {
      // Per query head of the group: the share of its attention weight that the staged rows of
      // its KV head carry.
      for (int64_t head = g * group; head < (g + 1) * group; ++head) {
        const float* query = q + (b * heads + head) * d;
        const auto logit = [&](const void* row) {
          convert_to_f32(row, keys.dtype(), key.data(), key.size());
          double dot = 0.0;
          for (int64_t c = 0; c < d; ++c) dot += static_cast<double>(query[c]) * key[c];
          return dot;
        };
        // Over the pool's valid entries, and the current token (row `fetch` of the staging).
        logits.assign(static_cast<size_t>(staged.positions), -INFINITY);
        for (int64_t pos = 0; pos < staged.positions; ++pos) {
          if (const void* row = staged.pool_key(b, g, pos)) logits[static_cast<size_t>(pos)] = logit(row);
        }
        const size_t current_row = static_cast<size_t>((b * H + g) * rows + sel.fetch);
        const double current =
            logit(static_cast<const char*>(keys.raw()) + current_row * row_bytes);
        double top = current;
        for (double v : logits) top = std::max(top, v);
        double all = std::exp(current - top), kept = all;
        for (double v : logits) all += std::exp(v - top);
        const int32_t* positions = sel.tokens.data() + (b * H + g) * sel.fetch;
        for (int64_t j = 0; j < take; ++j) kept += std::exp(logits[positions[j]] - top);
        total_recall += kept / all;
      }
    }
  }
  return total_recall / static_cast<double>(B * heads);
}

}  // namespace infinigen
