// core: the generation loop.
#include "core/generation.h"

#include <algorithm>
#include <chrono>
#include <random>

#include "core/error.h"
#include "core/interrupt.h"
#include "core/op_profile.h"
#include "core/trace.h"

namespace infinigen {
namespace {

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

double GenerationResult::throughput() const {
  return total_seconds() > 0 ? static_cast<double>(batch * gen_len) / total_seconds() : 0.0;
}

double GenerationResult::decode_throughput() const {
  return decode_seconds > 0 ? static_cast<double>(batch * (gen_len - 1)) / decode_seconds : 0.0;
}

std::vector<int32_t> left_pad(const std::vector<std::vector<int32_t>>& prompts, int32_t pad_id,
                              std::vector<int32_t>* first_valid) {
  size_t n = 0;
  for (const auto& p : prompts) n = std::max(n, p.size());
  std::vector<int32_t> tokens(prompts.size() * n, pad_id);
  first_valid->clear();
  for (size_t b = 0; b < prompts.size(); ++b) {
    const size_t start = n - prompts[b].size();
    std::copy(prompts[b].begin(), prompts[b].end(), tokens.begin() + b * n + start);
    first_valid->push_back(static_cast<int32_t>(start));
  }
  return tokens;
}

int64_t first_pass_rows(const std::vector<std::vector<int32_t>>& prompts,
                        const std::vector<std::vector<int32_t>>* history,
                        const SharedPrefixes& shared) {
  int64_t own = 0;
  for (size_t b = 0; b < prompts.size(); ++b) {
    const int64_t before = history ? std::ssize((*history)[b]) : 0;
    own = std::max(own,
                   before + std::ssize(prompts[b]) - shared.prefix_length(static_cast<int64_t>(b)));
  }
  return shared.rows() + own;
}

void check_context(const ModelConfig& config, int64_t longest, int64_t gen_len) {
  INFINIGEN_CHECK(longest < config.max_positions, "a prompt of ", longest,
                  " tokens leaves no room to generate in the model's context of ",
                  config.max_positions, " positions");
  INFINIGEN_CHECK(gen_len <= config.max_positions - longest, option("gen_len"), " ", gen_len,
                  ": prompt (", longest, " tokens) plus generation exceeds the model's context of ",
                  config.max_positions, " positions");
}

void check_conversation_context(const ModelConfig& config, size_t sequence, int64_t total,
                                int64_t gen_len) {
  // Learned positions (OPT) cannot be shifted to make room; rotary ones could be, by re-rotating
  // the kept keys (not done yet).
  INFINIGEN_CHECK(total < config.max_positions && gen_len <= config.max_positions - total,
                  "sequence ", sequence + 1, ": the conversation reaches ", total,
                  " tokens with this turn's prompt, and ", gen_len,
                  " more exceed the model's context of ", config.max_positions,
                  " positions; start a new session");
}

int64_t check_request(const ModelConfig& config, const GenerationRequest& request,
                      const std::vector<std::vector<int32_t>>* history) {
  INFINIGEN_CHECK(!request.prompts.empty(), option("batch"), " must be at least 1");
  INFINIGEN_CHECK(request.gen_len > 0, option("gen_len"), " must be at least 1, got ",
                  request.gen_len);
  int64_t longest = 0;
  for (size_t b = 0; b < request.prompts.size(); ++b) {
    const auto& prompt = request.prompts[b];
    INFINIGEN_CHECK(!prompt.empty(), "prompt ", b + 1, " is empty");
    for (int32_t id : prompt) {
      INFINIGEN_CHECK(id >= 0 && id < config.vocab_size, "prompt ", b + 1, ": token id ", id,
                      " is outside the model's vocabulary of ", config.vocab_size);
    }
    longest = std::max<int64_t>(longest, static_cast<int64_t>(prompt.size()));
  }
  if (history) {
    INFINIGEN_CHECK(history->size() == request.prompts.size(), "a conversation of ",
                    history->size(), " sequences continued with ", request.prompts.size(),
                    " prompts");
    longest = 0;
    for (size_t b = 0; b < history->size(); ++b) {
      for (int32_t id : (*history)[b]) {
        INFINIGEN_CHECK(id >= 0 && id < config.vocab_size, "sequence ", b + 1,
                        ": the conversation holds token id ", id,
                        ", outside the model's vocabulary of ", config.vocab_size);
      }
      const int64_t total = static_cast<int64_t>((*history)[b].size() + request.prompts[b].size());
      check_conversation_context(config, b, total, request.gen_len);
      longest = std::max(longest, total);
    }
  }
  check_context(config, longest, request.gen_len);
  const SharedPrefixes& shared = request.shared_prefixes;
  if (!shared.empty()) {
    INFINIGEN_CHECK(!history, "a conversation's turn cannot share a prompt prefix");
    INFINIGEN_CHECK(shared.batch() == std::ssize(request.prompts), "shared prefixes of ",
                    shared.batch(), " sequences for ", request.prompts.size(), " prompts");
    for (size_t b = 0; b < request.prompts.size(); ++b) {
      const auto& prompt = request.prompts[b];
      const auto& leader = request.prompts[static_cast<size_t>(shared.source(b))];
      const int64_t length = shared.prefix_length(b);
      INFINIGEN_CHECK(std::ssize(prompt) > length && std::ssize(leader) >= length &&
                          std::equal(prompt.begin(), prompt.begin() + length, leader.begin()),
                      "prompt ", b + 1, " does not continue the ", length,
                      "-token prefix it is said to share with prompt ", shared.source(b) + 1);
    }
  }
  INFINIGEN_CHECK(request.sequence_sampling.empty() ||
                      request.sequence_sampling.size() == request.prompts.size(),
                  "sampling settings for ", request.sequence_sampling.size(),
                  " sequences in a batch of ", request.prompts.size());
  INFINIGEN_CHECK(
      request.sequence_gen_len.empty() || request.sequence_gen_len.size() == request.prompts.size(),
      "generation lengths for ", request.sequence_gen_len.size(), " sequences in a batch of ",
      request.prompts.size());
  for (size_t b = 0; b < request.sequence_gen_len.size(); ++b) {
    const int64_t length = request.sequence_gen_len[b];
    INFINIGEN_CHECK(length >= 1 && length <= request.gen_len, "sequence ", b + 1, ": ", length,
                    " tokens to generate, outside [1, ", request.gen_len, "]");
  }
  if (!request.forced_tokens.empty()) {
    INFINIGEN_CHECK(request.forced_tokens.size() == request.prompts.size(), "forced tokens for ",
                    request.forced_tokens.size(), " sequences in a batch of ",
                    request.prompts.size());
    for (size_t b = 0; b < request.forced_tokens.size(); ++b) {
      const auto& forced = request.forced_tokens[b];
      INFINIGEN_CHECK(static_cast<int64_t>(forced.size()) == request.gen_len, "sequence ", b + 1,
                      ": ", forced.size(), " forced tokens for ", request.gen_len, " steps");
      for (int32_t id : forced) {
        INFINIGEN_CHECK(id >= 0 && id < config.vocab_size, "sequence ", b + 1, ": forced token ",
                        id, " is outside the model's vocabulary of ", config.vocab_size);
      }
    }
  }
  return longest;
}

namespace {

// The first pass of a turn that continues a conversation: per sequence its history, then its
// prompt, left-padded to the longest (after the shared prefixes' rows, when the conversation
// shares some: a sequence's own history follows them); the pass covers the last n rows (n: the
// longest prompt), so a sequence with a shorter prompt computes its last history tokens again.
// Returns the pass's tokens (B, n) and fills first_valid (B) and the rows stored before the pass
// (`rows` after it: first_pass_rows).
std::vector<int32_t> continuation_pass(const std::vector<std::vector<int32_t>>& history,
                                       const std::vector<std::vector<int32_t>>& prompts,
                                       int32_t pad_id, const SharedPrefixes& shared, int64_t rows,
                                       std::vector<int32_t>* first_valid, int64_t* stored) {
  const size_t B = prompts.size();
  int64_t n = 0;
  for (const auto& p : prompts) n = std::max<int64_t>(n, std::ssize(p));
  *stored = rows - n;
  first_valid->assign(B, 0);
  std::vector<int32_t> tokens(B * static_cast<size_t>(n), pad_id);
  for (size_t b = 0; b < B; ++b) {
    const int64_t prefix = shared.prefix_length(static_cast<int64_t>(b));
    const int64_t h = std::ssize(history[b]) - prefix;  // its own history
    const int64_t start = rows - h - std::ssize(prompts[b]);
    (*first_valid)[b] = static_cast<int32_t>(start);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t j = *stored + i - start;  // index in the sequence's own conversation
      if (j < 0) continue;
      tokens[b * static_cast<size_t>(n) + static_cast<size_t>(i)] =
          j < h ? history[b][static_cast<size_t>(prefix + j)]
                : prompts[b][static_cast<size_t>(j - h)];
    }
  }
  return tokens;
}

// The sharing pass's tokens (G, shared.rows()): each group's prefix, from its leader's prompt,
// left-padded (SharedPrefixes::leader_first_valid).
std::vector<int32_t> shared_prefix_tokens(const std::vector<std::vector<int32_t>>& prompts,
                                          const SharedPrefixes& shared, int32_t pad_id) {
  const int64_t S = shared.rows();
  std::vector<int32_t> tokens(static_cast<size_t>(shared.num_groups() * S), pad_id);
  for (int64_t g = 0; g < shared.num_groups(); ++g) {
    const auto& prompt = prompts[static_cast<size_t>(shared.leaders()[static_cast<size_t>(g)])];
    std::copy_n(prompt.begin(), shared.length(g), tokens.begin() + (g + 1) * S - shared.length(g));
  }
  return tokens;
}

// The first pass's tokens when groups of the prompts share prefixes: each sequence's own tokens
// (B, n) left-padded to the longest, n the longest own part; fills first_valid (B): where each
// sequence's own tokens start, after the shared rows.
std::vector<int32_t> own_tokens_after(const std::vector<std::vector<int32_t>>& prompts,
                                      const SharedPrefixes& shared, int32_t pad_id,
                                      std::vector<int32_t>* first_valid) {
  std::vector<std::vector<int32_t>> own;
  own.reserve(prompts.size());
  for (size_t b = 0; b < prompts.size(); ++b) {
    own.emplace_back(prompts[b].begin() + shared.prefix_length(static_cast<int64_t>(b)),
                     prompts[b].end());
  }
  std::vector<int32_t> tokens = left_pad(own, pad_id, first_valid);
  for (int32_t& start : *first_valid) start += static_cast<int32_t>(shared.rows());
  return tokens;
}

// Drops the sequences that ended from `store` (KvStore::drop_sequences): `live` (the sequence
// of each store row) and `next` (each row's next token) keep the rows of those still running.
void drop_ended(KvStore& store, const std::vector<bool>& ended, std::vector<int64_t>& live,
                std::vector<int32_t>& next) {
  std::vector<int64_t> keep;
  for (int64_t i = 0; i < std::ssize(live); ++i) {
    if (!ended[static_cast<size_t>(live[i])]) keep.push_back(i);
  }
  store.drop_sequences(keep);
  compact_batch(live, keep, 1);
  compact_batch(next, keep, 1);
}

// Row i of a step's logits (rows, V) into row live[i] of `all` (B, V).
void keep_rows(const Tensor& logits, const std::vector<int64_t>& live, Tensor& all) {
  const int64_t V = logits.dim(1);
  for (int64_t i = 0; i < std::ssize(live); ++i) {
    std::copy_n(logits.data<float>() + i * V, V, all.data<float>() + live[i] * V);
  }
}

}  // namespace

GenerationResult generate(Model& model, const GenerationRequest& request,
                          const ProgressCallback& progress, const KvStoreFactory& make_store,
                          Conversation* conversation) {
  const ModelConfig& config = model.config();
  const int64_t B = static_cast<int64_t>(request.prompts.size());
  const std::vector<std::vector<int32_t>>* history =
      conversation && !conversation->history().empty() ? &conversation->history() : nullptr;
  const int64_t longest = check_request(config, request, history);
  // A conversation keeps gen_len tokens of every sequence.
  INFINIGEN_CHECK(!conversation || (request.sequence_gen_len.empty() && !request.stop),
                  "a conversation's turn cannot end its sequences at different lengths");

  GenerationResult result;
  result.batch = B;
  result.prompt_len = longest;
  result.gen_len = request.gen_len;
  result.tokens.assign(static_cast<size_t>(B), {});
  Sampler sampler(request.sampling);
  std::vector<Sampler> own_samplers(request.sequence_sampling.begin(),
                                    request.sequence_sampling.end());
  // Sequences that ended (their length, or the stop callback); the loop ends when all have.
  std::vector<bool> ended(static_cast<size_t>(B), false);
  int64_t running = B;
  // (rows of the store): the sequence each row of the store, and of a step's logits, is: every
  // sequence until the store drops those that ended (`dropping` below).
  std::vector<int64_t> live(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) live[b] = b;
  const auto sequence_gen_len = [&](int64_t b) {
    return request.sequence_gen_len.empty() ? request.gen_len : request.sequence_gen_len[b];
  };
  // The tokens of step `step` (0 = chosen from the prefill's logits), one per row of `logits`
  // (the live sequences'), sampled or forced, scored against the logits they follow when asked
  // to. An ended sequence that keeps its row draws nothing and keeps nothing: it is fed its last
  // token again.
  const auto emit = [&](int64_t step, const Tensor& logits) {
    const int64_t rows = std::ssize(live), V = logits.dim(1);
    std::vector<int32_t> chosen(static_cast<size_t>(rows));
    if (!request.forced_tokens.empty()) {
      for (int64_t i = 0; i < rows; ++i) chosen[i] = request.forced_tokens[live[i]][step];
    } else if (own_samplers.empty()) {
      chosen = sampler.sample(logits);
    } else if (!traced("sample", {rows, V})) {
      for (int64_t i = 0; i < rows; ++i) {
        const int64_t b = live[i];
        chosen[i] = ended[b] ? result.tokens[b].back()
                             : own_samplers[b].sample_row(logits.data<float>() + i * V, V);
      }
    }
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t b = live[i];
      if (ended[b]) continue;
      result.tokens[b].push_back(chosen[i]);
      if (request.score_tokens) {
        const float* row = logits.data<float>() + i * V;
        result.token_log_probs[b].push_back(token_log_probability(row, V, chosen[i]));
        if (request.top_log_probs > 0) {
          result.top_log_probs[b].push_back(
              top_log_probabilities(row, V, request.top_log_probs, chosen[i]));
        }
      }
      // The callback sees every token, the last one too (it reports why a sequence ended).
      const bool stopped = request.stop && request.stop(b, result.tokens[b]);
      if (stopped || std::ssize(result.tokens[b]) >= sequence_gen_len(b)) {
        ended[b] = true;
        --running;
      }
    }
    result.rows += rows;
    return chosen;
  };
  if (request.score_tokens) {
    result.token_log_probs.assign(static_cast<size_t>(B), {});
    result.top_log_probs.assign(static_cast<size_t>(B), {});
  }
  std::vector<int32_t> first_valid;
  int64_t stored = 0;  // rows per sequence stored before the first pass
  // A conversation's turns share what its first turn shared.
  const SharedPrefixes& shared =
      history ? conversation->shared_prefixes() : request.shared_prefixes;
  const int64_t rows = first_pass_rows(request.prompts, history, shared);
  std::vector<int32_t> tokens;
  if (history) {
    tokens = continuation_pass(*history, request.prompts, config.pad_token_id, shared, rows,
                               &first_valid, &stored);
  } else if (!shared.empty()) {
    tokens = own_tokens_after(request.prompts, shared, config.pad_token_id, &first_valid);
  } else {
    tokens = left_pad(request.prompts, config.pad_token_id, &first_valid);
  }
  const int64_t capacity = rows + request.gen_len;
  std::unique_ptr<KvStore> store =
      make_store ? make_store(B, capacity)
                 : std::make_unique<KvCache>(config, B, capacity, request.kv_dtype, model.device());
  KvStore& cache = *store;
  // The activations of the largest pass, allocated before the first: the first pass (the prompt,
  // or its part after the shared prefixes; a chunk of it when it is computed in chunks), the
  // sharing pass (each group's leader), and the decode steps (one row per sequence) all fit in
  // them.
  model.reserve_activations(B, largest_prompt_pass(std::ssize(tokens) / B, request.prefill_chunk));
  if (!shared.empty()) model.reserve_activations(shared.num_groups(), shared.rows());
  if (!shared.empty()) cache.share_prefixes(shared, first_valid);
  // Where each sequence's rows of this turn start: after its own history.
  std::vector<int32_t> turn_rows(first_valid);
  if (history) {
    for (int64_t b = 0; b < B; ++b) {
      turn_rows[b] += static_cast<int32_t>(std::ssize((*history)[b]) - shared.prefix_length(b));
    }
    cache.resume(stored, first_valid, config.num_layers, [conversation](int64_t layer, KvStore& s) {
      conversation->restore_layer(layer, s);
    });
  }

  // Whether ended sequences leave the batch (their rows dropped from the store) instead of
  // staying in it to the end: when the store can drop them, and the survivors' tokens cannot
  // depend on it (forced, greedy, or each sequence with its own sampler; a request-wide sampler
  // draws for every row, an ended one's too).
  const bool dropping = request.drop_ended && cache.can_drop_sequences() && !conversation &&
                        (!request.forced_tokens.empty() || !own_samplers.empty() ||
                         request.sampling.temperature == 0.0f);
  int64_t emitted = 0;  // token positions generated so far, for an interruption's message
  try {
    return with_interrupt_context(
        [&] {
          auto start = std::chrono::steady_clock::now();
          trace_step(0);
          if (conversation) conversation->begin();
          if (!shared.empty() && !history) {
            model.prefill_shared(shared_prefix_tokens(request.prompts, shared, config.pad_token_id),
                                 cache);
          }
          // Kept until the decode steps are done: were the first step to drop the last
          // reference, it would free memory.
          const Tensor first_logits =
              history || !shared.empty()
                  ? model.extend(tokens, cache, request.prefill_chunk)
                  : model.prefill(tokens, first_valid, cache, false, request.prefill_chunk);
          result.last_logits = first_logits;
          if (conversation) {
            cache.finish_stores();
            cache.allocate_all();
            conversation->after_first_pass(cache, turn_rows);
          }
          std::vector<int32_t> next = emit(0, result.last_logits);
          // (B, V) where sequences may leave the batch, allocated before the decode steps: once
          // one has, each sequence's latest logits, its row written after every step it runs.
          Tensor all_logits;
          bool dropped = false;
          if (dropping && request.gen_len > 1 &&
              (request.stop || !request.sequence_gen_len.empty())) {
            all_logits = Tensor::empty({B, result.last_logits.dim(1)}, DType::F32);
          }
          result.prefill_seconds = seconds_since(start);
          emitted = 1;
          if (progress) progress(1, request.gen_len);

          start = std::chrono::steady_clock::now();
          for (int64_t step = 1; step < request.gen_len && running > 0; ++step) {
            if (all_logits.defined() && running < std::ssize(live)) {
              if (!dropped) keep_rows(result.last_logits, live, all_logits);  // every sequence's
              dropped = true;
              drop_ended(cache, ended, live, next);
            }
            trace_step(step);
            result.last_logits = model.decode(next, cache);
            next = emit(step, result.last_logits);
            if (dropped) keep_rows(result.last_logits, live, all_logits);
            emitted = step + 1;
            if (progress) progress(step + 1, request.gen_len);
          }
          profile_steps_end();
          result.decode_seconds = seconds_since(start);
          result.gen_len = emitted;
          // A decode step's logits are the model's buffer, which its next pass overwrites.
          if (dropped) {
            result.last_logits = all_logits;
          } else if (emitted > 1) {
            result.last_logits = result.last_logits.clone();
          }
          if (conversation) {
            cache.finish_stores();
            conversation->finish(
                cache, std::vector<int32_t>(static_cast<size_t>(B), static_cast<int32_t>(rows)),
                result.tokens);
          }
          return result;
        },
        [&] {
          return emitted == 0
                     ? std::string(" during the prefill")
                     : cat(" after ", emitted, " of ", request.gen_len,
                           " tokens per sequence (prefill ", result.prefill_seconds, " s)");
        });
  } catch (...) {
    if (conversation) conversation->abandon();  // before the store goes
    throw;
  }
}

std::vector<std::vector<int32_t>> synthetic_prompts(int64_t batch, int64_t prompt_len,
                                                    int32_t bos_token_id, int32_t vocab_limit,
                                                    uint64_t seed) {
  INFINIGEN_CHECK(vocab_limit > 4, "the vocabulary is too small for synthetic prompts");
  std::mt19937_64 rng(seed);
  std::vector<std::vector<int32_t>> prompts;
  for (int64_t b = 0; b < batch; ++b) {
    std::vector<int32_t> ids = {bos_token_id};
    while (static_cast<int64_t>(ids.size()) < prompt_len) {
      ids.push_back(4 + static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab_limit - 4)));
    }
    prompts.push_back(std::move(ids));
  }
  return prompts;
}

}  // namespace infinigen
