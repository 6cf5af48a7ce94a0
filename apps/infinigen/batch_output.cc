// apps/infinigen: batch output lines and files.
#include "apps/infinigen/batch_output.h"

#include <fcntl.h>
#include <unistd.h>

#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "core/error.h"

namespace infinigen::cli {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;  // keys in the order written: OpenAI's order

// The ids of a request's line: from its input line, so the same in every shard and every rerun.
std::string request_id(const BatchRequest& request) {
  return "batch_req_" + std::to_string(request.line);
}

Json custom_id_json(const BatchRequest& request) {
  return request.custom_id.empty() ? Json(nullptr) : Json(request.custom_id);
}

// One result line as written (without its newline), for reading back.
struct ResultKey {
  std::string custom_id;  // empty for an error line that named none
  int64_t line = 0;       // such an error line's input line
};

// The key of result line `text`, or nullopt when it is not one of ours.
std::optional<ResultKey> result_key(const std::string& text) {
  const Json line = Json::parse(text, nullptr, false);
  if (line.is_discarded() || !line.is_object() || !line.contains("custom_id")) return std::nullopt;
  if (line["custom_id"].is_string()) return ResultKey{line["custom_id"].get<std::string>(), 0};
  if (line.contains("error") && line["error"].is_object() && line["error"].contains("line") &&
      line["error"]["line"].is_number_integer()) {
    return ResultKey{"", line["error"]["line"].get<int64_t>()};
  }
  return std::nullopt;
}

}  // namespace

nlohmann::ordered_json logprobs_json(const ChoiceLogprobs& logprobs) {
  Json top = Json::array();
  for (const auto& position : logprobs.top_logprobs) {
    Json tokens = Json::object();
    // Two tokens of one text (rare): the more likely one's entry stays.
    for (const auto& [text, log_prob] : position) tokens.emplace(text, log_prob);
    top.push_back(std::move(tokens));
  }
  return {{"tokens", logprobs.tokens},
          {"token_logprobs", logprobs.token_logprobs},
          {"top_logprobs", std::move(top)},
          {"text_offset", logprobs.text_offset}};
}

namespace {

std::string sibling(const std::string& file, const char* suffix) {
  return file + suffix;
}

}  // namespace

std::string completion_line(const BatchRequest& request, const std::string& model,
                            const std::vector<Choice>& choices, int64_t prompt_tokens,
                            int64_t completion_tokens) {
  Json listed = Json::array();
  for (const Choice& choice : choices) {
    listed.push_back({{"text", choice.text},
                      {"index", choice.index},
                      {"logprobs", choice.logprobs ? logprobs_json(*choice.logprobs) : Json()},
                      {"finish_reason", choice.finish_reason}});
  }
  const Json line = {{"id", request_id(request)},
                     {"custom_id", custom_id_json(request)},
                     {"response",
                      {{"status_code", 200},
                       {"request_id", "req_" + std::to_string(request.line)},
                       {"body",
                        {{"id", "cmpl-" + std::to_string(request.line)},
                         {"object", "text_completion"},
                         {"model", model},
                         {"choices", listed},
                         {"usage",
                          {{"prompt_tokens", prompt_tokens},
                           {"completion_tokens", completion_tokens},
                           {"total_tokens", prompt_tokens + completion_tokens}}}}}}},
                     {"error", nullptr}};
  // A token's text can be part of a UTF-8 character (byte-level BPE): written as U+FFFD.
  return line.dump(-1, ' ', false, Json::error_handler_t::replace) + "\n";
}

std::string error_line(const BatchRequest& request, const std::string& code,
                       const std::string& message) {
  const Json line = {{"id", request_id(request)},
                     {"custom_id", custom_id_json(request)},
                     {"response", nullptr},
                     {"error",
                      {{"code", code},
                       {"message", cat("line ", request.line, ": ", message)},
                       {"line", request.line}}}};
  // Invalid UTF-8 in a quoted value is replaced rather than refused: the line must be written.
  return line.dump(-1, ' ', false, Json::error_handler_t::replace) + "\n";
}

std::string shard_file(const std::string& output, const Shard& shard) {
  return shard.count == 1 ? output : cat(output, ".shard-", shard.index, "-of-", shard.count);
}

DoneRequests read_done_requests(const std::string& path, int64_t* dropped) {
  *dropped = 0;
  DoneRequests done;
  std::error_code error;
  if (!fs::exists(path, error)) return done;
  const std::string text = read_text_file(path);
  size_t start = 0;
  int64_t number = 0;
  while (start < text.size()) {
    const size_t end = text.find('\n', start);
    if (end == std::string::npos) {
      // A write the process did not finish: cut it off, its batch runs again.
      *dropped = static_cast<int64_t>(text.size() - start);
      fs::resize_file(path, start, error);
      INFINIGEN_CHECK(!error, path, ": cannot cut off its torn last line (", error.message(), ")");
      break;
    }
    ++number;
    const std::optional<ResultKey> key = result_key(text.substr(start, end - start));
    INFINIGEN_CHECK(key.has_value(), path, ":", number,
                    ": not a batch output line (is this the output of another program?)");
    if (key->custom_id.empty()) {
      done.lines.insert(key->line);
    } else {
      done.custom_ids.insert(key->custom_id);
    }
    ++done.count;
    start = end + 1;
  }
  return done;
}

ResultAppender::ResultAppender(const std::string& path)
    : path_(path), fd_(::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644)) {
  INFINIGEN_CHECK(static_cast<bool>(fd_), path, ": cannot open for writing (", errno_text(errno),
                  ")");
}

void ResultAppender::append(const std::string& lines) {
  if (const int error = write_all(fd_.get(), lines.data(), lines.size()); error != 0) {
    fail(path_, ": cannot write (", errno_text(error), ")");
  }
  INFINIGEN_CHECK(::fdatasync(fd_.get()) == 0, path_, ": cannot flush to the disk (",
                  errno_text(errno), ")");
}

void check_job_key(const std::string& file, const JobKey& key) {
  const std::string path = sibling(file, ".job.json");
  Json written = Json::object();
  for (const auto& [flag, value] : key) written[flag] = value;
  std::error_code error;
  if (!fs::exists(path, error)) {
    write_text_file(path, written.dump(2) + "\n");
    return;
  }
  const Json before = Json::parse(read_text_file(path), nullptr, false);
  INFINIGEN_CHECK(!before.is_discarded() && before.is_object(), path,
                  ": not a batch job's options (remove it to start the job again)");
  std::string was, now;
  for (const auto& [flag, value] : key) {
    const std::string old =
        before.contains(flag) && before[flag].is_string() ? before[flag].get<std::string>() : "";
    if (old == value) continue;
    was += cat(was.empty() ? "" : " ", flag, " ", old.empty() ? "(unset)" : old);
    now += cat(now.empty() ? "" : " ", flag, " ", value);
  }
  INFINIGEN_CHECK(was.empty(), file, " was started with ", was, "; this run has ", now,
                  ": resume with the same options, or write another --output");
}

std::string done_marker(const std::string& output, const Shard& shard) {
  return sibling(shard_file(output, shard), ".done");
}

void write_done_marker(const std::string& output, const Shard& shard) {
  write_text_file(done_marker(output, shard),
                  cat("shard ", shard.index, " of ", shard.count, " finished\n"));
}

bool all_shards_done(const std::string& output, int64_t count) {
  std::error_code error;
  for (int64_t i = 0; i < count; ++i) {
    if (!fs::exists(done_marker(output, {i, count, ""}), error)) return false;
  }
  return true;
}

void merge_shards(const std::vector<BatchRequest>& requests, const std::string& output,
                  int64_t count) {
  // Input position of each request, by custom_id or (a line that named none) by line.
  std::map<std::string, size_t> by_id;
  std::map<int64_t, size_t> by_line;
  for (size_t i = 0; i < requests.size(); ++i) {
    if (requests[i].custom_id.empty()) {
      by_line[requests[i].line] = i;
    } else {
      by_id[requests[i].custom_id] = i;
    }
  }
  std::vector<std::string> lines(requests.size());
  std::string first_key;  // shard 0's options: every shard's must be the same
  for (int64_t s = 0; s < count; ++s) {
    const Shard shard{s, count, ""};
    const std::string file = shard_file(output, shard);
    std::error_code error;
    INFINIGEN_CHECK(count == 1 || fs::exists(done_marker(output, shard), error), "shard ", s,
                    " of ", count, " has not finished (no ", done_marker(output, shard), ")");
    if (count > 1) {
      const std::string key = read_text_file(sibling(file, ".job.json"));
      if (s == 0) first_key = key;
      INFINIGEN_CHECK(key == first_key, sibling(file, ".job.json"), " differs from ",
                      sibling(shard_file(output, {0, count, ""}), ".job.json"),
                      ": the shards ran with different options");
    }
    const std::string text = fs::exists(file, error) ? read_text_file(file) : std::string();
    size_t start = 0;
    for (int64_t number = 1; start < text.size(); ++number) {
      size_t end = text.find('\n', start);
      INFINIGEN_CHECK(end != std::string::npos, file, ":", number,
                      ": the last line is cut short: run the shard again to finish it");
      const std::string line = text.substr(start, end + 1 - start);
      const std::optional<ResultKey> key = result_key(line.substr(0, line.size() - 1));
      INFINIGEN_CHECK(key.has_value(), file, ":", number, ": not a batch output line");
      size_t at = 0;
      if (key->custom_id.empty()) {
        const auto found = by_line.find(key->line);
        INFINIGEN_CHECK(found != by_line.end(), file, ":", number,
                        ": an error line for input line ", key->line,
                        ", which is not a request of this input (was it written for another?)");
        at = found->second;
      } else {
        const auto found = by_id.find(key->custom_id);
        INFINIGEN_CHECK(found != by_id.end(), file, ":", number, ": custom_id '", key->custom_id,
                        "' is not in this input (was it written for another?)");
        at = found->second;
      }
      INFINIGEN_CHECK(lines[at].empty(), file, ":", number, ": a second line for input line ",
                      requests[at].line);
      lines[at] = line;
      start = end + 1;
    }
  }
  std::string merged;
  for (size_t i = 0; i < lines.size(); ++i) {
    INFINIGEN_CHECK(
        !lines[i].empty(), "no result for input line ", requests[i].line,
        requests[i].custom_id.empty() ? "" : " (custom_id '" + requests[i].custom_id + "')",
        ": run its shard again");
    merged += lines[i];
  }
  write_text_file(output, merged);
}

}  // namespace infinigen::cli
