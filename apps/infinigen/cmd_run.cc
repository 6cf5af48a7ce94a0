// apps/infinigen: `infinigen run`, batch generation with timings.

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>

#include "apps/infinigen/batch_input.h"
#include "apps/infinigen/batch_job.h"
#include "apps/infinigen/batch_output.h"
#include "apps/infinigen/commands.h"
#include "apps/infinigen/option_flags.h"
#include "apps/infinigen/progress.h"
#include "apps/infinigen/run_report.h"
#include "core/cpu_threads.h"
#include "core/generation.h"
#include "core/model_loader.h"
#include "offload/runtime.h"
#include "offload/session.h"

namespace infinigen::cli {
namespace {

constexpr double kMiB = 1024.0 * 1024.0;  // the report's memory sizes are in MiB and GiB

// Prompts of the default run, from the two sources the built-in model learned from (the Python
// documentation and the King James Bible, docs/builtin-model.md), of different lengths so that
// left padding is exercised from the start.
const char* const kDefaultPrompts[] = {
    "In the beginning God created the heaven and the earth. And",
    "The Python interpreter reads a program",
    "To open a file for reading, call",
    "And Jesus answered and said unto them,",
};

// " in passes of N" when a prompt of `longest` tokens is computed in chunks of N, else "".
std::string prompt_passes(int64_t longest, int64_t chunk) {
  const int64_t pass = largest_prompt_pass(longest, chunk);
  return pass < longest ? " in passes of " + std::to_string(pass) : "";
}

// GenerationFlags: the model, sampling, device and offloading options `batch` takes too.
struct RunOptions : GenerationFlags, OverflowFlags {
  std::string prompt;
  std::string prompt_file;
  int64_t prompt_len = 0;
  int64_t batch = 0;  // 0: one sequence per prompt
  bool batch_given = false;
  bool prompt_len_given = false;
  bool json = false;
  // With --json: each generated token's log-probability and the N most likely at its step
  // (unset: none).
  std::optional<int64_t> logprobs;
  bool stats = false;
  bool profile_ops = false;
  bool dry_run = false;
  std::string shared_prefix;  // a file whose text every prompt follows
  std::string session;        // a new session saved here after the run
  std::string resume;         // a session continued (and saved back)
  int64_t session_compact_after = kSessionCompactAfter;
};

std::vector<std::string> read_prompt_file(const std::string& path) {
  std::ifstream in(path);
  INFINIGEN_CHECK(in.good(), "--prompt-file ", path, ": no such file or not readable");
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (!line.empty()) lines.push_back(line);
  }
  INFINIGEN_CHECK(!lines.empty(), "--prompt-file ", path, ": contains no prompt");
  return lines;
}

// The text of --shared-prefix FILE (a final newline dropped).
std::string read_shared_prefix(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  INFINIGEN_CHECK(in.good(), "--shared-prefix ", path, ": no such file or not readable");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (!text.empty() && text.back() == '\n') text.pop_back();
  if (!text.empty() && text.back() == '\r') text.pop_back();
  INFINIGEN_CHECK(!text.empty(), "--shared-prefix ", path, ": the file is empty");
  return text;
}

// The run's prompts before any work proportional to the batch: the distinct prompt texts
// tokenised (BOS first), or, for --prompt-len, only the length of the synthetic ones.
struct PromptPlan {
  int64_t batch = 1;
  int64_t longest = 0;                      // tokens of the longest prompt in the batch
  std::vector<std::vector<int32_t>> texts;  // empty for synthetic prompts
  // --shared-prefix: its tokens, which every text's follow (after BOS) from this index.
  std::vector<int32_t> prefix;
  int64_t prefix_at = 0;
};

// `session`: a resumed session, whose conversations the prompts continue: one per conversation
// (or one for all), without BOS.
PromptPlan plan_prompts(const RunOptions& o, const ModelSource& loaded,
                        const DiskSession* session = nullptr) {
  PromptPlan plan;
  if (session) {
    INFINIGEN_CHECK(!o.batch_given || o.batch == session->batch(), "--batch ", o.batch, ": ",
                    o.resume, " holds ", session->batch(), " conversations");
    INFINIGEN_CHECK(!o.prompt.empty() || !o.prompt_file.empty() || o.prompt_len > 0,
                    "--resume needs the new turn's prompt: --prompt, --prompt-file or "
                    "--prompt-len");
  }
  if (o.prompt_len > 0) {
    plan.batch = session ? session->batch() : std::max<int64_t>(o.batch, 1);
    plan.longest = o.prompt_len;
    return plan;
  }
  std::vector<std::string> texts;
  if (!o.prompt.empty()) {
    texts = {o.prompt};
  } else if (!o.prompt_file.empty()) {
    texts = read_prompt_file(o.prompt_file);
  } else {
    texts.assign(std::begin(kDefaultPrompts), std::end(kDefaultPrompts));
  }
  INFINIGEN_CHECK(loaded.tokenizer.has_value(), loaded.description,
                  " has no tokenizer (tokenizer.json, or vocab.json and merges.txt): use "
                  "--prompt-len N");
  const int64_t context = loaded.config.max_positions;
  // Every prompt follows the stated prefix: its tokens, then the prompt's own.
  if (!o.shared_prefix.empty()) {
    INFINIGEN_CHECK(!session, "--shared-prefix cannot be combined with --resume");
    plan.prefix = loaded.tokenizer->encode_bounded(read_shared_prefix(o.shared_prefix), context);
    INFINIGEN_CHECK(std::ssize(plan.prefix) <= context, "--shared-prefix ", o.shared_prefix,
                    ": more than ", context, " tokens, the model's whole context");
    plan.prefix_at = prompt_bos(loaded) ? 1 : 0;
  }
  plan.batch = o.batch > 0 ? o.batch : static_cast<int64_t>(texts.size());
  if (session) {
    INFINIGEN_CHECK(texts.size() == 1 || std::ssize(texts) == session->batch(), "--prompt-file ",
                    o.prompt_file, ": ", texts.size(), " prompts for a session of ",
                    session->batch(), " conversations (give one, or one per conversation)");
    plan.batch = session->batch();
  }
  // Sequence b uses text b % texts; a batch smaller than the file uses only its first texts.
  texts.resize(static_cast<size_t>(std::min<int64_t>(plan.batch, std::ssize(texts))));
  for (const std::string& text : texts) {
    const std::string which = !o.prompt.empty()       ? std::string("--prompt")
                              : o.prompt_file.empty() ? std::string("a default prompt")
                                                      : cat("--prompt-file ", o.prompt_file,
                                                            ": prompt ", plan.texts.size() + 1);
    std::vector<int32_t> ids;
    const std::optional<int32_t> bos = prompt_bos(loaded);
    if (bos && !session) ids.push_back(*bos);
    ids.insert(ids.end(), plan.prefix.begin(), plan.prefix.end());
    // Tokenized no further than the context can use (a 50 MB line is refused from its start).
    const std::vector<int32_t> text_ids = loaded.tokenizer->encode_bounded(text, context);
    INFINIGEN_CHECK(std::ssize(text_ids) <= context, which, " holds more than ", context,
                    " tokens, the model's whole context");
    ids.insert(ids.end(), text_ids.begin(), text_ids.end());
    plan.longest = std::max<int64_t>(plan.longest, std::ssize(ids));
    plan.texts.push_back(std::move(ids));
  }
  return plan;
}

// Prompt token ids per sequence: BOS (prompt_bos), then the text's tokens (or synthetic ids). Call
// only once the memory plan has accepted the batch.
std::vector<std::vector<int32_t>> build_prompts(const RunOptions& o, const ModelSource& loaded,
                                                const PromptPlan& plan) {
  if (plan.texts.empty()) {
    // Deterministic ids that the tokenizer can print, excluding the 4 special tokens.
    const ModelConfig& config = loaded.config;
    const int32_t top = loaded.tokenizer
                            ? std::min<int32_t>(loaded.tokenizer->vocab_size(),
                                                static_cast<int32_t>(config.vocab_size))
                            : static_cast<int32_t>(config.vocab_size);
    return synthetic_prompts(plan.batch, plan.longest, config.bos_token_id, top, o.seed);
  }
  std::vector<std::vector<int32_t>> prompts;
  prompts.reserve(static_cast<size_t>(plan.batch));
  for (int64_t b = 0; b < plan.batch; ++b) {
    prompts.push_back(plan.texts[static_cast<size_t>(b) % plan.texts.size()]);
  }
  return prompts;
}

std::string describe(const SamplingOptions& sampling) {
  if (sampling.temperature == 0.0f) return "greedy";
  return cat("sampled at temperature ", sampling.temperature, ", top-p ", sampling.top_p, ", seed ",
             sampling.seed);
}

std::string shorten(const std::string& text, size_t limit) {
  if (text.size() <= limit) return text;
  size_t cut = limit;
  while (cut > 0 && (static_cast<unsigned char>(text[cut]) & 0xC0) == 0x80) --cut;  // UTF-8
  return text.substr(0, cut) + "...";
}

// Why --check-recall measured nothing: recall is measured on the speculated layers of the decode
// steps.
std::string why_no_recall(const TransferSummary& transfers, const OffloadOptions& offload,
                          int64_t layers) {
  if (transfers.decode_steps == 0) return "no decode step (--gen-len 1)";
  if (speculated_layers(offload, layers) == 0) {
    return cat("every layer is dense (--dense-layers ", offload.speculation.dense_layers,
               ", the model has ", layers, "), and recall is measured on the speculated layers");
  }
  return "no speculated layer reported it";
}

int run(const RunOptions& o) {
  INFINIGEN_CHECK(o.gen_len >= 1, "--gen-len must be at least 1, got ", o.gen_len);
  INFINIGEN_CHECK(!o.batch_given || o.batch >= 1, "--batch must be at least 1, got ", o.batch);
  INFINIGEN_CHECK(!o.prompt_len_given || o.prompt_len >= 1, "--prompt-len must be at least 1, got ",
                  o.prompt_len);
  INFINIGEN_CHECK(!o.logprobs || (*o.logprobs >= 0 && *o.logprobs <= kMostLogprobs),
                  "--logprobs must be 0 to ", kMostLogprobs, ", got ", o.logprobs.value_or(0));
  const DType kv_dtype = parse_float_dtype(o.kv_dtype);  // checked by its flag

  const OffloadOptions& offload = o.offload;
  const Device device = generation_device(o);
  const ModelSource loaded = resolve_model(o.model, {device, o.seed});

  // Every size the user gave is checked against the context and the memory plan before anything
  // proportional to it is built: a refusal comes at once, whatever the size.
  // A session continued, or a new one: its key (model, policy, fixed options) checked first.
  INFINIGEN_CHECK(o.session.empty() || o.resume.empty(),
                  "--session starts a session and --resume continues one: give one of them");
  std::unique_ptr<DiskSession> session;
  if (!o.session.empty() || !o.resume.empty()) {
    const SessionKey key = session_key(loaded, offload, kv_dtype, device);
    session =
        o.resume.empty() ? DiskSession::create(o.session, key) : DiskSession::open(o.resume, key);
    session->set_compact_after(o.session_compact_after);
  }
  const DiskSession* resumed = o.resume.empty() ? nullptr : session.get();
  const PromptPlan prompt_plan = plan_prompts(o, loaded, resumed);
  int64_t longest = prompt_plan.longest;  // per sequence, padding excluded: what the plan holds
  if (resumed) {
    std::vector<int64_t> added;  // per conversation: this turn's new prompt tokens
    for (int64_t b = 0; b < resumed->batch(); ++b) {
      added.push_back(prompt_plan.texts.empty()
                          ? prompt_plan.longest
                          : std::ssize(prompt_plan.texts[b % prompt_plan.texts.size()]));
    }
    if (o.drops()) {
      session->drop_oldest(loaded.config, added, o.gen_len, o.keep_prefix, o.margin);
    }
    // The longest conversation with this turn's prompt: what the context and the plan must hold.
    longest = 0;
    for (int64_t b = 0; b < resumed->batch(); ++b) {
      // Its history and the last token, not yet through the model.
      const int64_t held = std::ssize(resumed->history()[b]) + 1;
      const int64_t total = added[b] > std::numeric_limits<int64_t>::max() - held
                                ? std::numeric_limits<int64_t>::max()  // no overflow
                                : held + added[b];
      check_conversation_context(loaded.config, static_cast<size_t>(b), total, o.gen_len);
      longest = std::max(longest, total);
    }
  }
  check_context(loaded.config, longest, o.gen_len);
  // What --dry-run says about the request before its plan, fitting or not.
  const auto dry_run_header = [&](const char* verdict) {
    std::printf(
        "model: %s\ndevice: %s\npolicy %s, batch %lld, prompt %lld tokens (longest)%s, "
        "%lld generated tokens per sequence: %s\n",
        loaded.description.c_str(), device_description(device).c_str(), offload.policy.c_str(),
        static_cast<long long>(prompt_plan.batch), static_cast<long long>(longest),
        prompt_passes(longest, offload.prefill_chunk).c_str(), static_cast<long long>(o.gen_len),
        verdict);
  };
  MemoryPlan plan;
  try {
    plan = plan_offloaded_run(offload_memory_request(loaded.config, prompt_plan.batch, longest,
                                                     o.gen_len, kv_dtype, offload),
                              offload, device);
  } catch (const PlanRefused& refused) {
    // A dry run shows the plan it refused, with where it is short, above the refusal (one line on
    // stderr, with its suggestion) and exits non-zero as any refused run does.
    if (o.dry_run) {
      dry_run_header("the plan does not fit");
      std::printf("%s", refused.marked_plan().c_str());
      std::fflush(stdout);
    }
    throw;
  }
  if (o.dry_run) {
    dry_run_header("the plan fits");
    std::printf("%s", plan.describe().c_str());
    return 0;
  }

  GenerationRequest request;
  if (resumed && prompt_plan.texts.empty()) {
    // Synthetic ids continuing a conversation: no BOS mid-conversation.
    PromptPlan synthetic = prompt_plan;
    ++synthetic.longest;
    request.prompts = build_prompts(o, loaded, synthetic);
    for (auto& prompt : request.prompts) prompt.erase(prompt.begin());
  } else {
    request.prompts = build_prompts(o, loaded, prompt_plan);
  }
  if (session) request.prompts = session->turn_prompts(request.prompts);
  request.gen_len = o.gen_len;
  request.sampling = flag_sampling(o, loaded);
  request.kv_dtype = kv_dtype;
  request.score_tokens = o.logprobs.has_value();
  request.top_log_probs = o.logprobs.value_or(0);
  OffloadRun run;
  OpProfile profile;
  {
    Progress progress("generating");
    std::optional<OpProfileScope> profiling;
    if (o.profile_ops) profiling.emplace(profile);
    run = run_offloaded(
        loaded, request, offload, device,
        [&](int64_t done, int64_t total) { progress.update(done, total); }, session.get());
  }
  profile.finish();
  const GenerationResult& result = run.result;
  const TransferSummary transfers = summarize(run);
  // What each sequence was given this turn: a resumed turn's prompt without the previous turn's
  // last token, which that turn already printed; a prompt after --shared-prefix without it.
  const auto given = [&](size_t b) {
    std::vector<int32_t> prompt = request.prompts[b];
    if (resumed) prompt.erase(prompt.begin());
    const auto at = prompt.begin() + prompt_plan.prefix_at;
    prompt.erase(at, at + std::ssize(prompt_plan.prefix));
    return prompt;
  };

  const double ms_per_step =
      result.gen_len > 1 ? 1000.0 * result.decode_seconds / static_cast<double>(result.gen_len - 1)
                         : 0.0;
  if (o.json) {
    nlohmann::json outputs = nlohmann::json::array();
    for (size_t b = 0; b < request.prompts.size(); ++b) {
      const std::string text = token_text(loaded, result.tokens[b]);
      outputs.push_back({{"prompt", token_text(loaded, given(b))},
                         {"prompt_tokens", request.prompts[b].size()},
                         {"text", text},
                         {"tokens", result.tokens[b]}});
      if (o.logprobs) {
        outputs.back()["logprobs"] = nlohmann::json(logprobs_json(
            choice_logprobs(loaded, result, static_cast<int64_t>(b), *o.logprobs, text.size())));
      }
    }
    nlohmann::json report = {{"model", loaded.description},
                             {"synthetic_weights", loaded.synthetic},
                             {"device", device_name(device)},
                             {"device_description", device_description(device)},
                             {"threads", cpu_threads().most},
                             {"threads_adapt", cpu_threads().adapts},
                             {"batch", result.batch},
                             {"prompt_len", result.prompt_len},
                             {"gen_len", result.gen_len},
                             {"kv_dtype", dtype_name(kv_dtype)},
                             {"sampling",
                              {{"temperature", json_float(request.sampling.temperature)},
                               {"top_p", json_float(request.sampling.top_p)},
                               {"seed", request.sampling.seed}}},
                             {"prefill_latency_s", result.prefill_seconds},
                             {"decode_latency_s", result.decode_seconds},
                             {"total_latency_s", result.total_seconds()},
                             {"throughput_tok_s", result.throughput()},
                             {"decode_throughput_tok_s", result.decode_throughput()},
                             {"policy", offload.policy},
                             {"weights_gpu_percent", offload.weights_gpu_percent},
                             {"emulated_link_gbps", offload.link.gbps},
                             {"transfer", transfers_json(transfers)},
                             {"memory_plan", plan_json(run.plan)},
                             {"kv_pool_cap", pool_cap_json(run.stats.pool_cap())},
                             {"outputs", outputs}};
    if (o.stats) report["steps"] = steps_json(run.stats);
    if (o.profile_ops) report["op_profile"] = op_profile_json(profile);
    if (session) {
      const SessionStats& s = session->stats();
      report["session"] = {{"directory", o.resume.empty() ? o.session : o.resume},
                           {"conversation_tokens", result.prompt_len + result.gen_len},
                           {"bytes_read", s.bytes_read},
                           {"read_s", s.read_seconds},
                           {"restore_wait_s", s.restore_wait_seconds},
                           {"bytes_written", s.bytes_written},
                           {"write_s", s.write_seconds},
                           {"segments_compacted", s.segments_compacted},
                           {"tokens_dropped", s.tokens_dropped},
                           {"shift_s", s.shift_seconds}};
    }
    std::printf("%s\n", report.dump(2).c_str());
    return 0;
  }
  const CpuThreads threads = cpu_threads();
  std::printf("model: %s\ndevice: %s (%d thread%s%s)\n", loaded.description.c_str(),
              device_description(device).c_str(), threads.most, threads.most == 1 ? "" : "s",
              threads.adapts ? ", fewer while other processes keep cores busy" : "");
  std::printf(
      "policy %s, %.0f%% of weights on the device, link %s\n", offload.policy.c_str(),
      offload.weights_gpu_percent,
      offload.link.gbps > 0
          ? (format_number(offload.link.gbps) + " GB/s (emulated; 1 GB = 10^9 bytes)").c_str()
          : "not emulated");
  std::printf(
      "batch %lld, prompt %lld tokens (longest)%s, %lld generated tokens per sequence, %s\n\n",
      static_cast<long long>(result.batch), static_cast<long long>(result.prompt_len),
      prompt_passes(result.prompt_len, offload.prefill_chunk).c_str(),
      static_cast<long long>(result.gen_len), describe(request.sampling).c_str());
  if (!prompt_plan.prefix.empty()) {
    std::printf("every prompt follows %s (%zu tokens)\n\n", o.shared_prefix.c_str(),
                prompt_plan.prefix.size());
  }
  for (size_t b = 0; b < request.prompts.size(); ++b) {
    std::printf("[%zu] %s\n    -> %s\n", b + 1, shorten(token_text(loaded, given(b)), 160).c_str(),
                token_text(loaded, result.tokens[b]).c_str());
  }
  std::printf("\nprefill latency  %9.3f s\n", result.prefill_seconds);
  std::printf("decode latency   %9.3f s  (%lld steps, %.1f ms/step)\n", result.decode_seconds,
              static_cast<long long>(result.gen_len - 1), ms_per_step);
  std::printf("throughput       %9.1f tok/s  (decode only: %.1f tok/s)\n", result.throughput(),
              result.decode_throughput());
  print_transfers(transfers, run, o.stats);
  if (o.profile_ops) print_op_profile(profile);
  if (offload.check_recall && transfers.mean_recall < 0) {
    std::printf("recall           not measured: %s\n",
                why_no_recall(transfers, offload, loaded.config.num_layers).c_str());
  }
  if (session) {
    const SessionStats& s = session->stats();
    std::printf("session          %s: %s", (o.resume.empty() ? o.session : o.resume).c_str(),
                o.resume.empty() ? "saved" : "continued and saved");
    if (s.bytes_read > 0) {
      std::printf("; history read %.1f MiB in %.3f s, the first pass waited %.3f s for it",
                  static_cast<double>(s.bytes_read) / kMiB, s.read_seconds, s.restore_wait_seconds);
    }
    std::printf("; %.1f MiB written in %.3f s", static_cast<double>(s.bytes_written) / kMiB,
                s.write_seconds);
    if (s.segments_compacted > 0) {
      std::printf(", %lld segments compacted into 1", static_cast<long long>(s.segments_compacted));
    }
    if (s.tokens_dropped > 0) {
      std::printf(
          "; past the context: %lld history tokens dropped after the first %lld, the "
          "rest moved (keys rotated in %.3f s)",
          static_cast<long long>(s.tokens_dropped), static_cast<long long>(o.keep_prefix),
          s.shift_seconds);
    }
    std::printf("\n");
  }
  return 0;
}

}  // namespace

Command add_run_command(CLI::App& app) {
  auto o = std::make_shared<RunOptions>();
  add_generation_flags(app, *o);
  auto* prompt = app.add_option("--prompt,-p", o->prompt, "Prompt text (every sequence)");
  auto* prompt_file =
      app.add_option("--prompt-file", o->prompt_file, "File with one prompt per line");
  auto* prompt_len =
      app.add_option("--prompt-len", o->prompt_len, "Synthetic prompts of N tokens (BOS included)");
  prompt->excludes(prompt_file)->excludes(prompt_len);
  prompt_file->excludes(prompt_len);
  auto* batch = app.add_option("--batch,-b", o->batch, "Sequences (default: one per prompt)");
  auto* json = app.add_flag("--json", o->json, "Print the result as JSON on stdout");
  app.add_option("--logprobs", o->logprobs,
                 cat("Each output's tokens with their log-probabilities and the N most likely at "
                     "each step (0 to ",
                     kMostLogprobs, "), as a batch job's \"logprobs\""))
      ->needs(json);
  app.add_flag("--stats", o->stats, "Per-layer and per-step transfer statistics");
  app.add_flag("--profile-ops", o->profile_ops,
               "Time per op (the device's, on a GPU) and per host wait, for the prefill and a "
               "decode step (core/op_profile.h)");
  auto* shared_prefix = app.add_option(
      "--shared-prefix", o->shared_prefix,
      "File whose text every prompt follows (a system prompt, a document): with share_prefix on, "
      "its whole KV blocks are computed and kept once for the batch (docs/sessions.md)");
  shared_prefix->excludes(prompt_len);
  auto* session = app.add_option(
      "--session", o->session,
      "Save the conversations (KV cache, tokens, InfiniGen's state) in this directory after the "
      "run, to continue them with --resume (docs/sessions.md)");
  auto* resume =
      app.add_option("--resume", o->resume,
                     "Continue the conversations saved in this directory with a new prompt each "
                     "(--prompt, --prompt-file: one line per conversation, or --prompt-len), and "
                     "save the turn back into it")
          ->excludes(session)
          ->excludes(shared_prefix);
  app.add_option("--session-compact-after", o->session_compact_after,
                 "Merge the session's segments (two per turn) into one when a save leaves more "
                 "than N (0: never)")
      ->check(CLI::NonNegativeNumber)
      ->default_val(kSessionCompactAfter);
  add_overflow_flags(app, *o)->needs(resume);
  app.add_flag("--dry-run", o->dry_run,
               "Check the sizes against the context and the memory plan, print the plan, and stop "
               "before loading weights");
  return [o, batch, prompt_len] {
    o->batch_given = batch->count() > 0;
    o->prompt_len_given = prompt_len->count() > 0;
    return run(*o);
  };
}

}  // namespace infinigen::cli
