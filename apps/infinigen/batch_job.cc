// apps/infinigen: the shared parts of a batch job: its totals and a choice's log-probabilities.
#include "apps/infinigen/batch_job.h"

namespace infinigen::cli {

void JobTotals::add_pass(const OffloadRun& run, int64_t longest) {
  const int64_t B = std::ssize(run.result.tokens);
  batches += 1;
  sequences += B;
  padded_prompt_rows += B * longest;
  decode_steps += run.result.gen_len;
  generated_rows += B * run.result.gen_len;
  computed_rows += run.result.rows;
  shared_prefix_tokens += run.shared_prefixes.member_tokens() - run.shared_prefixes.kept_tokens();
  seconds += run.result.total_seconds();
}

ChoiceLogprobs choice_logprobs(const ModelSource& model, const GenerationResult& result, int64_t b,
                               int64_t k, size_t text_size) {
  const std::vector<int32_t>& tokens = result.tokens[b];
  const std::vector<std::vector<TokenLogProb>>& most_likely = result.top_log_probs[b];
  ChoiceLogprobs out;
  std::vector<int32_t> before;
  for (size_t i = 0; i < tokens.size(); ++i) {
    const size_t offset = token_text(model, before).size();
    if (offset >= text_size) break;
    const double log_prob = result.token_log_probs[b][i];
    out.tokens.push_back(token_text(model, {tokens[i]}));
    out.token_logprobs.push_back(log_prob);
    out.text_offset.push_back(static_cast<int64_t>(offset));
    // The batch asked for the most k of its requests: this one's first k, and the chosen token.
    std::vector<std::pair<std::string, double>> top;
    bool chosen_listed = false;
    static const std::vector<TokenLogProb> none;  // every request of the batch asked for 0
    for (const TokenLogProb& t : i < most_likely.size() ? most_likely[i] : none) {
      if (std::ssize(top) >= k) break;
      top.emplace_back(token_text(model, {t.token}), t.log_prob);
      chosen_listed = chosen_listed || t.token == tokens[i];
    }
    if (!chosen_listed) top.emplace_back(out.tokens.back(), log_prob);
    out.top_logprobs.push_back(std::move(top));
    before.push_back(tokens[i]);
  }
  return out;
}

}  // namespace infinigen::cli
