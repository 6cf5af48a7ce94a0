// apps/infinigen: `infinigen batch`, an offline job of many requests (docs/batch.md): the input
// read and checked line by line, the requests grouped into batches, this shard's batches not yet
// in its output generated and their lines appended, then the shards' files merged in input order.

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <variant>

#include "apps/infinigen/batch_input.h"
#include "apps/infinigen/batch_job.h"
#include "apps/infinigen/batch_output.h"
#include "apps/infinigen/batch_schedule.h"
#include "apps/infinigen/batch_sessions.h"
#include "apps/infinigen/batch_shard.h"
#include "apps/infinigen/commands.h"
#include "apps/infinigen/option_flags.h"
#include "apps/infinigen/progress.h"
#include "core/generation.h"
#include "core/interrupt.h"
#include "core/model_loader.h"
#include "offload/runtime.h"
#include "offload/session.h"
#include "offload/session_key.h"
#include "offload/session_tier.h"

namespace infinigen::cli {
namespace {

namespace fs = std::filesystem;

const char* environment(const char* name) {
  return std::getenv(name);
}

// GPUs the NVIDIA driver lists on this node (0 when it lists none), read without starting CUDA.
int64_t node_gpus() {
  std::error_code error;
  int64_t count = 0;
  for (const auto& entry : fs::directory_iterator("/proc/driver/nvidia/gpus", error)) {
    (void)entry;
    ++count;
  }
  return count;
}

// `request` as token ids and settings, or the one-line reason it cannot run.
std::variant<PreparedRequest, std::string> prepare(const BatchRequest& request,
                                                   const BatchOptions& o, const ModelSource& model,
                                                   const SamplingOptions& job_sampling) {
  const ModelConfig& config = model.config;
  const int64_t context = config.max_positions;
  PreparedRequest prepared;
  prepared.request = &request;
  prepared.max_tokens = request.max_tokens.value_or(o.gen_len);
  prepared.sampling = job_sampling;
  if (request.temperature) prepared.sampling.temperature = *request.temperature;
  if (request.top_p) prepared.sampling.top_p = *request.top_p;
  if (request.seed) prepared.sampling.seed = *request.seed;
  if (request.sequences() > o.batch) {
    return cat(request.prompts.size(), " prompt(s) times n ", request.n, " are ",
               request.sequences(), " sequences, more than a batch (--batch ", o.batch, ")");
  }
  for (const PromptInput& input : request.prompts) {
    std::vector<int32_t> ids;
    if (const auto* text = std::get_if<std::string>(&input)) {
      if (!model.tokenizer) return "the model has no tokenizer: give the prompt as token ids";
      // A turn that continues a conversation gets no BOS, as a resumed `run`.
      const bool continues = !request.session.empty() && !request.session_new;
      if (const std::optional<int32_t> bos = prompt_bos(model); bos && !continues)
        ids.push_back(*bos);
      const std::vector<int32_t> text_ids = model.tokenizer->encode_bounded(*text, context);
      ids.insert(ids.end(), text_ids.begin(), text_ids.end());
    } else {
      ids = std::get<std::vector<int32_t>>(input);
      for (int32_t id : ids) {
        if (id >= config.vocab_size) {
          return cat("prompt token id ", id, " is outside the model's vocabulary of ",
                     config.vocab_size);
        }
      }
    }
    if (ids.empty()) return std::string("the prompt is empty");
    if (std::ssize(ids) >= context || prepared.max_tokens > context - std::ssize(ids)) {
      return cat("a prompt of ", std::min<int64_t>(std::ssize(ids), context),
                 std::ssize(ids) >= context ? " or more" : "", " tokens plus max_tokens ",
                 prepared.max_tokens, " exceed the model's context of ", context, " positions");
    }
    prepared.prompts.push_back(std::move(ids));
  }
  return prepared;
}

// The options that decide a result (a resume, and every shard, must give the same): the model,
// the defaults of the requests' settings, the KV type, every offloading option, and what decides
// the batches (a shard's share is whole batches, and InfiniGen's loads depend on a batch).
JobKey job_key(const BatchOptions& o, const ModelSource& model, const SamplingOptions& sampling) {
  JobKey key = {{"--model", o.model + " (" + model.description + ")"},
                {"--gen-len", std::to_string(o.gen_len)},
                {"--seed", std::to_string(sampling.seed)},
                {"--temperature", format_number(sampling.temperature)},
                {"--top-p", format_number(sampling.top_p)},
                {"--kv-dtype", std::string(dtype_name(parse_float_dtype(o.kv_dtype)))},
                {"--batch", std::to_string(o.batch)},
                {"--order", o.order}};
  if (!o.session_root.empty()) key.emplace_back("--session-root", o.session_root);
  if (o.drops()) {
    key.emplace_back("--overflow", o.overflow);
    key.emplace_back("--keep-prefix", std::to_string(o.keep_prefix));
    // Not in the key at 0, as before the option existed: those jobs resume.
    if (o.margin > 0) key.emplace_back("--overflow-margin", std::to_string(o.margin));
  }
  for (const auto& spec : offload_option_table()) {
    key.emplace_back(flag_spelling(spec.key), spec.format(o.offload));
  }
  return key;
}

// The earliest stop string in `text`, as its position (npos when none).
size_t stop_position(const std::string& text, const std::vector<std::string>& stop) {
  size_t at = std::string::npos;
  for (const std::string& s : stop) at = std::min(at, text.find(s));
  return at;
}

// One batch of prepared requests, generated; returns each request's output line.
std::vector<std::string> run_batch(const std::vector<const PreparedRequest*>& batch,
                                   const BatchOptions& o, const ModelSource& model, Device device,
                                   const ProgressCallback& progress, JobTotals& totals) {
  GenerationRequest request;
  request.kv_dtype = parse_float_dtype(o.kv_dtype);
  request.gen_len = 0;
  // Sequence s: request owner[s], choice choice[s] (prompt choice / n, sample choice % n).
  std::vector<size_t> owner;
  std::vector<int64_t> choice;
  std::vector<std::vector<std::string>> stops;
  for (size_t r = 0; r < batch.size(); ++r) {
    const PreparedRequest& p = *batch[r];
    for (size_t prompt = 0; prompt < p.prompts.size(); ++prompt) {
      for (int64_t sample = 0; sample < p.request->n; ++sample) {
        const int64_t index = static_cast<int64_t>(prompt) * p.request->n + sample;
        request.prompts.push_back(p.prompts[prompt]);
        request.sequence_gen_len.push_back(p.max_tokens);
        SamplingOptions sampling = p.sampling;
        sampling.seed += static_cast<uint64_t>(index);
        request.sequence_sampling.push_back(sampling);
        owner.push_back(r);
        choice.push_back(index);
      }
    }
    request.gen_len = std::max(request.gen_len, p.max_tokens);
    if (p.request->logprobs) {
      request.score_tokens = true;
      request.top_log_probs = std::max(request.top_log_probs, *p.request->logprobs);
    }
  }
  const int64_t B = std::ssize(request.prompts);
  const std::optional<int32_t> eos = model.tokenizer && model.tokenizer->eos_id()
                                         ? model.tokenizer->eos_id()
                                         : std::optional<int32_t>(model.config.eos_token_id);
  std::vector<bool> stopped(static_cast<size_t>(B), false);
  request.stop = [&](int64_t b, const std::vector<int32_t>& generated) {
    const std::vector<std::string>& stop = batch[owner[b]]->request->stop;
    stopped[b] =
        generated.back() == eos ||
        (!stop.empty() && stop_position(token_text(model, generated), stop) != std::string::npos);
    return stopped[b];
  };
  const OffloadRun run = run_offloaded(model, request, o.offload, device, progress);

  int64_t longest = 0;
  for (const auto& prompt : request.prompts)
    longest = std::max<int64_t>(longest, std::ssize(prompt));
  totals.add_pass(run, longest);
  std::vector<std::vector<Choice>> choices(batch.size());
  std::vector<int64_t> completion_tokens(batch.size(), 0);
  for (int64_t b = 0; b < B; ++b) {
    const std::vector<int32_t>& tokens = run.result.tokens[b];
    std::string text = token_text(model, tokens);
    const std::vector<std::string>& stop = batch[owner[b]]->request->stop;
    if (stopped[b] && !stop.empty())
      text = text.substr(0, std::min(text.size(), stop_position(text, stop)));
    choices[owner[b]].push_back({text, choice[b], stopped[b] ? "stop" : "length", std::nullopt});
    if (const std::optional<int64_t> k = batch[owner[b]]->request->logprobs) {
      choices[owner[b]].back().logprobs = choice_logprobs(model, run.result, b, *k, text.size());
    }
    completion_tokens[owner[b]] += std::ssize(tokens);
    totals.generated_tokens += std::ssize(tokens);
  }
  std::vector<std::string> lines;
  for (size_t r = 0; r < batch.size(); ++r) {
    int64_t prompt_tokens = 0;
    for (const auto& prompt : batch[r]->prompts) prompt_tokens += std::ssize(prompt);
    totals.prompt_tokens += prompt_tokens * batch[r]->request->n;
    lines.push_back(completion_line(*batch[r]->request, o.model, choices[r], prompt_tokens,
                                    completion_tokens[r]));
  }
  return lines;
}

// --merge: the shards' count, from --shard-count or from the shard files beside the output.
int64_t merged_shard_count(const BatchOptions& o) {
  if (o.shard_count) return *o.shard_count;
  const fs::path output(o.output);
  const fs::path directory = output.has_parent_path() ? output.parent_path() : fs::path(".");
  const std::regex shard_name(std::regex_replace(output.filename().string(),
                                                 std::regex(R"([.^$|()\[\]{}*+?\\])"), R"(\$&)") +
                              R"(\.shard-\d+-of-(\d+))");
  std::optional<int64_t> count;
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(directory, error)) {
    std::smatch match;
    const std::string name = entry.path().filename().string();
    if (!std::regex_match(name, match, shard_name)) continue;
    const int64_t n = std::stoll(match[1].str());
    INFINIGEN_CHECK(!count || *count == n, "--merge: shard files of ", *count, " and of ", n,
                    " shards beside ", o.output, ": give --shard-count");
    count = n;
  }
  INFINIGEN_CHECK(count.has_value(), "--merge: no shard files (", o.output,
                  ".shard-I-of-N) beside ", o.output);
  return *count;
}

void print_summary(const BatchOptions& o, const Shard& shard, const JobTotals& t,
                   const std::string& model, Device device, bool merged) {
  const double throughput = t.seconds > 0 ? static_cast<double>(t.generated_tokens) / t.seconds : 0;
  const double padding =
      t.padded_prompt_rows > 0
          ? 1.0 - static_cast<double>(t.prompt_tokens) / static_cast<double>(t.padded_prompt_rows)
          : 0.0;
  // Shares of the batches' rows (batch * token positions): those of sequences that had ended, and
  // those dropped (not computed: the ended sequences had left the batch).
  const auto share_of_rows = [&](int64_t rows) {
    return t.generated_rows > 0 ? static_cast<double>(rows) / static_cast<double>(t.generated_rows)
                                : 0.0;
  };
  const double ended_rows = share_of_rows(t.generated_rows - t.generated_tokens);
  const double dropped_rows = share_of_rows(t.generated_rows - t.computed_rows);
  if (o.json) {
    nlohmann::ordered_json summary = {
        {"model", model},
        {"device", device_name(device)},
        {"policy", o.offload.policy},
        {"input", o.input},
        {"output", o.output},
        {"shard", {{"index", shard.index}, {"count", shard.count}, {"source", shard.source}}},
        {"file", shard_file(o.output, shard)},
        {"merged", merged},
        {"batch", o.batch},
        {"order", o.order},
        {"requests", t.input_requests},
        {"shard_requests", t.share},
        {"already_done", t.already_done},
        {"completed", t.completed},
        {"errors", t.errors},
        {"batches", t.batches},
        {"sequences", t.sequences},
        {"prompt_tokens", t.prompt_tokens},
        {"padding_share", padding},
        {"shared_prefix_tokens", t.shared_prefix_tokens},
        {"generated_tokens", t.generated_tokens},
        {"decode_steps", t.decode_steps},
        {"ended_rows_share", ended_rows},
        {"dropped_rows_share", dropped_rows},
        {"generation_s", t.seconds},
        {"throughput_tok_s", throughput}};
    if (t.session_turns > 0 || t.recovered_lines > 0) summary["sessions"] = session_summary(t);
    std::printf("%s\n", summary.dump(2).c_str());
    return;
  }
  std::printf("model: %s\ndevice: %s, policy %s\n", model.c_str(), device_name(device).data(),
              o.offload.policy.c_str());
  std::printf("shard %lld of %lld (%s): %lld of %lld requests, %lld already done\n",
              static_cast<long long>(shard.index), static_cast<long long>(shard.count),
              shard.source.c_str(), static_cast<long long>(t.share),
              static_cast<long long>(t.input_requests), static_cast<long long>(t.already_done));
  std::printf("completed %lld, errors %lld, in %lld batches of at most %lld sequences (%s order)\n",
              static_cast<long long>(t.completed), static_cast<long long>(t.errors),
              static_cast<long long>(t.batches), static_cast<long long>(o.batch), o.order.c_str());
  std::printf(
      "%lld sequences, %lld prompt tokens (%.1f%% padding, %lld in shared prefixes computed and "
      "kept once), %lld generated tokens\n",
      static_cast<long long>(t.sequences), static_cast<long long>(t.prompt_tokens), 100.0 * padding,
      static_cast<long long>(t.shared_prefix_tokens), static_cast<long long>(t.generated_tokens));
  std::printf(
      "generation %.2f s, %.1f generated tok/s; %.1f%% of the batches' rows were of sequences "
      "that had ended, %.1f%% dropped (not computed)\n",
      t.seconds, throughput, 100.0 * ended_rows, 100.0 * dropped_rows);
  if (t.session_turns > 0 || t.recovered_lines > 0) {
    const nlohmann::ordered_json s = session_summary(t);
    std::printf(
        "session turns %lld: %lld hot (from memory, %.1f MB, median time to first token %.3f "
        "s), %lld cold (from the disk, %.1f MB, %.3f s), %lld first turns; tier: %lld "
        "admitted, %lld evicted, %lld bypassed, %lld prefetched (%.1f MB read ahead), peak %.1f "
        "MB; %lld lines found committed in their sessions\n",
        static_cast<long long>(t.session_turns), static_cast<long long>(t.hot_turns),
        static_cast<double>(t.hot_bytes) / 1e6, s["hot_ttft_s"].get<double>(),
        static_cast<long long>(t.cold_turns), static_cast<double>(t.cold_bytes) / 1e6,
        s["cold_ttft_s"].get<double>(),
        static_cast<long long>(t.session_turns - t.hot_turns - t.cold_turns),
        static_cast<long long>(t.tier.admitted), static_cast<long long>(t.tier.evictions),
        static_cast<long long>(t.tier.bypassed), static_cast<long long>(t.tier.prefetched),
        static_cast<double>(t.prefetch_bytes) / 1e6, static_cast<double>(t.tier.peak_bytes) / 1e6,
        static_cast<long long>(t.recovered_lines));
  }
  std::printf("%s: %s\n", merged ? o.output.c_str() : shard_file(o.output, shard).c_str(),
              merged ? "complete, in input order"
                     : "this shard is complete; the others have not all finished (infinigen batch "
                       "--merge writes the output once they have)");
}

int merge(const BatchOptions& o) {
  const std::vector<BatchRequest> requests = read_batch_input(o.input);
  refuse_duplicate_ids(requests, o.input);
  const int64_t count = merged_shard_count(o);
  merge_shards(requests, o.output, count);
  std::printf("%s: %zu lines from %lld shards, in input order\n", o.output.c_str(), requests.size(),
              static_cast<long long>(count));
  return 0;
}

int batch(const BatchOptions& o) {
  INFINIGEN_CHECK(o.batch >= 1, "--batch must be at least 1, got ", o.batch);
  INFINIGEN_CHECK(o.gen_len >= 1, "--gen-len must be at least 1, got ", o.gen_len);
  INFINIGEN_CHECK(o.order == "length" || o.order == "arrival",
                  "--order must be length or arrival, got '", o.order, "'");
  std::error_code error;
  INFINIGEN_CHECK(!fs::equivalent(o.input, o.output, error), "--output ", o.output,
                  " is the --input file: the results would be appended to the requests");
  if (o.merge) return merge(o);
  const std::vector<BatchRequest> requests = read_batch_input(o.input);
  refuse_duplicate_ids(requests, o.input);
  const Shard shard = resolve_shard(o.shard, o.shard_count, environment);
  // Ranks sharing a node take different GPUs: chosen before anything starts CUDA.
  if (const std::optional<std::string> visible = rank_visible_devices(environment, node_gpus())) {
    setenv("CUDA_VISIBLE_DEVICES", visible->c_str(), 1);
  }
  const Device device = generation_device(o);
  const ModelSource model = resolve_model(o.model, {device, o.seed});
  const SamplingOptions job_sampling = flag_sampling(o, model);
  Sampler check_sampling(job_sampling);  // --temperature and --top-p refused now, not mid-job
  const std::string file = shard_file(o.output, shard);
  check_job_key(file, job_key(o, model, job_sampling));
  const std::optional<uint64_t> tier_budget = parse_session_cache(o.session_cache);
  INFINIGEN_CHECK(tier_budget.has_value(),
                  "--session-cache must be bytes (512M, 2G) or a share of ",
                  "the memory (10%), got '", o.session_cache, "'");
  int64_t dropped = 0;
  const DoneRequests done = read_done_requests(file, &dropped);
  if (dropped > 0) {
    std::fprintf(stderr,
                 "infinigen: %s: its last line was cut short (%lld bytes, a run that was killed): "
                 "dropped, its request runs again\n",
                 file.c_str(), static_cast<long long>(dropped));
  }

  // The whole job's batches, the same for every shard and every rerun (a batch's approximate
  // attention, InfiniGen's fetch size for one, depends on its members): batch j is shard
  // j % count's, and so is a request that cannot run on input position k % count.
  JobTotals totals;
  totals.input_requests = std::ssize(requests);
  // Sessions: checked whole before any work (one-line Errors), each owned by the shard of its
  // first request's input position, its turns run one pass each in input order.
  bool any_session = false;
  for (const BatchRequest& request : requests)
    any_session = any_session || !request.session.empty();
  SessionKey session_key_of_job;
  std::map<std::string, int64_t> session_owner;  // directory -> input position of its first line
  if (any_session) {
    session_key_of_job = session_key(model, o.offload, parse_float_dtype(o.kv_dtype), device);
    for (const JobSession& s : job_sessions(requests, o.session_root, session_key_of_job, done))
      session_owner[s.directory] = static_cast<int64_t>(s.requests.front());
  }
  const auto directory_of = [&](const BatchRequest& request) {
    return session_directory(request.session, o.session_root);
  };
  // A session with a turn that cannot run: its later turns cannot either.
  std::map<std::string, int64_t> failed_session;  // directory -> line of the failed turn
  std::string error_lines;
  std::vector<PreparedRequest> prepared;
  std::vector<PreparedRequest> turns;  // session requests, in input order
  for (size_t k = 0; k < requests.size(); ++k) {
    const BatchRequest& request = requests[k];
    std::variant<PreparedRequest, std::string> ready =
        request.ok() ? prepare(request, o, model, job_sampling) : request.error;
    const bool in_session = request.ok() && !request.session.empty();
    if (in_session) {
      const std::string directory = directory_of(request);
      if (const auto failed = failed_session.find(directory); failed != failed_session.end()) {
        ready = cat("an earlier turn of session '", request.session, "' (line ", failed->second,
                    ") cannot run");
      } else if (std::holds_alternative<std::string>(ready)) {
        failed_session[directory] = request.line;
      }
    }
    if (std::holds_alternative<PreparedRequest>(ready)) {
      (in_session ? turns : prepared).push_back(std::get<PreparedRequest>(std::move(ready)));
      continue;
    }
    const int64_t owner =
        in_session ? session_owner.at(directory_of(request)) : static_cast<int64_t>(k);
    if (!shard.owns(owner)) continue;
    ++totals.share;
    if (done.holds(request)) {
      ++totals.already_done;
      continue;
    }
    error_lines += error_line(request, request.ok() ? "invalid_request" : request.error_code,
                              std::get<std::string>(ready));
    ++totals.errors;
  }
  std::vector<RequestShape> shapes;
  for (const PreparedRequest& p : prepared) {
    shapes.push_back({p.request->sequences(), p.longest(), p.max_tokens});
  }
  const std::vector<std::vector<size_t>> all_batches = group_requests(
      shapes, o.batch, o.order == "length" ? BatchOrder::ByLength : BatchOrder::Arrival);
  // This shard's session turns not yet done, in input order.
  std::vector<const PreparedRequest*> shard_turns;
  int64_t to_run = 0;
  for (const PreparedRequest& p : turns) {
    if (!shard.owns(session_owner.at(directory_of(*p.request)))) continue;
    ++totals.share;
    if (done.holds(*p.request)) {
      ++totals.already_done;
      continue;
    }
    shard_turns.push_back(&p);
    ++to_run;
  }
  // This shard's batches with a request not yet done.
  std::vector<std::vector<size_t>> batches;
  for (size_t j = 0; j < all_batches.size(); ++j) {
    if (!shard.owns(static_cast<int64_t>(j))) continue;
    int64_t missing = 0;
    for (size_t i : all_batches[j]) missing += done.holds(*prepared[i].request) ? 0 : 1;
    totals.share += std::ssize(all_batches[j]);
    totals.already_done += std::ssize(all_batches[j]) - missing;
    to_run += missing;
    if (missing > 0) batches.push_back(all_batches[j]);
  }
  // Every batch's memory plan before any work: a refusal comes at once, naming a batch that fits.
  const DType kv_dtype = parse_float_dtype(o.kv_dtype);
  for (const std::vector<size_t>& members : batches) {
    int64_t sequences = 0, longest = 0, gen_len = 0;
    for (size_t i : members) {
      sequences += shapes[i].sequences;
      longest = std::max(longest, shapes[i].prompt_len);
      gen_len = std::max(gen_len, shapes[i].max_tokens);
    }
    plan_offloaded_run(
        offload_memory_request(model.config, sequences, longest, gen_len, kv_dtype, o.offload),
        o.offload, device);
  }

  ResultAppender appender(file);
  if (!error_lines.empty()) appender.append(error_lines);
  {
    Progress progress("requests");
    const auto started = std::chrono::steady_clock::now();
    int64_t finished = 0;      // lines written by this run (failed session turns' included)
    int64_t failed_turns = 0;  // of those, session turns' error lines
    const auto show = [&] {
      const double elapsed =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count();
      const double rate = elapsed > 0 ? static_cast<double>(totals.generated_tokens) / elapsed : 0;
      progress.update(finished, to_run, cat(static_cast<int64_t>(rate), " tok/s"));
    };
    // The session turns first: one pass each, in input order. The tier keeps sessions after
    // their turn; with look-ahead its eviction knows each session's next turn in this order, and
    // the next turn's session is read into it while the current one computes.
    SessionTier tier(*tier_budget);
    // The turn running now; the prefetch thread's admissions read it.
    std::atomic<size_t> position = 0;
    tier.set_next_use([&](const std::string& directory) {
      for (size_t i = position.load() + 1; i < shard_turns.size(); ++i) {
        if (directory_of(*shard_turns[i]->request) == directory) return static_cast<int64_t>(i);
      }
      return kNeverUsedAgain;
    });
    SessionPrefetch prefetch;
    for (position = 0; position < shard_turns.size(); ++position) {
      const PreparedRequest& turn = *shard_turns[position.load()];
      const std::string directory = directory_of(*turn.request);
      if (o.session_prefetch && position + 1 < shard_turns.size()) {
        const std::string next = directory_of(*shard_turns[position.load() + 1]->request);
        if (next != directory && !failed_session.count(next))
          prefetch.start(next, session_key_of_job, tier);
      }
      std::string line;
      if (const auto failed = failed_session.find(directory); failed != failed_session.end()) {
        line = error_line(*turn.request, "invalid_request",
                          cat("an earlier turn of session '", turn.request->session, "' (line ",
                              failed->second, ") failed"));
        ++totals.errors;
        ++failed_turns;
      } else {
        try {
          line = with_interrupt_context(
              [&] {
                return run_session_turn(
                    turn, directory, session_key_of_job, &tier, o, model, device,
                    [&](int64_t, int64_t) { show(); }, totals);
              },
              [&] {
                return cat(" with ", finished, " of ", to_run, " requests of this run written to ",
                           file, "; the same command resumes the job");
              });
        } catch (const Interrupted&) {
          throw;
        } catch (const Error& e) {
          // The session stays as it was (nothing of the turn is committed).
          line = error_line(*turn.request, "invalid_request", e.what());
          failed_session[directory] = turn.request->line;
          ++totals.errors;
          ++failed_turns;
          tier.erase(directory);
        }
      }
      appender.append(line);
      ++finished;
      totals.completed = finished - failed_turns;
      show();
      // Before the position moves: the prefetched session is admitted as the next turn's.
      prefetch.join();
    }
    totals.tier = tier.stats();
    totals.prefetch_bytes = prefetch.bytes_read();
    for (const std::vector<size_t>& members : batches) {
      std::vector<const PreparedRequest*> batch;
      for (size_t i : members) batch.push_back(&prepared[i]);
      // A batch cut short by a crash runs again whole (its members as before); only its
      // requests without a line are written.
      const std::vector<std::string> lines = with_interrupt_context(
          [&] {
            return run_batch(
                batch, o, model, device, [&](int64_t, int64_t) { show(); }, totals);
          },
          [&] {
            return cat(" with ", finished, " of ", to_run, " requests of this run written to ",
                       file, "; the same command resumes the job");
          });
      std::string written;
      for (size_t r = 0; r < batch.size(); ++r) {
        if (done.holds(*batch[r]->request)) continue;
        written += lines[r];
        ++finished;
      }
      appender.append(written);
      totals.completed = finished - failed_turns;
      show();
    }
  }
  bool merged = false;
  if (shard.count == 1) {
    merge_shards(requests, o.output, 1);
    merged = true;
  } else {
    write_done_marker(o.output, shard);
    if (all_shards_done(o.output, shard.count)) {
      merge_shards(requests, o.output, shard.count);
      merged = true;
    }
  }
  print_summary(o, shard, totals, model.description, device, merged);
  return 0;
}

}  // namespace

Command add_batch_command(CLI::App& app) {
  auto o = std::make_shared<BatchOptions>();
  app.add_option("--input,-i", o->input,
                 "Requests, one JSON object a line: OpenAI batch lines for /v1/completions or "
                 "{\"custom_id\", \"prompt\", ...}")
      ->required();
  app.add_option("--output,-o", o->output,
                 "Results, one OpenAI batch output line per request, in input order once the job "
                 "is done; a rerun resumes it")
      ->required();
  add_generation_flags(app, *o);
  app.add_option("--batch,-b", o->batch, "Sequences per batch (a request's prompts times n)")
      ->capture_default_str();
  app.add_option("--order", o->order,
                 "Which requests share a batch: length (by prompt length, then max_tokens among "
                 "neighbours: little padding, sequences ending together) or arrival (input order)")
      ->capture_default_str();
  auto* shard = app.add_option(
      "--shard", o->shard,
      "This process's share, I/N (I from 0); default: from Slurm, MPI or a Kubernetes Indexed "
      "Job's environment, else the whole job");
  app.add_option("--shard-count", o->shard_count,
                 "Shards of the job: a Kubernetes Indexed Job's completions (with "
                 "JOB_COMPLETION_INDEX), or for --merge (default: found from the shard files)");
  app.add_flag("--merge", o->merge,
               "Write --output from the finished shards' files, in input order, and stop")
      ->excludes(shard);
  app.add_flag("--json", o->json, "Print the summary as JSON on stdout");
  app.add_option("--session-root", o->session_root,
                 "Directory of the sessions that requests name (\"session\": a name under it); "
                 "default: a request's session is a directory");
  app.add_option("--session-cache", o->session_cache,
                 "Host memory for sessions kept between their turns (bytes: 512M, 2G; or a share "
                 "of the memory: 10%); 0: every turn reads its history from the disk")
      ->default_val(kSessionCacheDefault);
  app.add_option("--session-prefetch", o->session_prefetch,
                 "Read the next turn's session from the disk into --session-cache while the "
                 "current turn computes (true, false)")
      ->capture_default_str();
  add_overflow_flags(app, *o);
  return [o] { return batch(*o); };
}

}  // namespace infinigen::cli
