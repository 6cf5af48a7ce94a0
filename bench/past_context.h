// bench: prompts longer than the model's context in `infinigen eval` (--past-context, both
// tasks). Such a prompt is refused; or it runs as a conversation of two turns (the prompt's first
// half, then the rest) whose second turn drops the oldest history after a kept prefix
// (DiskSession::drop_oldest: the kept KV as the first turn computed it, moved to its new
// positions, docs/sessions.md "Overflow"); or it runs once over the same kept tokens computed from
// scratch, which is what the truncation is measured against. Either way the tokens
// [keep_prefix, keep_prefix + dropped) of every prompt are gone, where dropped is what the prompt
// and the tokens after it pass the context by.
#pragma once

#include <cstdint>
#include <string_view>

#include "offload/runtime.h"
#include "offload/session.h"

namespace infinigen {

enum class PastContext { Refuse, DropOldest, Recompute };
// "refuse", "drop-oldest" or "recompute"; one-line Error naming --past-context otherwise.
PastContext parse_past_context(std::string_view text);
const char* past_context_name(PastContext mode);

struct PastContextOptions {
  PastContext mode = PastContext::Refuse;
  int64_t keep_prefix = kSessionKeepPrefix;  // tokens a prompt past the context keeps first

  // Tokens a prompt of `length` followed by `generated` tokens drops after keep_prefix to fit
  // `max_positions`: 0 when it fits.
  static int64_t dropped(int64_t length, int64_t generated, int64_t max_positions);
  // The longest prompt that runs with `generated` tokens after it: what fits the context when
  // refused; else twice what fits after the kept prefix (the first turn, the prompt's first
  // half, must hold the kept prefix and every dropped token).
  int64_t longest_prompt(int64_t generated, int64_t max_positions) const;
  // One-line Error naming --keep-prefix when it is negative.
  void validate() const;
};

// Runs `request` (every prompt of one length, past the context by `dropped` tokens with the
// `generated` tokens after it) as `past.mode` says, DropOldest or Recompute. Every sequence runs
// request.gen_len tokens after its prompt (a conversation's turn has one length); its forced
// tokens, if any, are forced in the turn that generates. `progress` follows that turn.
OffloadRun run_past_context(const ModelSource& model, GenerationRequest request,
                            const PastContextOptions& past, int64_t generated, int64_t dropped,
                            const OffloadOptions& offload, Device device,
                            const ProgressCallback& progress);

}  // namespace infinigen
