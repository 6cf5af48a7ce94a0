// tests: `infinigen batch` requests that continue sessions, through the binary on opt-tiny
// (docs/batch.md, "Sessions"): a multi-turn job over several sessions gives the completions of the
// same turns run one by one with `run --session/--resume`, whatever the host-memory tier holds;
// a hot turn reads nothing from the disk; a job whose last line was lost after its turn committed
// writes the same output again without running the turn twice; bad inputs end with one line.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "offload/session_tier.h"
#include "tests/test_util.h"

namespace infinigen {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using testing_util::expect_one_line_error;
using testing_util::run_infinigen;
using testing_util::TempDir;

const std::string kTiny = std::string(INFINIGEN_FIXTURES_DIR) + "/opt-tiny";
const std::string kLlama = std::string(INFINIGEN_FIXTURES_DIR) + "/llama-tiny";

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

// Three sessions of 3 to 4 turns, interleaved, with a request of no session among them.
struct Turn {
  std::string id, session, prompt;
  int max_tokens;
};
const std::vector<Turn> kTurns = {
    {"a1", "a", "And the LORD said unto Moses", 6}, {"b1", "b", "To open a file in Python", 5},
    {"c1", "c", "In the beginning God created", 7}, {"a2", "a", " and Aaron went in", 4},
    {"x", "", "heaven and earth", 4},               {"b2", "b", " you call open", 6},
    {"a3", "a", " unto Pharaoh", 5},                {"c2", "c", " the heaven and", 3},
    {"b3", "b", " with a name", 4},                 {"a4", "a", " and said", 6},
    {"c3", "c", " the earth", 5}};

std::string job_text() {
  std::string text;
  std::map<std::string, bool> started;
  for (const Turn& t : kTurns) {
    json line = {{"custom_id", t.id}, {"prompt", t.prompt}, {"max_tokens", t.max_tokens}};
    if (!t.session.empty()) {
      line["session"] = t.session;
      if (!started[t.session]) line["session_new"] = true;
      started[t.session] = true;
    }
    text += line.dump() + "\n";
  }
  return text;
}

// custom_id -> completion text.
std::map<std::string, std::string> completions(const std::string& output) {
  std::map<std::string, std::string> texts;
  std::istringstream in(output);
  for (std::string line; std::getline(in, line);) {
    const json j = json::parse(line);
    EXPECT_TRUE(j["error"].is_null()) << line;
    texts[j["custom_id"]] = j["response"]["body"]["choices"][0]["text"];
  }
  return texts;
}

// `infinigen batch` on opt-tiny of dir/job.jsonl into dir/`output`, greedy, its sessions under
// `roots`, with `more` options.
std::vector<std::string> batch_args(const TempDir& dir, const std::string& output,
                                    const std::string& roots, std::vector<std::string> more = {}) {
  std::vector<std::string> args = {"batch",
                                   "--model",
                                   kTiny,
                                   "--input",
                                   (dir.path() / "job.jsonl").string(),
                                   "--output",
                                   (dir.path() / output).string(),
                                   "--temperature",
                                   "0",
                                   "--session-root",
                                   roots};
  args.insert(args.end(), more.begin(), more.end());
  return args;
}

json run_job(const TempDir& dir, const std::string& output, const std::string& cache,
             const std::string& roots, std::vector<std::string> more = {}) {
  more.insert(more.end(), {"--session-cache", cache, "--json"});
  const testing_util::CommandResult result = run_infinigen(batch_args(dir, output, roots, more));
  EXPECT_EQ(result.exit_code, 0) << result.err;
  return json::parse(result.out);
}

// The same turns, one `run` each: --session for a session's first, --resume for the others; with
// `more` options.
std::map<std::string, std::string> run_one_by_one(const TempDir& dir,
                                                  const std::vector<std::string>& more = {}) {
  std::map<std::string, std::string> texts;
  std::map<std::string, bool> started;
  for (const Turn& t : kTurns) {
    std::vector<std::string> args = {"run",    "--model",    kTiny,
                                     "--json", "--gen-len",  std::to_string(t.max_tokens),
                                     "--temperature", "0", "--prompt", t.prompt};
    args.insert(args.end(), more.begin(), more.end());
    if (!t.session.empty()) {
      args.push_back(started[t.session] ? "--resume" : "--session");
      args.push_back((dir.path() / ("run-" + t.session)).string());
      started[t.session] = true;
    }
    const testing_util::CommandResult result = run_infinigen(args);
    EXPECT_EQ(result.exit_code, 0) << result.err;
    texts[t.id] = json::parse(result.out)["outputs"][0]["text"];
  }
  return texts;
}

TEST(BatchSessions, TurnsEqualRunResumeWithAndWithoutTheTier) {
  TempDir dir("batch-sessions");
  std::ofstream(dir.path() / "job.jsonl") << job_text();
  const std::map<std::string, std::string> expected = run_one_by_one(dir);
  ASSERT_EQ(expected.size(), kTurns.size());
  // No tier, one smaller than any session (each bypasses it), two that hold everything, and one
  // that holds about one session (evicting by look-ahead, prefetching the next turn's session).
  int index = 0;
  for (const std::string cache : {"0", "1K", "64M", "2%", "20K"}) {
    const std::string roots = (dir.path() / ("roots-" + std::to_string(index))).string();
    fs::create_directories(roots);
    const std::string output = "out-" + std::to_string(index++) + ".jsonl";
    const json summary = run_job(dir, output, cache, roots);
    EXPECT_EQ(completions(read_file(dir.path() / output)), expected) << cache;
    const json& s = summary["sessions"];
    EXPECT_EQ(s["turns"], 10);
    EXPECT_EQ(s["first_turns"], 3);
    EXPECT_LE(s["tier_peak_bytes"].get<uint64_t>(), *parse_session_cache(cache));
    EXPECT_EQ(s["hot_turns"].get<int>() + s["cold_turns"].get<int>(), 7);
    if (cache == "0" || cache == "1K") {
      EXPECT_EQ(s["hot_turns"], 0);
      EXPECT_EQ(s["cold_turns"], 7);
      EXPECT_GT(s["cold_bytes"].get<uint64_t>(), 0u);
      EXPECT_EQ(s["tier_bypassed"], 10);
    }
    if (cache == "64M" || cache == "2%") {
      // Every continued turn hot: its history from memory, nothing read from the disk.
      EXPECT_EQ(s["hot_turns"], 7);
      EXPECT_EQ(s["cold_turns"], 0);
      EXPECT_EQ(s["cold_bytes"], 0);
      EXPECT_EQ(s["prefetch_bytes"], 0);
      EXPECT_GT(s["hot_bytes"].get<uint64_t>(), 0u);
      EXPECT_EQ(s["tier_evictions"], 0);
    }
    if (cache == "20K") {
      EXPECT_GT(s["tier_evictions"].get<int>(), 0);
      EXPECT_GT(s["tier_prefetched"].get<int>(), 0);
    }
  }
}

// Sessions saved as their store's state (replaced at every turn's end): H2O's, and a capped
// InfiniGen pool's. Through a job the turns equal `run --resume` one by one, with every session
// cold, or every continued turn hot (its state from the tier, nothing read from the disk).
TEST(BatchSessions, StateSessionsEqualRunResumeColdAndHot) {
  for (const std::vector<std::string>& policy :
       {std::vector<std::string>{"--policy", "h2o", "--h2o-budget", "0.5"},
        std::vector<std::string>{"--policy", "infinigen", "--kv-pool-limit", "0.5"}}) {
    TempDir dir("batch-sessions-state");
    std::ofstream(dir.path() / "job.jsonl") << job_text();
    const std::map<std::string, std::string> expected = run_one_by_one(dir, policy);
    ASSERT_EQ(expected.size(), kTurns.size());
    for (const std::string cache : {"0", "64M"}) {
      const std::string roots = (dir.path() / ("roots-" + cache)).string();
      fs::create_directories(roots);
      const std::string output = "out-" + cache + ".jsonl";
      const json summary = run_job(dir, output, cache, roots, policy);
      EXPECT_EQ(completions(read_file(dir.path() / output)), expected)
          << policy[1] << ", " << cache;
      const json& s = summary["sessions"];
      EXPECT_EQ(s["turns"], 10);
      EXPECT_EQ(s["hot_turns"], cache == "0" ? 0 : 7);
      EXPECT_EQ(s["cold_bytes"].get<uint64_t>() > 0, cache == "0");
      // Each session's directory holds the last turn's state alone.
      for (const std::string session : {"a", "b", "c"}) {
        int64_t segments = 0;
        for (const auto& entry : fs::directory_iterator(fs::path(roots) / session)) {
          segments += entry.is_directory() ? 1 : 0;
        }
        EXPECT_EQ(segments, 1) << policy[1] << ", " << session;
      }
    }
  }
}

// A run killed after a turn's manifest committed and before its line was written: the rerun finds
// the line in the session and writes it, without running the turn again (which would continue
// the conversation twice).
TEST(BatchSessions, ALineLostAfterItsTurnCommittedIsFoundInTheSession) {
  TempDir dir("batch-sessions-lost");
  std::ofstream(dir.path() / "job.jsonl") << job_text();
  const std::string roots = (dir.path() / "roots").string();
  fs::create_directories(roots);
  run_job(dir, "out.jsonl", "64M", roots);
  const std::string whole = read_file(dir.path() / "out.jsonl");
  // The last turn's line (c3, the last session turn run) is lost: the state a kill between the
  // commit and the append leaves.
  const std::string cut = whole.substr(0, whole.rfind('\n', whole.size() - 2) + 1);
  ASSERT_NE(cut, whole);
  std::ofstream(dir.path() / "out.jsonl", std::ios::trunc) << cut;
  const json summary = run_job(dir, "out.jsonl", "64M", roots);
  EXPECT_EQ(read_file(dir.path() / "out.jsonl"), whole);
  EXPECT_EQ(summary["sessions"]["recovered_lines"], 1);
  EXPECT_EQ(summary["sessions"]["turns"], 0);
}

// kill -9 at random moments of a longer job (3 sessions of 10 turns: each compacts its 18
// segments on the save of its ninth turn, kSessionCompactAfter), then the same command until it
// finishes: the output is the uninterrupted job's, byte for byte, whatever the moment (before a
// turn's commit, between it and its line, during the line's write, in a compaction).
TEST(BatchSessions, KilledAtRandomMomentsTheResumedJobLosesNothing) {
  TempDir dir("batch-sessions-killed");
  std::string text;
  std::mt19937 rng(41);
  static const char* const kWords[] = {"the", "LORD", "said", "file", "open", "unto", "heaven"};
  for (int turn = 0; turn < 10; ++turn) {
    for (const std::string name : {"p", "q", "r"}) {
      std::string prompt;
      for (int w = 0; w < 3 + static_cast<int>(rng() % 6); ++w) {
        prompt += ' ';
        prompt += kWords[rng() % 7];
      }
      json line = {{"custom_id", name + std::to_string(turn)},
                   {"prompt", prompt},
                   {"max_tokens", 12},
                   {"session", name}};
      if (turn == 0) line["session_new"] = true;
      text += line.dump() + "\n";
    }
  }
  std::ofstream(dir.path() / "job.jsonl") << text;
  const auto args = [&](const std::string& output, const std::string& roots) {
    return batch_args(dir, output, roots, {"--session-cache", "20K"});
  };
  const std::string whole_roots = (dir.path() / "whole").string();
  fs::create_directories(whole_roots);
  ASSERT_EQ(run_infinigen(args("whole.jsonl", whole_roots)).exit_code, 0);
  const std::string expected = read_file(dir.path() / "whole.jsonl");
  // Compacted at the ninth turn (18 segments into 1), then the tenth turn's 2.
  EXPECT_EQ(
      json::parse(read_file(fs::path(whole_roots) / "p" / "manifest.json"))["segments"].size(), 3u);

  const std::string roots = (dir.path() / "killed").string();
  fs::create_directories(roots);
  int kills = 0;
  for (int attempt = 0; attempt < 40; ++attempt) {
    testing_util::BackgroundInfinigen command(args("killed.jsonl", roots));
    std::this_thread::sleep_for(std::chrono::milliseconds(5 + rng() % 120));
    if (!command.running()) break;  // finished before the kill
    double seconds = 0;
    command.signal_and_wait(SIGKILL, 30.0, &seconds);
    ++kills;
  }
  EXPECT_GT(kills, 0);
  const testing_util::CommandResult last = run_infinigen(args("killed.jsonl", roots));
  ASSERT_EQ(last.exit_code, 0) << last.err;
  EXPECT_EQ(read_file(dir.path() / "killed.jsonl"), expected) << kills << " kills";
}

// A job line of session `session`'s turn `id` (its first when `first`).
std::string turn_line(const std::string& id, const json& prompt, int max_tokens,
                      const std::string& session, bool first = false) {
  json line = {
      {"custom_id", id}, {"prompt", prompt}, {"max_tokens", max_tokens}, {"session", session}};
  if (first) line["session_new"] = true;
  return line.dump() + "\n";
}

// Token ids 10, 11, ..., as a prompt of n tokens.
json token_ids(int n) {
  json prompt = json::array();
  for (int i = 0; i < n; ++i) prompt.push_back(10 + i);
  return prompt;
}

// A turn that cannot run (its conversation would outgrow the context) gets an error line, its
// session stays as it was and its later turns get error lines naming it; another session's turns
// and the job go on.
TEST(BatchSessions, ATurnThatCannotRunFailsItsSessionsLaterTurnsOnly) {
  TempDir dir("batch-sessions-failed-turn");
  const std::string text = turn_line("l1", token_ids(100), 50, "long", true) +
                           turn_line("s1", "In the beginning", 4, "short", true) +
                           turn_line("l2", token_ids(100), 50, "long") +
                           turn_line("l3", token_ids(2), 2, "long") +
                           turn_line("s2", " and the earth", 4, "short");
  std::ofstream(dir.path() / "job.jsonl") << text;
  const std::string roots = (dir.path() / "roots").string();
  fs::create_directories(roots);
  const testing_util::CommandResult result =
      run_infinigen(batch_args(dir, "out.jsonl", roots, {"--json"}));
  ASSERT_EQ(result.exit_code, 0) << result.err;
  std::map<std::string, json> lines;
  std::istringstream in(read_file(dir.path() / "out.jsonl"));
  for (std::string line; std::getline(in, line);) {
    const json j = json::parse(line);
    lines[j["custom_id"]] = j;
  }
  ASSERT_EQ(lines.size(), 5u);
  for (const char* ok : {"l1", "s1", "s2"}) EXPECT_TRUE(lines[ok]["error"].is_null()) << ok;
  EXPECT_NE(lines["l2"]["error"]["message"].get<std::string>().find("context"), std::string::npos)
      << lines["l2"];
  EXPECT_NE(lines["l3"]["error"]["message"].get<std::string>().find("line 3"), std::string::npos)
      << lines["l3"];
  // The session holds its first turn only: 100 prompt tokens and 50 generated.
  const json manifest = json::parse(read_file(fs::path(roots) / "long" / "manifest.json"));
  EXPECT_EQ(manifest["sequences"][0].size(), 150u);
  EXPECT_EQ(manifest["turn"]["label"], "l1");
  const json summary = json::parse(result.out);
  EXPECT_EQ(summary["completed"], 3);
  EXPECT_EQ(summary["errors"], 2);
}

// With --overflow drop-oldest, the same job on a rotary model (llama-tiny, a context of 256 as
// opt-tiny's) runs every turn: the second drops the 44 oldest tokens after the kept 4, the third 4
// more, and the session then holds exactly the context.
TEST(BatchSessions, TurnsPastTheContextDropTheOldestWithOverflow) {
  TempDir dir("batch-sessions-overflow");
  const std::string text = turn_line("l1", token_ids(100), 50, "long", true) +
                           turn_line("l2", token_ids(100), 50, "long") +
                           turn_line("l3", token_ids(2), 2, "long");
  std::ofstream(dir.path() / "job.jsonl") << text;
  const std::string roots = (dir.path() / "roots").string();
  fs::create_directories(roots);
  std::vector<std::string> args =
      batch_args(dir, "out.jsonl", roots, {"--json", "--overflow", "drop-oldest"});
  *std::find(args.begin(), args.end(), kTiny) = kLlama;
  const testing_util::CommandResult result = run_infinigen(args);
  ASSERT_EQ(result.exit_code, 0) << result.err;
  std::istringstream in(read_file(dir.path() / "out.jsonl"));
  int64_t lines = 0;
  for (std::string line; std::getline(in, line); ++lines) {
    EXPECT_TRUE(json::parse(line)["error"].is_null()) << line;
  }
  EXPECT_EQ(lines, 3);
  const json manifest = json::parse(read_file(fs::path(roots) / "long" / "manifest.json"));
  EXPECT_EQ(manifest["sequences"][0].size(), 256u);
  EXPECT_EQ(manifest["turn"]["label"], "l3");
  // The kept prefix is the first turn's first 4 tokens; then what the third turn kept of the
  // second's prompt.
  EXPECT_EQ(manifest["sequences"][0][0], 10);
  EXPECT_EQ(manifest["sequences"][0][3], 13);
  EXPECT_EQ(json::parse(result.out)["completed"], 3);
}

TEST(BatchSessions, BadInputsEndWithOneLine) {
  TempDir dir("batch-sessions-bad");
  const std::string roots = (dir.path() / "roots").string();
  fs::create_directories(roots);
  const auto job = [&](const std::string& text) {
    std::ofstream(dir.path() / "job.jsonl", std::ios::trunc) << text;
    return batch_args(dir, "out.jsonl", roots);
  };
  // A session no request starts and no directory holds.
  expect_one_line_error(job(R"({"custom_id": "q", "prompt": "x", "session": "nobody"})"
                            "\n"),
                        {"line 1", "unknown session 'nobody'"});
  // A bad --session-cache.
  std::vector<std::string> args =
      job(R"({"custom_id": "q", "prompt": "x", "session": "s", "session_new": true})"
          "\n");
  args.insert(args.end(), {"--session-cache", "lots"});
  expect_one_line_error(args, {"--session-cache", "lots"});
  // A session saved with another model.
  ASSERT_EQ(run_infinigen({"run", "--model", kLlama, "--prompt-len", "4", "--gen-len", "2",
                           "--session", roots + "/llama"})
                .exit_code,
            0);
  expect_one_line_error(job(R"({"custom_id": "q", "prompt": "x", "session": "llama"})"
                            "\n"),
                        {"saved with another model"});
  // A name that is not one under the root.
  expect_one_line_error(job(R"({"custom_id": "q", "prompt": "x", "session": "../up"})"
                            "\n"),
                        {"not a plain name"});
  // session_new for a session an earlier line started.
  expect_one_line_error(
      job(R"({"custom_id": "q", "prompt": "x", "session": "s", "session_new": true})"
          "\n"
          R"({"custom_id": "r", "prompt": "y", "session": "s", "session_new": true})"
          "\n"),
      {"line 2", "session_new"});
}

}  // namespace
}  // namespace infinigen
