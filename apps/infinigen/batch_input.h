// apps/infinigen: the request lines of `infinigen batch` (docs/batch.md): OpenAI's batch request
// lines for /v1/completions and the plain {"custom_id", "prompt", ...} form, read into requests
// or, line by line, into the error their output line reports.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <variant>
#include <vector>

namespace infinigen::cli {

// A prompt as given: text, or token ids.
using PromptInput = std::variant<std::string, std::vector<int32_t>>;

// One non-blank input line. Either a request (error empty) or why it cannot run.
inline constexpr int64_t kMostLogprobs = 5;

struct BatchRequest {
  int64_t line = 0;                   // 1-based line number in the input file
  std::string custom_id;              // empty only for a line too malformed to name one
  std::vector<PromptInput> prompts;   // one or more (a list prompt), each sampled n times
  std::optional<int64_t> max_tokens;  // unset: the job's --gen-len
  std::optional<float> temperature;   // unset: the job's
  std::optional<float> top_p;
  std::optional<uint64_t> seed;
  std::vector<std::string> stop;  // at most 4, none empty
  // Set: each choice reports its tokens' log-probabilities and, at each position, the
  // `logprobs` most likely tokens' (0 to kMostLogprobs, OpenAI's limit); unset: "logprobs": null.
  std::optional<int64_t> logprobs;
  int64_t n = 1;                  // samples per prompt
  // The conversation this request is the next turn of (docs/batch.md, "Sessions"): a session
  // directory, or a name under --session-root; empty: none. `session_new`: this request starts
  // it (its first turn), as `run --session` does; otherwise it continues one, as `run --resume`.
  std::string session;
  bool session_new = false;
  std::string error_code;         // "invalid_json", "invalid_request", "unsupported_endpoint", ...
  std::string error;              // one line, without the line number

  bool ok() const { return error.empty(); }
  // Sequences the request runs: prompts times n.
  int64_t sequences() const { return static_cast<int64_t>(prompts.size()) * n; }
};

// Reads one line (`number` 1-based); never throws for what the line holds.
BatchRequest parse_request_line(const std::string& text, int64_t number);

// Every non-blank line of `path` (CR LF accepted). One-line Error when the file cannot be read.
std::vector<BatchRequest> read_batch_input(const std::string& path);

// One-line Error naming every custom_id that appears on more than one line, with its line
// numbers (the first few, when there are many).
void refuse_duplicate_ids(const std::vector<BatchRequest>& requests, const std::string& path);

}  // namespace infinigen::cli
