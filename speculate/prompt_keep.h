// speculate: which prompt tokens a capped KV pool keeps when the prompt alone overflows it, and
// the eviction history they start decoding with.
//
// Without this, a pool of S positions would keep the prompt's newest S tokens: FIFO, whatever
// --eviction says, dropping the first tokens (BOS among them), which trained models attend to
// most. Here the pool's own policy decides, from the prompt's attention: every prompt position i
// counts as a decode step that fetches the tokens t <= i whose true attention logit q_i . k_t
// (q already scaled by 1/sqrt(d)) lies within alpha of that row's maximum, which is what exact
// speculation over an unlimited pool would fetch. A token's fetch count is the number of
// positions that fetch it, its last fetch the latest of them.
//
// Kept, as EvictionTable would leave a full pool: the newest S - max(1, floor(S / 2)) tokens
// (the protected half), and of the older ones the max(1, floor(S / 2)) that the policy ranks
// highest: counter by fetch count, lru by last fetch (a never-fetched token by its own
// position), fifo by age, so fifo keeps the newest S. Ties go to the newer token, as victims
// tie to the oldest.
#pragma once

#include <cstdint>
#include <vector>

#include "speculate/eviction.h"

namespace infinigen {

struct PromptKeep {
  std::vector<int32_t> tokens;      // kept token positions, ascending (all when they fit)
  std::vector<int64_t> fetches;     // per kept token: prompt positions that fetched it
  std::vector<int64_t> last_fetch;  // per kept token: the latest of them (-1: none)
};

// One (sequence, KV head) of a prompt of n positions whose valid tokens are [first, n): the scaled
// queries of the `group` query heads that share its keys (head j's rows of d floats start at
// queries + j * d, rows q_stride floats apart, e.g. a group's columns of a (n, H * d) matrix) and
// its keys (rows k_stride apart). Position i fetches a token when one head of the group attends
// to it within alpha of that head's maximum. Keeps at most `capacity` tokens.
PromptKeep keep_prompt_tokens(const float* queries, int64_t q_stride, int64_t group,
                              const float* keys, int64_t k_stride, int64_t first, int64_t n,
                              int64_t d, int64_t capacity, double alpha, EvictionPolicy policy);

// What a (sequence, KV head) of a capped pool holds already when a pass extends it (a resumed
// conversation's turn): its tokens, ascending and older than the pass's, what its eviction state
// records of each (fetches: the counter; last_fetch: the recency, -1 when never fetched) and
// their keys, rows of d fp32.
struct HeldEntries {
  std::vector<int32_t> tokens;
  std::vector<int64_t> fetches;
  std::vector<int64_t> last_fetch;
  std::vector<float> keys;
};

// keep_prompt_tokens for a pass whose rows [first, n) are tokens position0 + first .. position0 +
// n - 1, over a pool that holds `held` already: each of the pass's positions fetches among the
// held entries and the pass's tokens up to its own, its fetches add to what `held` records, and
// the tokens kept come from both (ranked as one pool, the held ones the oldest). With nothing
// held and position0 0 it is keep_prompt_tokens.
PromptKeep keep_extension_tokens(const HeldEntries& held, const float* queries, int64_t q_stride,
                                 int64_t group, const float* keys, int64_t k_stride, int64_t first,
                                 int64_t n, int64_t d, int64_t position0, int64_t capacity,
                                 double alpha, EvictionPolicy policy);

}  // namespace infinigen
