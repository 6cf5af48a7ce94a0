// tests: `infinigen batch` jobs on opt-tiny through the binary (docs/batch.md): a batched job
// gives each request what it gets alone, shards run at once merge to the one-shard output byte for
// byte, a killed or interrupted job resumed gives the uninterrupted output, bad requests get
// error lines and the job goes on.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "tests/test_util.h"

namespace infinigen {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing_util::BackgroundInfinigen;
using testing_util::CommandResult;
using testing_util::expect_one_line_error;
using testing_util::MeasuredCommand;
using testing_util::run_infinigen;
using testing_util::run_infinigen_measured;
using testing_util::TempDir;

const std::string kTiny = std::string(INFINIGEN_FIXTURES_DIR) + "/opt-tiny";

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_file(const fs::path& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// `count` requests of mixed lengths and settings, deterministic: both line forms, prompts of 1 to
// 60 words, some two prompts, n of 1 to 3, max_tokens 1 to 12, every fourth with stop strings,
// greedy, or with `sampled` every fifth sampled (its own temperature, top_p and seed).
std::string mixed_requests(int count, uint32_t seed, bool sampled) {
  static const char* const kWords[] = {"the",  "LORD", "said",  "file", "Python", "and",
                                       "open", "a",    "reads", "unto", "them",   "heaven"};
  std::mt19937 rng(seed);
  const auto prompt = [&] {
    std::string text;
    const int words = 1 + static_cast<int>(rng() % 60);
    for (int w = 0; w < words; ++w) {
      if (w > 0) text += ' ';
      text += kWords[rng() % 12];
    }
    return text;
  };
  std::string out;
  for (int i = 0; i < count; ++i) {
    json body = {{"max_tokens", 1 + rng() % 12}, {"n", 1 + rng() % 3}};
    body["prompt"] = rng() % 6 == 0 ? json::array({prompt(), prompt()}) : json(prompt());
    if (body["prompt"].is_array()) body["n"] = 1;
    if (i % 4 == 1) body["stop"] = json::array({" the", "open"});
    if (sampled && i % 5 == 2) {
      body["temperature"] = 0.7;
      body["top_p"] = 0.9;
      body["seed"] = i;
    } else {
      body["temperature"] = 0;
    }
    const std::string id = "req-" + std::to_string(i);
    json line;
    if (i % 2 == 0) {
      line = {{"custom_id", id}, {"method", "POST"}, {"url", "/v1/completions"}, {"body", body}};
      line["body"]["model"] = "opt-tiny";
    } else {
      line = body;
      line["custom_id"] = id;
    }
    out += line.dump() + "\n";
  }
  return out;
}

// A job's command line on opt-tiny.
std::vector<std::string> job(const fs::path& input, const fs::path& output,
                             std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {"batch",        "--model",  kTiny,          "--input",
                                   input.string(), "--output", output.string()};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

// ---- jobs through the binary ----

// Every line of `output` by custom_id: its response body's choices and usage.
std::map<std::string, json> bodies(const std::string& output) {
  std::map<std::string, json> out;
  for (const std::string& line : lines_of(output)) {
    const json j = json::parse(line);
    out[j["custom_id"]] = j["response"].is_null() ? j["error"] : j["response"]["body"];
  }
  return out;
}

// Greedy, a request's choices in a job of mixed requests (batches of 8, grouped by length, n
// samples sharing their prompt's KV blocks) are those it gets alone. With policy full, whose
// attention is exact; InfiniGen's speculation depends on its batch (its fetch size is the batch's
// mean), which is why shards take whole batches. (Sampled choices are left out: another batch can
// change a logit's last bits, which moves a draw that lands on a boundary.)
TEST(BatchJob, EachRequestGetsWhatItGetsAlone) {
  TempDir dir("batch-alone");
  const std::string requests = mixed_requests(240, 7, false);
  write_file(dir.path() / "in.jsonl", requests);
  const std::vector<std::string> options = {"--policy", "full", "--kv-block-tokens", "4"};
  std::vector<std::string> with_json = options;
  with_json.push_back("--json");
  const CommandResult r =
      run_infinigen(job(dir.path() / "in.jsonl", dir.path() / "out.jsonl", with_json));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  // The n samples of a prompt (and prompts that begin alike) share their whole KV blocks.
  EXPECT_GT(json::parse(r.out)["shared_prefix_tokens"].get<int64_t>(), 1000) << r.out;
  const std::string output = read_file(dir.path() / "out.jsonl");
  const std::vector<std::string> lines = lines_of(output);
  ASSERT_EQ(lines.size(), 240u);
  const std::map<std::string, json> together = bodies(output);

  const std::vector<std::string> inputs = lines_of(requests);
  int stopped = 0, multi = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    const fs::path one = dir.path() / ("one-" + std::to_string(i));
    write_file(one.string() + ".jsonl", inputs[i] + "\n");
    const CommandResult alone =
        run_infinigen(job(one.string() + ".jsonl", one.string() + ".out", options));
    ASSERT_EQ(alone.exit_code, 0) << alone.err;
    const std::map<std::string, json> single = bodies(read_file(one.string() + ".out"));
    ASSERT_EQ(single.size(), 1u);
    const std::string id = single.begin()->first;
    EXPECT_EQ(together.at(id)["choices"], single.at(id)["choices"]) << inputs[i];
    EXPECT_EQ(together.at(id)["usage"], single.at(id)["usage"]) << inputs[i];
    // Each choice stops at its request's max_tokens, or before a stop string, which is cut off.
    const json request = json::parse(inputs[i]);
    const json& body = request.contains("body") ? request["body"] : request;
    const json& choices = single.at(id)["choices"];
    EXPECT_LE(single.at(id)["usage"]["completion_tokens"].get<int64_t>(),
              body["max_tokens"].get<int64_t>() * std::ssize(choices))
        << inputs[i];
    for (const json& choice : choices) {
      if (choice["finish_reason"] != "stop" || !body.contains("stop")) continue;
      ++stopped;
      for (const std::string stop : {" the", "open"}) {
        EXPECT_EQ(choice["text"].get<std::string>().find(stop), std::string::npos) << inputs[i];
      }
    }
    multi += choices.size() > 1;
  }
  EXPECT_GT(stopped, 0);  // the stop strings were exercised
  EXPECT_GT(multi, 50);
  // Lines in input order, whatever the batches.
  for (size_t i = 0; i < lines.size(); ++i) {
    EXPECT_EQ(json::parse(lines[i])["custom_id"], "req-" + std::to_string(i));
  }
  // Arrival order groups other requests together: the same bytes.
  const CommandResult arrival =
      run_infinigen(job(dir.path() / "in.jsonl", dir.path() / "arrival.jsonl",
                        {"--policy", "full", "--kv-block-tokens", "4", "--order", "arrival"}));
  ASSERT_EQ(arrival.exit_code, 0) << arrival.err;
  EXPECT_EQ(read_file(dir.path() / "arrival.jsonl"), output);
}

// logprobs: each choice's tokens with their log-probabilities and the k most likely at each
// position (the chosen token among them: greedy, it is the first), the generated text unchanged;
// logprobs 0 lists the chosen token alone.
TEST(BatchJob, LogprobsGiveEachTokenAndTheMostLikelyOnes) {
  TempDir dir("batch-logprobs");
  std::string with, without;
  const std::vector<int> cases = {3, 0, 5, 1, -1};  // logprobs; -1: none
  for (size_t i = 0; i < cases.size(); ++i) {
    const int k = cases[i];
    json line = {{"custom_id", cat("r", i)},
                 {"prompt", "the LORD said unto them and the file reads"},
                 {"max_tokens", 6 + static_cast<int>(i)},
                 {"temperature", 0}};
    without += line.dump() + "\n";
    if (k >= 0) line["logprobs"] = k;
    with += line.dump() + "\n";
  }
  write_file(dir.path() / "with.jsonl", with);
  write_file(dir.path() / "without.jsonl", without);
  for (const char* name : {"with", "without"}) {
    const fs::path in = dir.path() / (std::string(name) + ".jsonl");
    const CommandResult r = run_infinigen(job(in, dir.path() / (std::string(name) + ".out")));
    ASSERT_EQ(r.exit_code, 0) << r.err;
  }
  // Read keeping each object's order (top_logprobs: most likely first).
  std::map<std::string, nlohmann::ordered_json> scored;
  for (const std::string& text : lines_of(read_file(dir.path() / "with.out"))) {
    const auto line = nlohmann::ordered_json::parse(text);
    scored[line["custom_id"]] = line["response"]["body"];
  }
  const std::map<std::string, json> plain = bodies(read_file(dir.path() / "without.out"));
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string id = cat("r", i);
    const auto& choice = scored.at(id)["choices"][0];
    EXPECT_EQ(choice["text"].get<std::string>(), plain.at(id)["choices"][0]["text"]) << id;
    const int k = cases[i];
    if (k < 0) {
      EXPECT_TRUE(choice["logprobs"].is_null()) << id;
      continue;
    }
    const auto& lp = choice["logprobs"];
    const size_t count = lp["tokens"].size();
    ASSERT_GT(count, 0u) << id;
    ASSERT_EQ(lp["token_logprobs"].size(), count);
    ASSERT_EQ(lp["top_logprobs"].size(), count);
    ASSERT_EQ(lp["text_offset"].size(), count);
    const std::string text = choice["text"];
    EXPECT_EQ(lp["text_offset"][0], 0) << id;
    for (size_t t = 0; t < count; ++t) {
      // Offsets within the text, in order; each token's text where its offset says.
      const int64_t offset = lp["text_offset"][t];
      EXPECT_LT(offset, std::ssize(text)) << id;
      if (t > 0) {
        EXPECT_GE(offset, lp["text_offset"][t - 1].get<int64_t>()) << id;
      }
      const std::string token = lp["tokens"][t];
      EXPECT_EQ(text.compare(offset, token.size(), token), 0) << id << " token " << t;
      const double chosen = lp["token_logprobs"][t];
      const auto& top = lp["top_logprobs"][t];
      ASSERT_EQ(top.size(), static_cast<size_t>(std::max(k, 1))) << id << " token " << t;
      // Greedy: the chosen token is the most likely, listed first; the rest below it, and
      // together no more than all the mass.
      double mass = 0, previous = 0;
      bool first = true;
      for (const auto& [alternative, log_prob] : top.items()) {
        const double value = log_prob.get<double>();
        EXPECT_LE(value, 0.0);
        if (first) {
          EXPECT_EQ(alternative, token) << id << " token " << t;
          EXPECT_DOUBLE_EQ(value, chosen);
        } else {
          EXPECT_LE(value, previous + 1e-12);
        }
        first = false;
        previous = value;
        mass += std::exp(value);
      }
      EXPECT_LE(mass, 1.0 + 1e-9);
    }
  }
}

// A stop string cuts the logprobs where it cuts the text: the tokens that begin before the cut,
// with the log-probabilities of the uncut run (the built-in model: opt-tiny repeats one token).
TEST(BatchJob, AStopStringCutsTheLogprobsWithTheText) {
  TempDir dir("batch-logprobs-stop");
  const auto run_one = [&](const json& request, const std::string& name) {
    write_file(dir.path() / (name + ".jsonl"), request.dump() + "\n");
    const CommandResult r = run_infinigen({"batch", "--model", "builtin", "--input",
                                           (dir.path() / (name + ".jsonl")).string(), "--output",
                                           (dir.path() / (name + ".out")).string()});
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return bodies(read_file(dir.path() / (name + ".out"))).at("s")["choices"][0];
  };
  json request = {{"custom_id", "s"},
                  {"prompt", "In the beginning God created the heaven and the earth. And"},
                  {"max_tokens", 12},
                  {"temperature", 0},
                  {"logprobs", 1}};
  const json whole = run_one(request, "whole");
  const std::string text = whole["text"];
  const json& offsets = whole["logprobs"]["text_offset"];
  ASSERT_GE(offsets.size(), 4u);
  // Three characters from inside the third token: the cut falls within a token.
  const std::string stop = text.substr(offsets[2].get<size_t>() + 1, 3);
  ASSERT_EQ(stop.size(), 3u) << text;
  request["stop"] = stop;
  const json cut = run_one(request, "cut");
  const std::string kept = text.substr(0, text.find(stop));
  EXPECT_EQ(cut["text"], kept);
  EXPECT_EQ(cut["finish_reason"], "stop");
  size_t count = 0;
  while (count < offsets.size() && offsets[count].get<size_t>() < kept.size()) ++count;
  ASSERT_GT(count, 0u);
  EXPECT_EQ(cut["logprobs"]["tokens"].size(), count);
  for (size_t t = 0; t < count; ++t) {
    EXPECT_EQ(cut["logprobs"]["tokens"][t], whole["logprobs"]["tokens"][t]);
    EXPECT_EQ(cut["logprobs"]["token_logprobs"][t], whole["logprobs"]["token_logprobs"][t]);
    EXPECT_EQ(cut["logprobs"]["text_offset"][t], offsets[t]);
  }
}

// The default policy (InfiniGen): two shards at once, from --shard and from a Slurm array's
// environment; the last to finish merges, and so does --merge; byte for byte the one-shard file.
TEST(BatchJob, ShardsRunAtOnceMergeToTheOneShardOutput) {
  TempDir dir("batch-shards");
  write_file(dir.path() / "in.jsonl", mixed_requests(80, 11, true) + "{broken\n");
  const fs::path in = dir.path() / "in.jsonl";
  const CommandResult whole = run_infinigen(job(in, dir.path() / "one.jsonl"));
  ASSERT_EQ(whole.exit_code, 0) << whole.err;
  const std::string expected = read_file(dir.path() / "one.jsonl");
  ASSERT_EQ(lines_of(expected).size(), 81u);

  MeasuredCommand first, second;
  std::thread a([&] {
    first = run_infinigen_measured(job(in, dir.path() / "two.jsonl", {"--shard", "0/2"}));
  });
  std::thread b([&] {
    second = run_infinigen_measured(job(in, dir.path() / "two.jsonl"),
                                    testing_util::ChildOptions()
                                        .with_env("SLURM_ARRAY_TASK_ID=1")
                                        .with_env("SLURM_ARRAY_TASK_COUNT=2"));
  });
  a.join();
  b.join();
  ASSERT_EQ(first.exit_code, 0) << first.err;
  ASSERT_EQ(second.exit_code, 0) << second.err;
  EXPECT_EQ(read_file(dir.path() / "two.jsonl"), expected);
  EXPECT_NE(read_file(dir.path() / "two.jsonl.shard-0-of-2"), "");
  EXPECT_NE(read_file(dir.path() / "two.jsonl.shard-1-of-2"), "");

  fs::remove(dir.path() / "two.jsonl");
  const CommandResult merged = run_infinigen({"batch", "--merge", "--input", in.string(),
                                              "--output", (dir.path() / "two.jsonl").string()});
  ASSERT_EQ(merged.exit_code, 0) << merged.err;
  EXPECT_EQ(read_file(dir.path() / "two.jsonl"), expected);

  // Shards that ran with other options: --merge refuses.
  const fs::path key = dir.path() / "two.jsonl.shard-1-of-2.job.json";
  const std::string key_text = read_file(key);
  write_file(key, key_text + " ");
  expect_one_line_error(
      {"batch", "--merge", "--input", in.string(), "--output", (dir.path() / "two.jsonl").string()},
      {"the shards ran with different options"});
  write_file(key, key_text);
  // A shard that has not finished: --merge refuses, naming it.
  fs::remove(dir.path() / "two.jsonl.shard-1-of-2.done");
  expect_one_line_error(
      {"batch", "--merge", "--input", in.string(), "--output", (dir.path() / "two.jsonl").string()},
      {"shard 1 of 2 has not finished"});
}

// Polls until `path` holds at least one whole line (false after `timeout_s` or when `command`
// exits first).
bool wait_for_a_line(const fs::path& path, BackgroundInfinigen& command, double timeout_s) {
  const auto start = std::chrono::steady_clock::now();
  while (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() <
         timeout_s) {
    if (read_file(path).find('\n') != std::string::npos) return true;
    if (!command.running()) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return false;
}

// SIGKILL after the first batch is written (plus a line cut short, as a kill in the middle of a
// write would leave), and SIGINT: the same command resumes, and the output is the uninterrupted
// job's, byte for byte.
TEST(BatchJob, KilledOrInterruptedJobResumesToTheSameOutput) {
  TempDir dir("batch-kill");
  const fs::path in = dir.path() / "in.jsonl";
  write_file(in, mixed_requests(48, 5, true));
  // A slow emulated link, so that the job runs long enough to be stopped in the middle.
  const std::vector<std::string> slow = {"--batch", "4", "--emulate-link-latency-us", "2000"};
  const CommandResult whole = run_infinigen(job(in, dir.path() / "whole.jsonl", slow));
  ASSERT_EQ(whole.exit_code, 0) << whole.err;
  const std::string expected = read_file(dir.path() / "whole.jsonl");

  for (const int signal : {SIGKILL, SIGINT}) {
    const fs::path out = dir.path() / (signal == SIGKILL ? "killed.jsonl" : "interrupted.jsonl");
    {
      BackgroundInfinigen command(job(in, out, slow));
      ASSERT_TRUE(wait_for_a_line(out, command, 30.0)) << "the job wrote nothing or ended";
      ASSERT_TRUE(command.running()) << "the job finished before it could be stopped";
      double seconds = 0;
      const CommandResult stopped = command.signal_and_wait(signal, 30.0, &seconds);
      if (signal == SIGINT) {
        EXPECT_EQ(stopped.exit_code, 130) << stopped.err;
        EXPECT_NE(stopped.err.find("the same command resumes the job"), std::string::npos)
            << stopped.err;
      }
    }
    std::string partial = read_file(out);
    ASSERT_FALSE(partial.empty());
    EXPECT_EQ(partial.back(), '\n');  // whole lines only
    EXPECT_LT(lines_of(partial).size(), 48u);
    if (signal == SIGKILL) write_file(out, partial + R"({"id":"batch_req_9","custom_id":"req-)");
    const CommandResult resumed = run_infinigen(job(in, out, slow));
    ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
    if (signal == SIGKILL) {
      EXPECT_NE(resumed.err.find("cut short"), std::string::npos) << resumed.err;
    }
    EXPECT_EQ(read_file(out), expected) << (signal == SIGKILL ? "SIGKILL" : "SIGINT");
  }
  // Resuming with other options is refused, naming them.
  expect_one_line_error(
      job(in, dir.path() / "killed.jsonl", {"--seed", "3", "--policy", "full", "--batch", "8"}),
      {"killed.jsonl was started with", "--seed 0", "--batch 4", "--policy infinigen", "--seed 3",
       "--batch 8", "--policy full"});
  expect_one_line_error(job(in, in), {"is the --input file"});
}

// Requests that cannot run each get an error line with their line number; the others run; the
// job succeeds.
TEST(BatchJob, BadRequestsGetErrorLinesAndTheJobGoesOn) {
  TempDir dir("batch-errors");
  const fs::path in = dir.path() / "in.jsonl";
  write_file(in,
             "{\"custom_id\": \"ok\", \"prompt\": \"hello\", \"max_tokens\": 3}\n"
             "{oops\n"
             "\n"
             "{\"custom_id\": \"chat\", \"method\": \"POST\", \"url\": \"/v1/chat/completions\", "
             "\"body\": {\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}}\n"
             "{\"custom_id\": \"long\", \"prompt\": \"hello\", \"max_tokens\": 300}\n"
             "{\"custom_id\": \"vocab\", \"prompt\": [1, 99999]}\n"
             "{\"custom_id\": \"many\", \"prompt\": \"hello\", \"n\": 9}\n"
             "{\"custom_id\": \"odd\", \"prompt\": \"hello\", \"temperature\": \"hot\"}\n"
             "{\"custom_id\": \"ok2\", \"prompt\": [5, 6, 7], \"max_tokens\": 2}\n");
  const CommandResult r = run_infinigen(job(in, dir.path() / "out.jsonl", {"--json"}));
  ASSERT_EQ(r.exit_code, 0) << r.err;
  const json summary = json::parse(r.out);
  EXPECT_EQ(summary["completed"], 2);
  EXPECT_EQ(summary["errors"], 6);
  const std::vector<std::string> lines = lines_of(read_file(dir.path() / "out.jsonl"));
  ASSERT_EQ(lines.size(), 8u);
  const std::vector<std::tuple<std::string, int, std::string, std::string>> errors = {
      {"", 2, "invalid_json", "not JSON"},
      {"chat", 4, "unsupported_endpoint", "chat requests"},
      {"long", 5, "invalid_request", "exceed the model's context of 256"},
      {"vocab", 6, "invalid_request", "outside the model's vocabulary"},
      {"many", 7, "invalid_request", "more than a batch (--batch 8)"},
      {"odd", 8, "invalid_request", "temperature must be"}};
  for (size_t i = 0; i < errors.size(); ++i) {
    const auto& [id, line, code, fragment] = errors[i];
    const json j = json::parse(lines[i + 1]);
    EXPECT_TRUE(j["response"].is_null()) << lines[i + 1];
    EXPECT_EQ(j["custom_id"], id.empty() ? json(nullptr) : json(id)) << lines[i + 1];
    EXPECT_EQ(j["error"]["line"], line) << lines[i + 1];
    EXPECT_EQ(j["error"]["code"], code) << lines[i + 1];
    const std::string message = j["error"]["message"];
    EXPECT_EQ(message.rfind("line " + std::to_string(line) + ": ", 0), 0u) << message;
    EXPECT_NE(message.find(fragment), std::string::npos) << message;
  }
  for (const size_t i : {size_t{0}, size_t{7}}) {
    const json j = json::parse(lines[i]);
    EXPECT_EQ(j["response"]["status_code"], 200);
    EXPECT_EQ(j["response"]["body"]["object"], "text_completion");
    EXPECT_FALSE(j["response"]["body"]["choices"][0]["text"].get<std::string>().empty());
    EXPECT_GT(j["response"]["body"]["usage"]["total_tokens"], 0);
  }
  // A rerun finds everything done, the error lines included.
  const CommandResult again = run_infinigen(job(in, dir.path() / "out.jsonl", {"--json"}));
  ASSERT_EQ(again.exit_code, 0) << again.err;
  EXPECT_EQ(json::parse(again.out)["already_done"], 8);
}

TEST(BatchJob, DuplicateIdsAreRefusedUpFront) {
  TempDir dir("batch-duplicates");
  const fs::path in = dir.path() / "in.jsonl";
  write_file(
      in,
      "{\"custom_id\": \"a\", \"prompt\": \"x\"}\n{\"custom_id\": \"b\", \"prompt\": \"x\"}\n"
      "{\"custom_id\": \"a\", \"prompt\": \"y\"}\n{\"custom_id\": \"b\", \"prompt\": \"y\"}\n"
      "{\"custom_id\": \"a\", \"prompt\": \"z\"}\n");
  expect_one_line_error(
      job(in, dir.path() / "out.jsonl"),
      {"2 custom_ids appear more than once", "'a' on lines 1, 3, 5", "'b' on lines 2, 4"});
  EXPECT_FALSE(fs::exists(dir.path() / "out.jsonl"));
}

}  // namespace
}  // namespace infinigen
