// bench: prompts longer than the model's context, truncated through a session or recomputed.
#include "bench/past_context.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>

#include "core/error.h"

namespace infinigen {

PastContext parse_past_context(std::string_view text) {
  if (text == "refuse") return PastContext::Refuse;
  if (text == "drop-oldest") return PastContext::DropOldest;
  if (text == "recompute") return PastContext::Recompute;
  fail(option("past_context"), " is refuse, drop-oldest or recompute, got '", text, "'");
}

const char* past_context_name(PastContext mode) {
  switch (mode) {
    case PastContext::Refuse:
      return "refuse";
    case PastContext::DropOldest:
      return "drop-oldest";
    case PastContext::Recompute:
      return "recompute";
  }
  return "?";
}

int64_t PastContextOptions::dropped(int64_t length, int64_t generated, int64_t max_positions) {
  return std::max<int64_t>(0, length + generated - max_positions);
}

int64_t PastContextOptions::longest_prompt(int64_t generated, int64_t max_positions) const {
  const int64_t fits = max_positions - generated;
  // keep_prefix + dropped <= length / 2, with dropped = length - fits.
  return mode == PastContext::Refuse ? fits : std::max(fits, 2 * (fits - keep_prefix));
}

void PastContextOptions::validate() const {
  INFINIGEN_CHECK(keep_prefix >= 0, option("keep_prefix"), " must be at least 0, got ",
                  keep_prefix);
}

OffloadRun run_past_context(const ModelSource& model, GenerationRequest request,
                            const PastContextOptions& past, int64_t generated, int64_t dropped,
                            const OffloadOptions& offload, Device device,
                            const ProgressCallback& progress) {
  request.sequence_gen_len.clear();
  const int64_t keep = past.keep_prefix;
  if (past.mode == PastContext::Recompute) {
    for (std::vector<int32_t>& ids : request.prompts) {
      ids.erase(ids.begin() + keep, ids.begin() + keep + dropped);
    }
    return run_offloaded(model, request, offload, device, progress);
  }
  INFINIGEN_CHECK(past.mode == PastContext::DropOldest, "a prompt of ", request.prompts[0].size(),
                  " tokens passes the model's context");
  // A session in a directory of its own, removed however the run ends.
  static std::atomic<int64_t> sessions = 0;
  const std::filesystem::path directory =
      std::filesystem::temp_directory_path() /
      cat("infinigen-past-context-", static_cast<int64_t>(::getpid()), "-", sessions++);
  struct Remove {
    const std::filesystem::path& path;
    ~Remove() {
      std::error_code ignored;
      std::filesystem::remove_all(path, ignored);
    }
  } remove{directory};
  const SessionKey key = session_key(model, offload, request.kv_dtype, device);
  const int64_t length = std::ssize(request.prompts[0]), split = length / 2;
  const int64_t B = std::ssize(request.prompts);
  // Turn 1: the first half, the token after it forced (it starts turn 2's prompt).
  GenerationRequest first = request;
  first.gen_len = 1;
  first.forced_tokens.clear();
  for (int64_t b = 0; b < B; ++b) {
    const std::vector<int32_t>& ids = request.prompts[b];
    first.prompts[b].assign(ids.begin(), ids.begin() + split);
    first.forced_tokens.push_back({ids[split]});
  }
  {
    const std::unique_ptr<DiskSession> session = DiskSession::create(directory, key);
    first.prompts = session->turn_prompts(first.prompts);
    run_offloaded(model, first, offload, device, {}, session.get());
  }
  // Turn 2: the rest, past the context, and what follows it (generated, or forced).
  const std::unique_ptr<DiskSession> session = DiskSession::open(directory, key);
  const std::vector<int64_t> added(static_cast<size_t>(B), length - split - 1);
  session->drop_oldest(model.config, added, generated, keep);
  GenerationRequest second = request;
  for (std::vector<int32_t>& ids : second.prompts) ids.erase(ids.begin(), ids.begin() + split + 1);
  second.prompts = session->turn_prompts(second.prompts);
  return run_offloaded(model, second, offload, device, progress, session.get());
}

}  // namespace infinigen
