// bench: perplexity through the decode loop.
#include "bench/perplexity.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "bench/kv_fetched.h"
#include "core/error.h"

namespace infinigen {

std::vector<std::vector<int32_t>> eval_windows(const std::vector<EvalText>& texts, int64_t length,
                                               std::optional<int32_t> bos) {
  INFINIGEN_CHECK(length >= 2, "an evaluation window needs at least 2 tokens, got ", length);
  const size_t body = static_cast<size_t>(bos ? length - 1 : length);
  std::vector<std::vector<int32_t>> windows;
  for (const EvalText& text : texts) {
    for (size_t start = 0; start + body <= text.ids.size(); start += body) {
      std::vector<int32_t> window;
      if (bos) window.push_back(*bos);
      window.insert(window.end(), text.ids.begin() + static_cast<std::ptrdiff_t>(start),
                    text.ids.begin() + static_cast<std::ptrdiff_t>(start + body));
      windows.push_back(std::move(window));
    }
  }
  return windows;
}

int64_t PerplexityOptions::decode_length(int64_t max_positions) const {
  return decode > 0 ? decode : max_positions - prefill;
}

int64_t PerplexityOptions::dropped(int64_t max_positions) const {
  return PastContextOptions::dropped(prefill, decode_length(max_positions), max_positions);
}

int64_t PerplexityOptions::planned_prompt(int64_t max_positions) const {
  return prefill - dropped(max_positions);
}

void PerplexityOptions::validate(int64_t max_positions) const {
  INFINIGEN_CHECK(prefill >= 1, option("prefill"), " must be at least 1 (the BOS token), got ",
                  prefill);
  INFINIGEN_CHECK(decode >= 0, option("decode"), " must be at least 1, got ", decode);
  past.validate();
  if (past.mode == PastContext::Refuse) {
    INFINIGEN_CHECK(prefill < max_positions, option("prefill"), " ", prefill,
                    " leaves no position to decode in the model's context of ", max_positions);
    INFINIGEN_CHECK(prefill + decode_length(max_positions) <= max_positions, option("prefill"), " ",
                    prefill, " plus ", option("decode"), " ", decode,
                    " exceeds the model's context of ", max_positions, " positions (",
                    option("past_context"), " runs longer windows)");
  } else {
    INFINIGEN_CHECK(decode > 0 || prefill < max_positions, option("decode"), " must be given when ",
                    option("prefill"), " ", prefill, " passes the model's context of ",
                    max_positions);
    INFINIGEN_CHECK(decode + past.keep_prefix < max_positions, option("decode"), " ", decode,
                    " leaves no room for the kept prefix of ", past.keep_prefix,
                    " in the model's context of ", max_positions);
    const int64_t longest = past.longest_prompt(decode_length(max_positions), max_positions);
    INFINIGEN_CHECK(prefill <= longest, option("prefill"), " ", prefill, " would drop ",
                    dropped(max_positions), " tokens after the kept ", past.keep_prefix,
                    ", more than its first turn (half of it) holds: at most ", longest, " with ",
                    option("decode"), " ", decode_length(max_positions));
  }
  INFINIGEN_CHECK(chunk >= 1, option("chunk"), " must be at least 1, got ", chunk);
  INFINIGEN_CHECK(batch >= 1, option("batch"), " must be at least 1, got ", batch);
}

double PerplexityResult::perplexity() const {
  return tokens > 0 ? std::exp(nll / static_cast<double>(tokens)) : 0.0;
}

PerplexityResult measure_perplexity(const ModelSource& model,
                                    const std::vector<std::vector<int32_t>>& windows,
                                    const PerplexityOptions& options, const OffloadOptions& offload,
                                    Device device, DType kv_dtype,
                                    const std::function<void(int64_t, int64_t)>& progress) {
  const ModelConfig& config = model.config;
  options.validate(config.max_positions);
  const int64_t prefill = options.prefill, decode = options.decode_length(config.max_positions);
  const int64_t dropped = options.dropped(config.max_positions);
  INFINIGEN_CHECK(!windows.empty(), "no evaluation window to score");
  PerplexityResult result;
  const int64_t chunks = (prefill + decode - 1) / options.chunk + 1;
  std::vector<double> chunk_nll(static_cast<size_t>(chunks), 0.0);
  std::vector<int64_t> chunk_tokens(static_cast<size_t>(chunks), 0);
  KvFetchedTally tally(config.num_layers, offload.speculation.dense_layers);

  const int64_t total_steps =
      static_cast<int64_t>((windows.size() + static_cast<size_t>(options.batch) - 1) /
                           static_cast<size_t>(options.batch)) *
      decode;
  const auto start = std::chrono::steady_clock::now();
  for (size_t first = 0; first < windows.size(); first += static_cast<size_t>(options.batch)) {
    const size_t last = std::min(windows.size(), first + static_cast<size_t>(options.batch));
    GenerationRequest request;
    request.gen_len = decode;
    request.kv_dtype = kv_dtype;
    request.score_tokens = true;
    for (size_t w = first; w < last; ++w) {
      INFINIGEN_CHECK(static_cast<int64_t>(windows[w].size()) >= prefill + decode, "window ", w + 1,
                      " holds ", windows[w].size(), " tokens, fewer than ", prefill + decode);
      request.prompts.emplace_back(windows[w].begin(), windows[w].begin() + prefill);
      request.forced_tokens.emplace_back(windows[w].begin() + prefill,
                                         windows[w].begin() + prefill + decode);
    }
    const int64_t done_before =
        static_cast<int64_t>(first / static_cast<size_t>(options.batch)) * decode;
    const ProgressCallback steps_done = [&](int64_t done, int64_t) {
      if (progress) progress(done_before + done, total_steps);
    };
    // Past the context, the tokens [keep_prefix, keep_prefix + dropped) of every window go.
    const OffloadRun run = dropped > 0 ? run_past_context(model, request, options.past, decode,
                                                          dropped, offload, device, steps_done)
                                       : run_offloaded(model, request, offload, device, steps_done);

    const int64_t B = static_cast<int64_t>(request.prompts.size());
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t i = 0; i < decode; ++i) {
        const double nll = -run.result.token_log_probs[b][i];
        const size_t c = static_cast<size_t>((prefill + i) / options.chunk);
        chunk_nll[c] += nll;
        chunk_tokens[c] += 1;
        result.nll += nll;
      }
    }
    result.tokens += B * decode;
    result.windows += B;
    tally.add(run.stats, B, config.kv_heads(), prefill - dropped);
  }
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  for (int64_t c = 0; c < chunks; ++c) {
    if (chunk_tokens[c] == 0) continue;
    result.chunk_start.push_back(c * options.chunk);
    result.chunk_perplexity.push_back(
        std::exp(chunk_nll[c] / static_cast<double>(chunk_tokens[c])));
  }
  result.fetched = tally.fetched();
  result.speculated_fetched = tally.speculated_fetched();
  result.layer_fetched = tally.layer_fetched();
  result.step_fetched = tally.step_fetched();
  result.mean_recall = tally.mean_recall();
  result.min_layer_recall = tally.min_layer_recall();
  return result;
}

}  // namespace infinigen
