// apps/infinigen: reading batch request lines.
#include "apps/infinigen/batch_input.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string_view>

#include "core/error.h"

namespace infinigen::cli {
namespace {

using nlohmann::json;

// A request field's value that cannot be used: thrown while one line is read, caught there.
struct BadField {
  std::string code;
  std::string message;
};

[[noreturn]] void refuse(std::string message, std::string code = "invalid_request") {
  throw BadField{std::move(code), std::move(message)};
}

// A value as the user wrote it, cut short for a message.
std::string shown(const json& value) {
  std::string text = value.dump();
  if (text.size() > 40) text = text.substr(0, 37) + "...";
  return text;
}

int64_t whole_number(const json& value, const char* field, int64_t least) {
  if (!value.is_number_integer() || value.get<int64_t>() < least) {
    refuse(cat(field, " must be a whole number >= ", least, ", got ", shown(value)));
  }
  return value.get<int64_t>();
}

// A prompt: a string, token ids, or a list of either (several prompts).
std::vector<PromptInput> read_prompts(const json& value) {
  const auto token_ids = [](const json& ids) {
    std::vector<int32_t> out;
    for (const json& id : ids) {
      if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX) {
        refuse(cat("prompt token ids must be whole numbers >= 0, got ", shown(id)));
      }
      out.push_back(id.get<int32_t>());
    }
    if (out.empty()) refuse("prompt has no token ids");
    return out;
  };
  if (value.is_string()) return {value.get<std::string>()};
  if (!value.is_array() || value.empty()) {
    refuse(cat("prompt must be a string, a list of strings or token ids, got ", shown(value)));
  }
  if (value.front().is_number()) return {token_ids(value)};
  std::vector<PromptInput> prompts;
  for (const json& item : value) {
    if (item.is_string()) {
      prompts.emplace_back(item.get<std::string>());
    } else if (item.is_array()) {
      prompts.emplace_back(token_ids(item));
    } else {
      refuse(cat("prompt list items must be strings or lists of token ids, got ", shown(item)));
    }
  }
  return prompts;
}

std::vector<std::string> read_stop(const json& value) {
  if (value.is_null()) return {};
  std::vector<std::string> stop;
  if (value.is_string()) {
    stop.push_back(value.get<std::string>());
  } else if (value.is_array() && value.size() <= 4) {
    for (const json& item : value) {
      if (!item.is_string()) refuse(cat("stop must hold strings, got ", shown(item)));
      stop.push_back(item.get<std::string>());
    }
  } else {
    refuse(cat("stop must be a string or a list of at most 4, got ", shown(value)));
  }
  if (std::find(stop.begin(), stop.end(), "") != stop.end()) refuse("stop holds an empty string");
  return stop;
}

// Completions fields read only at the value that changes nothing here (accepted, ignored).
constexpr std::string_view kNeutralFields[] = {"model",
                                               "user",
                                               "echo",
                                               "stream",
                                               "stream_options",
                                               "suffix",
                                               "presence_penalty",
                                               "frequency_penalty",
                                               "logit_bias"};

bool is_neutral_field(const std::string& key) {
  return std::find(std::begin(kNeutralFields), std::end(kNeutralFields), key) !=
         std::end(kNeutralFields);
}

// Whether `value` of a neutral field changes nothing.
bool neutral_value(const std::string& key, const json& value) {
  if (key == "model" || key == "user") return value.is_string();
  if (key == "echo" || key == "stream") return value.is_null() || value == false;
  if (key == "presence_penalty" || key == "frequency_penalty") {
    return value.is_null() || (value.is_number() && value.get<double>() == 0.0);
  }
  if (key == "logit_bias") return value.is_null() || (value.is_object() && value.empty());
  return value.is_null();  // suffix, stream_options
}

// The completion settings of `fields` (a request body, or the plain form's line) into `request`.
void read_fields(const json& fields, BatchRequest& request, bool plain) {
  std::optional<int64_t> best_of;
  for (const auto& [key, value] : fields.items()) {
    if (key == "custom_id" && plain) continue;
    if (key == "prompt") {
      request.prompts = read_prompts(value);
    } else if (key == "max_tokens") {
      if (!value.is_null()) request.max_tokens = whole_number(value, "max_tokens", 1);
    } else if (key == "n") {
      if (!value.is_null()) request.n = whole_number(value, "n", 1);
    } else if (key == "best_of") {
      if (!value.is_null()) best_of = whole_number(value, "best_of", 1);
    } else if (key == "temperature") {
      if (value.is_null()) continue;
      if (!value.is_number() || !(value.get<double>() >= 0.0) ||
          !std::isfinite(value.get<double>())) {
        refuse(cat("temperature must be a number >= 0, got ", shown(value)));
      }
      request.temperature = value.get<float>();
    } else if (key == "top_p") {
      if (value.is_null()) continue;
      if (!value.is_number() || !(value.get<double>() > 0.0 && value.get<double>() <= 1.0)) {
        refuse(cat("top_p must be a number in (0, 1], got ", shown(value)));
      }
      request.top_p = value.get<float>();
    } else if (key == "seed") {
      if (value.is_null()) continue;
      if (!value.is_number_unsigned() &&
          !(value.is_number_integer() && value.get<int64_t>() >= 0)) {
        refuse(cat("seed must be a whole number >= 0, got ", shown(value)));
      }
      request.seed = value.get<uint64_t>();
    } else if (key == "stop") {
      request.stop = read_stop(value);
    } else if (key == "logprobs") {
      if (value.is_null()) continue;
      const int64_t k = whole_number(value, "logprobs", 0);
      if (k > kMostLogprobs) {
        refuse(cat("logprobs must be at most ", kMostLogprobs, ", got ", shown(value)),
               "unsupported_value");
      }
      request.logprobs = k;
    } else if (key == "session") {
      if (value.is_null()) continue;
      if (!value.is_string() || value.get<std::string>().empty()) {
        refuse(cat("session must be a non-empty string, got ", shown(value)));
      }
      request.session = value.get<std::string>();
    } else if (key == "session_new") {
      if (value.is_null()) continue;
      if (!value.is_boolean()) refuse(cat("session_new must be true or false, got ", shown(value)));
      request.session_new = value.get<bool>();
    } else if (key == "messages") {
      refuse(
          "chat requests (messages) are not supported: there are no chat templates yet; give "
          "a prompt for /v1/completions",
          "unsupported_endpoint");
    } else if (!is_neutral_field(key)) {
      refuse(cat("unknown field '", key, "'"), "unsupported_value");
    } else if (!neutral_value(key, value)) {
      refuse(cat(key, " ", shown(value), " is not supported"), "unsupported_value");
    }
  }
  if (best_of && *best_of != request.n) {
    refuse(cat("best_of ", *best_of, " is not supported (only best_of equal to n)"),
           "unsupported_value");
  }
  if (request.prompts.empty()) refuse("the request has no prompt");
  if (request.session_new && request.session.empty()) refuse("session_new without a session");
  if (!request.session.empty()) {
    // A turn of a conversation: one sequence per conversation, its whole max_tokens, as `run`.
    if (request.n != 1) refuse(cat("a session's turn takes n 1, got ", request.n));
    if (!request.stop.empty()) refuse("a session's turn takes no stop strings");
  }
}

// The OpenAI form: {"custom_id", "method", "url", "body": {...}}.
void read_openai_form(const json& line, BatchRequest& request) {
  for (const auto& [key, value] : line.items()) {
    if (key != "custom_id" && key != "method" && key != "url" && key != "body") {
      refuse(cat("unknown field '", key, "' (a batch line holds custom_id, method, url, body)"));
    }
  }
  if (line.contains("method") && line["method"] != "POST") {
    refuse(cat("method must be POST, got ", shown(line["method"])));
  }
  const json url = line.value("url", json("/v1/completions"));
  if (url == "/v1/chat/completions") {
    refuse(
        "chat requests (/v1/chat/completions) are not supported: there are no chat templates "
        "yet; use /v1/completions with a prompt",
        "unsupported_endpoint");
  }
  if (url != "/v1/completions") {
    refuse(cat("url ", shown(url), " is not supported: only /v1/completions"),
           "unsupported_endpoint");
  }
  if (!line.contains("body") || !line["body"].is_object()) refuse("body must be an object");
  read_fields(line["body"], request, false);
}

}  // namespace

BatchRequest parse_request_line(const std::string& text, int64_t number) {
  BatchRequest request;
  request.line = number;
  json line;
  try {
    line = json::parse(text);
  } catch (const json::parse_error& e) {
    std::string why = e.what();
    const size_t at = why.find("] ");  // "[json.exception.parse_error.101] parse error at ..."
    if (at != std::string::npos) why = why.substr(at + 2);
    request.error_code = "invalid_json";
    request.error = "not JSON: " + why;
    return request;
  }
  try {
    if (!line.is_object()) refuse("a request line must be a JSON object", "invalid_json");
    if (line.contains("custom_id")) {
      const json& id = line["custom_id"];
      if (!id.is_string() || id.get<std::string>().empty()) {
        refuse(cat("custom_id must be a non-empty string, got ", shown(id)));
      }
      request.custom_id = id.get<std::string>();
    } else {
      refuse("the line has no custom_id");
    }
    if (line.contains("body") || line.contains("url") || line.contains("method")) {
      read_openai_form(line, request);
    } else {
      read_fields(line, request, true);
    }
  } catch (const BadField& bad) {
    request.error_code = bad.code;
    request.error = bad.message;
    request.prompts.clear();
  }
  return request;
}

std::vector<BatchRequest> read_batch_input(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  INFINIGEN_CHECK(in.good(), "--input ", path, ": no such file or not readable");
  std::vector<BatchRequest> requests;
  int64_t number = 0;
  for (std::string text; std::getline(in, text);) {
    ++number;
    if (!text.empty() && text.back() == '\r') text.pop_back();
    if (text.find_first_not_of(" \t") == std::string::npos) continue;
    requests.push_back(parse_request_line(text, number));
  }
  INFINIGEN_CHECK(!in.bad(), "--input ", path, ": read error");
  return requests;
}

void refuse_duplicate_ids(const std::vector<BatchRequest>& requests, const std::string& path) {
  std::map<std::string_view, std::vector<int64_t>> lines;
  for (const BatchRequest& request : requests) {
    if (!request.custom_id.empty()) lines[request.custom_id].push_back(request.line);
  }
  std::string listed;
  int64_t duplicated = 0;
  for (const auto& [id, at] : lines) {
    if (at.size() < 2) continue;
    if (++duplicated > 5) continue;
    listed += cat(duplicated > 1 ? "; " : "", "'", id, "' on lines ");
    for (size_t i = 0; i < at.size() && i < 5; ++i) listed += cat(i > 0 ? ", " : "", at[i]);
    if (at.size() > 5) listed += cat(" and ", at.size() - 5, " more");
  }
  if (duplicated > 5) listed += cat("; and ", duplicated - 5, " more custom_ids");
  INFINIGEN_CHECK(duplicated == 0, "--input ", path, ": ", duplicated,
                  duplicated == 1 ? " custom_id appears" : " custom_ids appear",
                  " more than once (each request needs its own): ", listed);
}

}  // namespace infinigen::cli
