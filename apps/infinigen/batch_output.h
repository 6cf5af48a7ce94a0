// apps/infinigen: the output of `infinigen batch`: OpenAI's batch output lines, the file each
// shard appends them to (flushed per finished batch, a torn last line dropped on resume), the
// job's key beside it (a resume with other options is refused), the shard's completion marker,
// and the merge of the shards' files into one output in input order.
//
// Files, for --output OUT: one shard writes OUT itself and OUT.job.json; shard i of n > 1 writes
// OUT.shard-i-of-n, its OUT.shard-i-of-n.job.json and, once every request of its share has a
// line, OUT.shard-i-of-n.done. The finished job's OUT holds one line per non-blank input line,
// in input order.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "apps/infinigen/batch_input.h"
#include "apps/infinigen/batch_shard.h"
#include "core/file_io.h"

namespace infinigen::cli {

// A choice's log-probabilities in OpenAI's completions form, one entry per token of its text.
struct ChoiceLogprobs {
  std::vector<std::string> tokens;     // each token's text
  std::vector<double> token_logprobs;  // log p(token | prompt and the tokens before it)
  // At each position, the most likely tokens' texts and log-probabilities, most likely first (the
  // chosen token's too when it is not among them).
  std::vector<std::vector<std::pair<std::string, double>>> top_logprobs;
  std::vector<int64_t> text_offset;  // where each token's text starts in the choice's text
};

// {"tokens", "token_logprobs", "top_logprobs" (a text -> log-probability object per position),
// "text_offset"}: a choice's "logprobs" in a batch output line, and an output's in `run --json`.
nlohmann::ordered_json logprobs_json(const ChoiceLogprobs& logprobs);

struct Choice {
  std::string text;
  int64_t index = 0;          // prompt index * n + sample
  std::string finish_reason;  // "stop" (a stop string, EOS) or "length" (max_tokens)
  std::optional<ChoiceLogprobs> logprobs;  // unset: "logprobs": null
};

// The line (with its newline) of a request that ran: {"id", "custom_id", "response":
// {"status_code": 200, "request_id", "body": {"id", "object", "model", "choices", "usage"}},
// "error": null}. Nothing in it depends on time or on the other requests of its batch.
std::string completion_line(const BatchRequest& request, const std::string& model,
                            const std::vector<Choice>& choices, int64_t prompt_tokens,
                            int64_t completion_tokens);
// The line of a request that cannot run: "response": null, "error": {"code", "message" (with the
// line number), "line"}.
std::string error_line(const BatchRequest& request, const std::string& code,
                       const std::string& message);

// The file a shard writes its lines to.
std::string shard_file(const std::string& output, const Shard& shard);

// What a shard's file already holds: the requests with a line (by custom_id, or by input line for
// a line that named none).
struct DoneRequests {
  std::set<std::string> custom_ids;
  std::set<int64_t> lines;
  int64_t count = 0;  // lines in the file
  bool holds(const BatchRequest& request) const {
    return request.custom_id.empty() ? lines.count(request.line) > 0
                                     : custom_ids.count(request.custom_id) > 0;
  }
};
// Reads `path` (absent: nothing done). A last line without its newline (a write cut by a crash)
// is cut off the file, and `*dropped` receives its size in bytes (0 when none). One-line Error
// for any other line that is not one of ours.
DoneRequests read_done_requests(const std::string& path, int64_t* dropped);

// Appends whole batches of lines to a shard's file: each append is written in full and flushed
// to the disk before it returns, so that a kill loses at most the batch being written.
class ResultAppender {
 public:
  explicit ResultAppender(const std::string& path);
  void append(const std::string& lines);

 private:
  std::string path_;
  FileDescriptor fd_;
};

// The options that decide a job's output, as (flag, value), in a fixed order.
using JobKey = std::vector<std::pair<std::string, std::string>>;
// Writes `key` beside `file` when the job starts; when one is there (a resume), one-line Error
// naming every option that differs.
void check_job_key(const std::string& file, const JobKey& key);

// The marker a shard writes when every request of its share has a line.
std::string done_marker(const std::string& output, const Shard& shard);
void write_done_marker(const std::string& output, const Shard& shard);
// Whether every shard of `count` has its marker.
bool all_shards_done(const std::string& output, int64_t count);

// Writes `output`, one line per request of `requests` (the whole input) in input order, from the
// files of shards 0..count-1 (for one shard, `output` itself, rewritten in order). One-line Error
// when a shard has not finished or a request has no line. Written whole or not at all.
void merge_shards(const std::vector<BatchRequest>& requests, const std::string& output,
                  int64_t count);

}  // namespace infinigen::cli
