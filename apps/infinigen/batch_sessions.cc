// apps/infinigen: the sessions of a batch job: their directories, turns in order, checks, prefetch,
// a turn's run and the summary's part.
#include "apps/infinigen/batch_sessions.h"

#include <algorithm>
#include <filesystem>
#include <map>

#include "core/error.h"

namespace infinigen::cli {

namespace fs = std::filesystem;

std::string session_directory(const std::string& name, const std::string& root) {
  if (root.empty()) return name;
  INFINIGEN_CHECK(name.find('/') == std::string::npos && name != "." && name != "..",
                  "session '", name, "': not a plain name under --session-root ", root);
  return (fs::path(root) / name).string();
}

std::vector<JobSession> job_sessions(const std::vector<BatchRequest>& requests,
                                     const std::string& root, const SessionKey& key,
                                     const DoneRequests& done) {
  std::vector<JobSession> sessions;
  std::map<std::string, size_t> index;  // directory -> its place in `sessions`
  for (size_t k = 0; k < requests.size(); ++k) {
    const BatchRequest& request = requests[k];
    if (!request.ok() || request.session.empty()) continue;
    const std::string directory = session_directory(request.session, root);
    const auto [it, added] = index.emplace(directory, sessions.size());
    if (added) sessions.push_back({directory, {}});
    JobSession& session = sessions[it->second];
    INFINIGEN_CHECK(!request.session_new || session.requests.empty(), "line ", request.line,
                    ": session_new for session '", request.session,
                    "', which line ", requests[session.requests.front()].line, " already names");
    if (!session.requests.empty()) {
      const BatchRequest& first = requests[session.requests.front()];
      INFINIGEN_CHECK(first.prompts.size() == request.prompts.size(), "line ", request.line, ": ",
                      request.prompts.size(), " prompt(s) for session '", request.session,
                      "', whose turns have ", first.prompts.size(), " (one per conversation)");
    }
    session.requests.push_back(k);
  }
  for (const JobSession& session : sessions) {
    const BatchRequest& first = requests[session.requests.front()];
    const bool on_disk = fs::exists(fs::path(session.directory) / kSessionManifest);
    if (!first.session_new) {
      INFINIGEN_CHECK(on_disk, "line ", first.line, ": unknown session '", first.session, "' (",
                      session.directory,
                      " holds none; start it with \"session_new\": true on its first request)");
    }
    if (!on_disk) {
      // Turns with lines already continued it: its directory went since.
      for (size_t k : session.requests) {
        INFINIGEN_CHECK(!done.holds(requests[k]), "line ", requests[k].line, ": unknown session '",
                        first.session, "' (", session.directory,
                        " holds none, but this turn has a line in the output already)");
      }
      continue;
    }
    // Opened now for its checks (key, manifest, files), before any work.
    const std::unique_ptr<DiskSession> opened = DiskSession::open(session.directory, key);
    INFINIGEN_CHECK(!first.session_new || done.holds(first) ||
                        opened->turn_label() == first.custom_id,
                    "line ", first.line, ": session_new, but ", session.directory,
                    " already holds a session; continue it without session_new, or remove it");
    INFINIGEN_CHECK(std::ssize(first.prompts) == opened->batch(), "line ", first.line, ": ",
                    first.prompts.size(), " prompt(s) for session '", first.session,
                    "', which holds ", opened->batch(), " conversations");
  }
  return sessions;
}

void SessionPrefetch::start(const std::string& directory, const SessionKey& key,
                            SessionTier& tier) {
  join();
  if (tier.budget() == 0 || tier.holds(directory) ||
      !fs::exists(fs::path(directory) / kSessionManifest))
    return;
  thread_ = std::thread([this, directory, key, &tier] {
    try {
      uint64_t bytes = 0;
      std::optional<SessionTier::Entry> entry =
          DiskSession::read_whole(directory, key, tier.budget(), &bytes);
      bytes_read_ += bytes;
      if (entry) tier.put(directory, std::move(*entry), /*prefetch=*/true);
    } catch (const std::exception&) {
      // Its pass reads it again, and reports what is wrong.
    }
  });
}

void SessionPrefetch::join() {
  if (thread_.joinable()) thread_.join();
}

std::string run_session_turn(const PreparedRequest& p, const std::string& directory,
                             const SessionKey& key, SessionTier* tier, const BatchOptions& o,
                             const ModelSource& model, Device device,
                             const ProgressCallback& progress, JobTotals& totals) {
  const BatchRequest& r = *p.request;
  const bool exists = std::filesystem::exists(std::filesystem::path(directory) / kSessionManifest);
  std::unique_ptr<DiskSession> session;
  if (exists) {
    session = DiskSession::open(directory, key, tier);
    if (session->turn_label() == r.custom_id) {
      ++totals.recovered_lines;
      return session->turn_record();
    }
  } else {
    INFINIGEN_CHECK(r.session_new, "unknown session '", r.session, "' (", directory,
                    " holds none)");
    session = DiskSession::create(directory, key);
    session->set_tier(tier);
  }
  session->set_defer_commit(true);
  if (exists && o.drops()) {
    std::vector<int64_t> added;
    for (const std::vector<int32_t>& prompt : p.prompts) added.push_back(std::ssize(prompt));
    session->drop_oldest(model.config, added, p.max_tokens, o.keep_prefix, o.margin);
  }
  GenerationRequest request;
  request.kv_dtype = parse_float_dtype(o.kv_dtype);
  request.prompts = session->turn_prompts(p.prompts);
  request.gen_len = p.max_tokens;
  request.sampling = p.sampling;
  if (r.logprobs) {
    request.score_tokens = true;
    request.top_log_probs = *r.logprobs;
  }
  const OffloadRun run = run_offloaded(model, request, o.offload, device, progress, session.get());
  const int64_t B = std::ssize(request.prompts);
  std::vector<Choice> choices;
  int64_t completion_tokens = 0, prompt_tokens = 0;
  for (int64_t b = 0; b < B; ++b) {
    const std::vector<int32_t>& tokens = run.result.tokens[b];
    choices.push_back({token_text(model, tokens), b, "length", std::nullopt});
    if (r.logprobs) {
      choices.back().logprobs =
          choice_logprobs(model, run.result, b, *r.logprobs, choices.back().text.size());
    }
    completion_tokens += std::ssize(tokens);
    prompt_tokens += std::ssize(p.prompts[static_cast<size_t>(b)]);
  }
  const std::string line = completion_line(r, o.model, choices, prompt_tokens, completion_tokens);
  session->commit(r.custom_id, line);  // durable: a later run finds the line here

  const SessionStats& stats = session->stats();
  totals.add_pass(run, p.longest());
  totals.prompt_tokens += prompt_tokens;
  totals.generated_tokens += completion_tokens;
  totals.session_turns += 1;
  if (exists && stats.from_tier) {
    ++totals.hot_turns;
    totals.hot_ttft.push_back(run.result.prefill_seconds);
    totals.hot_bytes += stats.bytes_from_tier;
  } else if (exists) {
    ++totals.cold_turns;
    totals.cold_ttft.push_back(run.result.prefill_seconds);
    totals.cold_bytes += stats.bytes_read;
  }
  return line;
}

nlohmann::ordered_json session_summary(const JobTotals& t) {
  // The median of the turns' times (0 for none): a shared machine's outliers count less.
  const auto median = [](std::vector<double> times) {
    if (times.empty()) return 0.0;
    std::sort(times.begin(), times.end());
    const size_t n = times.size();
    return n % 2 == 1 ? times[n / 2] : (times[n / 2 - 1] + times[n / 2]) / 2;
  };
  return {{"turns", t.session_turns},
          {"hot_turns", t.hot_turns},
          {"cold_turns", t.cold_turns},
          {"first_turns", t.session_turns - t.hot_turns - t.cold_turns},
          {"hot_ttft_s", median(t.hot_ttft)},
          {"cold_ttft_s", median(t.cold_ttft)},
          {"hot_bytes", t.hot_bytes},
          {"cold_bytes", t.cold_bytes},
          {"tier_admitted", t.tier.admitted},
          {"tier_evictions", t.tier.evictions},
          {"tier_bypassed", t.tier.bypassed},
          {"tier_prefetched", t.tier.prefetched},
          {"prefetch_bytes", t.prefetch_bytes},
          {"tier_peak_bytes", t.tier.peak_bytes},
          {"recovered_lines", t.recovered_lines}};
}

}  // namespace infinigen::cli
