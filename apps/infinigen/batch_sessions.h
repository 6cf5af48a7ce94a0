// apps/infinigen: the sessions of an `infinigen batch` job (docs/batch.md, "Sessions"): which
// conversation each request continues, the order its turns run in, the checks made before any
// work, the host-memory tier's look-ahead and prefetch (offload/session_tier.h), a turn's run,
// and the sessions' part of the summary.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "apps/infinigen/batch_input.h"
#include "apps/infinigen/batch_job.h"
#include "apps/infinigen/batch_output.h"
#include "offload/session.h"

namespace infinigen::cli {

// The directory of session `name`: `root`/`name` (a plain name: no '/', not "." or "..") with a
// root, else `name` itself. One-line Error otherwise.
std::string session_directory(const std::string& name, const std::string& root);

// One session of the job: its directory and its requests (indices into the input), in input
// order, which is the order its turns run in (turn k + 1 after turn k has committed).
struct JobSession {
  std::string directory;
  std::vector<size_t> requests;
};

// The job's sessions, in order of their first request. Checked before anything runs, each with a
// one-line Error: a name that is not one, session_new on a request that is not its session's
// first, a first request that continues a directory holding no session (unknown), a first request
// that starts a session a directory already holds (unless that session's last turn is this
// request's, committed by a run that was killed before writing its line), a session saved with
// another model, policy or fixed option (`key`), or turns with different numbers of prompts.
std::vector<JobSession> job_sessions(const std::vector<BatchRequest>& requests,
                                     const std::string& root, const SessionKey& key,
                                     const DoneRequests& done);

// Reads a session from the disk into the tier on a thread of its own, while the current pass
// computes (CachedAttention's prefetch): started for the session of the next pass; join() before
// that pass opens it. A session the tier holds, or that the disk does not hold yet, is skipped;
// an error leaves the session to be read by its pass.
class SessionPrefetch {
 public:
  SessionPrefetch() = default;
  SessionPrefetch(const SessionPrefetch&) = delete;
  SessionPrefetch& operator=(const SessionPrefetch&) = delete;
  ~SessionPrefetch() { join(); }
  void start(const std::string& directory, const SessionKey& key, SessionTier& tier);
  void join();
  uint64_t bytes_read() const { return bytes_read_; }  // by every prefetch so far

 private:
  std::thread thread_;
  uint64_t bytes_read_ = 0;
};

// One turn of a session: its history resumed (from the tier when it holds it, else from the disk),
// `p`'s prompts generated as a `run --resume` would (every sequence its max_tokens, no stop), its
// new rows saved, and the manifest committed with the request's output line, which is returned
// (the caller then appends it). A line found committed (a run killed between the commit and the
// line) is returned without running anything.
std::string run_session_turn(const PreparedRequest& p, const std::string& directory,
                             const SessionKey& key, SessionTier* tier, const BatchOptions& o,
                             const ModelSource& model, Device device,
                             const ProgressCallback& progress, JobTotals& totals);

// The session turns of the summary (docs/batch.md, "Sessions").
nlohmann::ordered_json session_summary(const JobTotals& t);

}  // namespace infinigen::cli
