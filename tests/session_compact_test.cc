// tests: compaction of a session's segments (offload/session_compact.h): on save past the count
// and by `infinigen session compact DIR`, a compacted session resumes to exactly the tokens and
// logits of the uncompacted one, a kill at any step leaves a whole session, and what is not a
// session, or is damaged, is refused with one line.
#include "offload/session_compact.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "core/model_loader.h"
#include "offload/runtime.h"
#include "offload/session.h"
#include "tests/session_test_util.h"
#include "tests/test_util.h"

namespace infinigen {
namespace {

namespace fs = std::filesystem;
using testing_util::read_bytes;
using testing_util::session_model;
using testing_util::TempDir;
using testing_util::write_bytes;

OffloadOptions options_for(const std::string& policy) {
  OffloadOptions options = testing_util::session_options(policy);
  options.kv_block_tokens = 4;  // a first turn's 9 common tokens share two blocks
  return options;
}

// Turn `turn`'s prompts: lengths differ per sequence and per turn; the first turn's share 9
// tokens when `shared`.
std::vector<std::vector<int32_t>> turn_prompts(int turn, bool shared) {
  if (turn == 1 && shared) {
    return {{2, 20, 21, 22, 23, 24, 25, 26, 27, 10, 11},
            {2, 20, 21, 22, 23, 24, 25, 26, 27, 500, 600, 700, 800},
            {2, 20, 21, 22, 23, 24, 25, 26, 27, 7}};
  }
  if (turn == 1) return {{2, 10, 11, 12}, {2, 500, 600, 700, 800, 900}, {2, 7}};
  const int32_t t = 30 + 10 * turn;
  if (turn % 2 == 0) return {{t, t + 1}, {t + 2, t + 3, t + 4}, {t + 5}};
  return {{t}, {t + 1, t + 2}, {t + 3, t + 4, t + 5, t + 6}};
}

// What a turn computed: its tokens, and the logits they were chosen from.
struct TurnOutput {
  std::vector<std::vector<int32_t>> tokens;
  std::vector<std::vector<double>> log_probs;  // (B, gen_len) of the chosen tokens
  std::vector<float> last_logits;              // (B, V)

  bool operator==(const TurnOutput&) const = default;
};

// Runs turn `turn` on the session at `directory` (created for turn 1), compacting on save past
// `compact_after` segments (0: never).
TurnOutput run_turn(const ModelSource& source, const OffloadOptions& options,
                    const fs::path& directory, int turn, bool shared, int64_t compact_after,
                    SessionStats* stats = nullptr) {
  const SessionKey key = session_key(source, options, DType::F16, Device::Cpu);
  auto session =
      turn == 1 ? DiskSession::create(directory, key) : DiskSession::open(directory, key);
  session->set_compact_after(compact_after);
  GenerationRequest request;
  request.prompts = session->turn_prompts(turn_prompts(turn, shared));
  request.gen_len = 3;
  request.score_tokens = true;
  const OffloadRun run = run_offloaded(source, request, options, Device::Cpu, {}, session.get());
  if (stats) *stats = session->stats();
  const Tensor& logits = run.result.last_logits;
  const float* data = logits.data<float>();
  return {run.result.tokens, run.result.token_log_probs,
          std::vector<float>(data, data + logits.numel())};
}

int64_t segments_of(const fs::path& directory) {
  return std::ssize(read_saved_session(directory).manifest.segments);
}

// The files under `directory` that its manifest does not name (manifest.json aside).
std::set<std::string> unnamed_files(const fs::path& directory) {
  const SessionManifest manifest = read_saved_session(directory).manifest;
  std::set<std::string> named = {kSessionManifest};
  for (const SessionSegment& segment : manifest.segments) {
    for (const SessionFile& file : segment.layers) named.insert(file.path);
  }
  for (const SessionFile& file : manifest.prefix.layers) named.insert(file.path);
  for (const SessionFile& file : manifest.state) named.insert(file.path);
  std::set<std::string> unnamed;
  for (const auto& entry : fs::recursive_directory_iterator(directory)) {
    const std::string relative = fs::relative(entry.path(), directory).string();
    if (entry.is_regular_file() && !named.count(relative)) unnamed.insert(relative);
  }
  return unnamed;
}

class CompactedOnSave : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {};

// Six turns, compacted on save past 3 segments (after turns 2, 4 and 6), give every turn's tokens
// and logits of the same turns never compacted; the merged files are gone.
TEST_P(CompactedOnSave, EqualsTheUncompactedSession) {
  const auto& [model, policy] = GetParam();
  const ModelSource source = session_model(model);
  const OffloadOptions options = options_for(policy);
  for (const bool shared : {false, true}) {
    TempDir dir("session-compact");
    const fs::path plain = dir.path() / "plain", compacted = dir.path() / "compacted";
    for (int turn = 1; turn <= 6; ++turn) {
      SessionStats stats;
      const TurnOutput expected = run_turn(source, options, plain, turn, shared, 0);
      EXPECT_EQ(run_turn(source, options, compacted, turn, shared, 3, &stats), expected)
          << model << ", " << policy << (shared ? ", shared prefix" : "") << ", turn " << turn;
      EXPECT_EQ(segments_of(plain), 2 * turn);
      // Turn 2 leaves 4 segments and turns 4 and 6 leave 5 (the compacted one and two turns'):
      // merged into one; turn 1 leaves 2, turns 3 and 5 leave 3.
      const int64_t merged = turn % 2 == 1 ? 0 : turn == 2 ? 4 : 5;
      EXPECT_EQ(stats.segments_compacted, merged) << "turn " << turn;
      EXPECT_EQ(segments_of(compacted), merged > 0 ? 1 : turn == 1 ? 2 : 3) << "turn " << turn;
      EXPECT_EQ(unnamed_files(compacted), std::set<std::string>()) << "turn " << turn;
    }
    const SessionKey key = session_key(source, options, DType::F16, Device::Cpu);
    EXPECT_EQ(DiskSession::open(compacted, key)->tokens(), DiskSession::open(plain, key)->tokens());
    DiskSession::open(compacted, key)->verify();
  }
}

INSTANTIATE_TEST_SUITE_P(Policies, CompactedOnSave,
                         ::testing::Combine(::testing::Values("opt-tiny", "llama-tiny"),
                                            ::testing::Values("full", "gpu", "infinigen", "int4")));

// Three turns of InfiniGen (its state files live in the first segment's directory), never
// compacted, in `directory`.
void three_turns(const ModelSource& source, const OffloadOptions& options,
                 const fs::path& directory) {
  for (int turn = 1; turn <= 3; ++turn) run_turn(source, options, directory, turn, false, 0);
}

// A kill -9 after any step of a compaction (each new file on the disk, the manifest replaced, the
// merged files removed) leaves a session that checks whole and resumes to the tokens and logits
// of the uncompacted one; the next compaction finishes the work.
TEST(SessionCompaction, AKillAtEveryStepLeavesAWholeSession) {
  const ModelSource source = session_model("opt-tiny");
  const OffloadOptions options = options_for("infinigen");
  const SessionKey key = session_key(source, options, DType::F16, Device::Cpu);
  TempDir dir("session-compact");
  const fs::path original = dir.path() / "original", reference = dir.path() / "reference";
  three_turns(source, options, original);
  fs::copy(original, reference, fs::copy_options::recursive);
  const TurnOutput expected = run_turn(source, options, reference, 4, false, 0);
  bool finished = false;
  int steps = 0;
  for (int kill_after = 0; !finished && kill_after < 20; ++kill_after) {
    const fs::path work = dir.path() / ("work-" + std::to_string(kill_after));
    fs::copy(original, work, fs::copy_options::recursive);
    const pid_t child = fork();
    ASSERT_GE(child, 0) << "fork failed";
    if (child == 0) {
      int step = 0;
      try {
        compact_session(work, [&](const std::string&) {
          if (step++ == kill_after) raise(SIGKILL);
        });
      } catch (...) {
        _exit(2);
      }
      _exit(0);
    }
    int status = 0;
    ASSERT_EQ(waitpid(child, &status, 0), child);
    finished = WIFEXITED(status);
    if (finished) {
      ASSERT_EQ(WEXITSTATUS(status), 0);
    } else {
      ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);
      ++steps;
    }
    DiskSession::open(work, key)->verify();
    const int64_t segments = segments_of(work);
    EXPECT_TRUE(segments == 6 || segments == 1) << segments << " after step " << kill_after;
    if (finished) {
      EXPECT_EQ(unnamed_files(work), std::set<std::string>());
    }
    // What a kill left goes with the next compaction, which has nothing left to merge or merges.
    if (!finished && kill_after % 2 == 1) {
      compact_session(work);
      EXPECT_EQ(segments_of(work), 1);
      EXPECT_EQ(unnamed_files(work), std::set<std::string>());
    }
    EXPECT_EQ(run_turn(source, options, work, 4, false, 0), expected)
        << "killed after step " << kill_after;
  }
  EXPECT_TRUE(finished);
  EXPECT_EQ(steps, source.config.num_layers + 2);  // the layer files, the manifest, the removal
}

std::vector<std::string> turn_args(const std::string& flag, const fs::path& directory,
                                   const std::string& compact_after) {
  return {"run",
          "--model",
          "opt-tiny",
          "--policy",
          "full",
          "--temperature",
          "0",
          "--gen-len",
          "3",
          "--prompt-len",
          "5",
          "--batch",
          "2",
          "--json",
          "--session-compact-after",
          compact_after,
          flag,
          directory.string()};
}

nlohmann::json run_json(const std::vector<std::string>& args) {
  const testing_util::CommandResult r = testing_util::run_infinigen(args);
  EXPECT_EQ(r.exit_code, 0) << testing_util::command_text(args) << "\n" << r.err;
  return nlohmann::json::parse(r.out);
}

// `infinigen session compact DIR` merges a session's six segments into one; the next turn gives the
// outputs of the uncompacted session, as does a turn that compacts on save (the flag).
TEST(SessionCompactionCli, CompactsADirectory) {
  TempDir dir("session-compact");
  const fs::path path = dir.path() / "s", plain = dir.path() / "plain",
                 on_save = dir.path() / "on-save";
  run_json(turn_args("--session", path, "0"));
  run_json(turn_args("--resume", path, "0"));
  run_json(turn_args("--resume", path, "0"));
  fs::copy(path, plain, fs::copy_options::recursive);
  fs::copy(path, on_save, fs::copy_options::recursive);
  const testing_util::CommandResult compacted =
      testing_util::run_infinigen({"session", "compact", path.string()});
  ASSERT_EQ(compacted.exit_code, 0) << compacted.err;
  EXPECT_NE(compacted.out.find("6 segments compacted into 1"), std::string::npos) << compacted.out;
  EXPECT_EQ(segments_of(path), 1);
  EXPECT_EQ(unnamed_files(path), std::set<std::string>());

  const nlohmann::json expected = run_json(turn_args("--resume", plain, "0"));
  EXPECT_EQ(run_json(turn_args("--resume", path, "0"))["outputs"], expected["outputs"]);
  const nlohmann::json saved = run_json(turn_args("--resume", on_save, "7"));
  EXPECT_EQ(saved["outputs"], expected["outputs"]);
  EXPECT_EQ(saved["session"]["segments_compacted"], 8);
  EXPECT_EQ(segments_of(on_save), 1);
  EXPECT_EQ(segments_of(plain), 8);

  const testing_util::CommandResult again =
      testing_util::run_infinigen({"session", "compact", on_save.string()});
  ASSERT_EQ(again.exit_code, 0) << again.err;
  EXPECT_NE(again.out.find("1 segment, nothing to compact"), std::string::npos) << again.out;
}

// What is not a session, or is damaged, ends with one line and leaves the session as it was.
TEST(SessionCompactionCli, BadInputsEndWithOneLine) {
  TempDir dir("session-compact");
  testing_util::expect_one_line_error({"session", "compact", (dir.path() / "none").string()},
                                      {"none", "no session here"});
  fs::create_directories(dir.path() / "notes");
  std::ofstream(dir.path() / "notes" / "todo.txt") << "keep me\n";
  testing_util::expect_one_line_error({"session", "compact", (dir.path() / "notes").string()},
                                      {"notes", "no session here"});
  EXPECT_TRUE(fs::exists(dir.path() / "notes" / "todo.txt"));
  testing_util::expect_one_line_error({"session"}, {"subcommand"});
  testing_util::expect_one_line_error({"run", "--session-compact-after", "-1"},
                                      {"--session-compact-after"});

  const fs::path path = dir.path() / "s";
  run_json(turn_args("--session", path, "0"));
  run_json(turn_args("--resume", path, "0"));
  const std::string manifest = read_bytes(path / kSessionManifest);
  const auto entries = [&] {
    std::set<std::string> names;
    for (const auto& entry : fs::recursive_directory_iterator(path))
      names.insert(entry.path().string());
    return names;
  };
  const std::set<std::string> before = entries();

  write_bytes(path / kSessionManifest, manifest.substr(0, manifest.size() / 2));
  testing_util::expect_one_line_error({"session", "compact", path.string()},
                                      {"manifest.json", "not valid JSON"});
  std::string damaged = manifest;
  char& digit = damaged[damaged.find("\"crc32\": \"") + 10];  // a file's checksum
  digit = digit == '1' ? '2' : '1';
  write_bytes(path / kSessionManifest, damaged);
  testing_util::expect_one_line_error({"session", "compact", path.string()},
                                      {"manifest.json", "checksum mismatch"});
  write_bytes(path / kSessionManifest, manifest);

  const fs::path layer = path / "seg-000003" / "layer-001.safetensors";
  const std::string original = read_bytes(layer);
  std::string flipped = original;
  flipped[flipped.size() - 3] ^= 0x40;
  write_bytes(layer, flipped);
  testing_util::expect_one_line_error({"session", "compact", path.string()},
                                      {"layer-001.safetensors", "checksum mismatch"});
  EXPECT_EQ(read_bytes(path / kSessionManifest), manifest);
  EXPECT_EQ(entries(), before);  // nothing of the failed compaction is left
  write_bytes(layer, original);
  const testing_util::CommandResult whole =
      testing_util::run_infinigen({"session", "compact", path.string()});
  EXPECT_EQ(whole.exit_code, 0) << whole.err;
}

}  // namespace
}  // namespace infinigen
