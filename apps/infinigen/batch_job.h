// apps/infinigen: what the parts of an `infinigen batch` job share: its options, a request made
// ready to run, the job's totals, and a choice's log-probabilities.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "apps/infinigen/batch_input.h"
#include "apps/infinigen/batch_output.h"
#include "apps/infinigen/option_flags.h"
#include "core/generation.h"
#include "core/model_loader.h"
#include "offload/runtime.h"
#include "offload/session_tier.h"

namespace infinigen::cli {

// The options of `infinigen batch` (docs/batch.md), each declared with its flag in cmd_batch.cc.
struct BatchOptions : GenerationFlags, OverflowFlags {
  std::string input;
  std::string output;
  int64_t batch = 8;  // sequences per batch
  std::string order = "length";
  std::string shard;                   // "I/N"; empty: from the environment
  std::optional<int64_t> shard_count;  // a Kubernetes Indexed Job's completions; --merge's shards
  bool merge = false;
  bool json = false;
  std::string session_root;                          // requests' session names live here
  std::string session_cache = kSessionCacheDefault;  // the host-memory tier's budget
  bool session_prefetch = true;  // the next turn's session read into the tier during a pass
};

// A request ready to run: its prompts as token ids and its settings resolved.
struct PreparedRequest {
  const BatchRequest* request = nullptr;
  std::vector<std::vector<int32_t>> prompts;  // BOS first for a text prompt
  int64_t max_tokens = 0;
  SamplingOptions sampling;  // choice i draws with seed + i
  int64_t longest() const {
    int64_t n = 0;
    for (const auto& p : prompts) n = std::max<int64_t>(n, std::ssize(p));
    return n;
  }
};

// What the job did, for the summary.
struct JobTotals {
  int64_t input_requests = 0;
  int64_t share = 0;         // this shard's requests
  int64_t already_done = 0;  // with a line before this run
  int64_t completed = 0;     // run now
  int64_t errors = 0;        // error lines written now
  int64_t batches = 0;
  int64_t sequences = 0;
  int64_t prompt_tokens = 0;
  int64_t padded_prompt_rows = 0;  // sum over batches of batch * longest prompt
  int64_t generated_tokens = 0;
  // Prompt tokens not computed or stored again: shared prefixes (n samples of one prompt, prompts
  // that begin alike) counted once per member less once per group.
  int64_t shared_prefix_tokens = 0;
  int64_t decode_steps = 0;
  // Sum over batches of batch * token positions generated: the rows of a static batch's steps,
  // of which those beyond generated_tokens belonged to sequences that had ended.
  int64_t generated_rows = 0;
  // Of those, the rows the steps computed (GenerationResult::rows): an ended sequence's rows
  // are not, once the store drops it (KvStore::drop_sequences).
  int64_t computed_rows = 0;
  double seconds = 0.0;
  // Session turns (one pass each), by where their history came from: the tier (hot), the disk
  // (cold), or nowhere (a session's first turn); and their times to first token.
  int64_t session_turns = 0;
  int64_t hot_turns = 0, cold_turns = 0;
  std::vector<double> hot_ttft, cold_ttft;  // per turn, seconds
  uint64_t hot_bytes = 0, cold_bytes = 0;  // history bytes from the tier, the disk
  int64_t recovered_lines = 0;             // lines found committed in a session (a killed run's)
  SessionTierStats tier;
  uint64_t prefetch_bytes = 0;

  // One pass of the engine (a batch, or a session's turn) of the longest prompt `longest`: its
  // sequences, rows, steps, shared prefixes and time (tokens are counted by the caller).
  void add_pass(const OffloadRun& run, int64_t longest);
};

// Sequence b's log-probabilities for a choice whose text is the first `text_size` bytes of its
// tokens' (what a stop string left): the tokens that begin within it, each with the `k` most
// likely tokens at its position (and itself, when not among them).
ChoiceLogprobs choice_logprobs(const ModelSource& model, const GenerationResult& result, int64_t b,
                               int64_t k, size_t text_size);

}  // namespace infinigen::cli
