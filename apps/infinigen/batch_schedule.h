// apps/infinigen: which requests of a batch job run together. Requests are whole units (all the
// sequences of one request, its prompts times n, run in one batch: their samples share the
// prompt's KV and their output line is written at once); batches are static: a finished
// sequence leaves its batch (no later step computes or loads for it), and its slot is not
// refilled (docs/batch.md).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace infinigen::cli {

// What the grouping needs to know of one request.
struct RequestShape {
  int64_t sequences = 1;   // prompts times n, at most the batch
  int64_t prompt_len = 0;  // its longest prompt in tokens
  int64_t max_tokens = 0;
};

enum class BatchOrder {
  // By prompt length (little padding), then by max_tokens within windows of a few batches of
  // neighbouring lengths (a batch's sequences ending together).
  ByLength,
  Arrival,  // in input order (what a plain run over the file would do)
};

// Batches of at most `batch` sequences (each request's shape.sequences <= batch), as indices into
// `shapes`; requests that compare equal keep their input order. Deterministic.
std::vector<std::vector<size_t>> group_requests(const std::vector<RequestShape>& shapes,
                                                int64_t batch, BatchOrder order);

}  // namespace infinigen::cli
