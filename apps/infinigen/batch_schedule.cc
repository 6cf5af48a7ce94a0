// apps/infinigen: grouping batch requests.
#include "apps/infinigen/batch_schedule.h"

#include <algorithm>
#include <numeric>

#include "core/error.h"

namespace infinigen::cli {
namespace {

// Batches' worth of sequences, neighbours by prompt length, regrouped by max_tokens.
constexpr int64_t kWindowBatches = 4;

}  // namespace

std::vector<std::vector<size_t>> group_requests(const std::vector<RequestShape>& shapes,
                                                int64_t batch, BatchOrder order) {
  INFINIGEN_CHECK(batch >= 1, "--batch must be at least 1, got ", batch);
  std::vector<size_t> sequence(shapes.size());
  std::iota(sequence.begin(), sequence.end(), size_t{0});
  if (order == BatchOrder::ByLength) {
    std::stable_sort(sequence.begin(), sequence.end(), [&](size_t a, size_t b) {
      return shapes[a].prompt_len < shapes[b].prompt_len;
    });
    // Then by max_tokens within windows of kWindowBatches batches' worth of sequences, whose
    // prompts are of nearly one length: a batch runs until its last sequence ends, and a slot
    // freed before that is not refilled, so sequences that end together should share one (its
    // steps then stay full).
    for (size_t begin = 0; begin < sequence.size();) {
      size_t end = begin;
      for (int64_t filled = 0; end < sequence.size() && filled < kWindowBatches * batch; ++end) {
        filled += shapes[sequence[end]].sequences;
      }
      std::stable_sort(
          sequence.begin() + static_cast<std::ptrdiff_t>(begin),
          sequence.begin() + static_cast<std::ptrdiff_t>(end),
          [&](size_t a, size_t b) { return shapes[a].max_tokens < shapes[b].max_tokens; });
      begin = end;
    }
  }
  std::vector<std::vector<size_t>> batches;
  int64_t filled = batch;  // sequences in the last batch
  for (size_t i : sequence) {
    INFINIGEN_CHECK(shapes[i].sequences <= batch, "a request of ", shapes[i].sequences,
                    " sequences does not fit a batch of ", batch);
    if (filled + shapes[i].sequences > batch) {
      batches.emplace_back();
      filled = 0;
    }
    batches.back().push_back(i);
    filled += shapes[i].sequences;
  }
  return batches;
}

}  // namespace infinigen::cli
