// apps/infinigen: the sessions of a batch job: their directories, turns in order, checks, prefetch.
#include "apps/infinigen/batch_sessions.h"

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

}  // namespace infinigen::cli
