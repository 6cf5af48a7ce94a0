// tests: a conversation past a rotary model's context (DiskSession::drop_oldest, docs/sessions.md,
// "Overflow"): the oldest history after a kept prefix goes, the rest keeps its rows at positions
// moved back by the tokens dropped, its keys rotated to them, and InfiniGen's partial keys follow.
#include <cmath>
#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>

#include "core/rope.h"
#include "core/safetensors.h"
#include "kernels/cpu/rope.h"
#include "offload/runtime.h"
#include "offload/session.h"
#include "tests/session_test_util.h"
#include "tests/test_util.h"

namespace infinigen {
namespace {

namespace fs = std::filesystem;
using testing_util::session_model;
using testing_util::TempDir;

// A key rotated at position p and moved by -delta is the key rotated at p - delta directly, to
// the rounding of the dtype it is kept in.
TEST(RotaryShift, AMovedKeyIsTheKeyRotatedAtItsNewPosition) {
  RopeConfig llama3;
  llama3.theta = 500000;
  llama3.scaling = RopeConfig::Scaling::Llama3;
  llama3.factor = 8;
  RopeConfig plain;
  plain.theta = 10000;
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  for (const RopeConfig& rope : {plain, llama3}) {
    const int64_t d = 128;
    const std::vector<float> inv_freq = rope_inv_freq(rope, d);
    for (const DType dtype : {DType::F32, DType::F16, DType::BF16}) {
      // fp32: the angles' rounding at positions up to 130000; the others: one rounding each way.
      const float tolerance = dtype == DType::F32 ? 2e-2f : dtype == DType::F16 ? 4e-2f : 1.5e-1f;
      for (const auto& [position, delta] : {std::pair{100, 60}, {2047, 1500}, {130000, 70000}}) {
        std::vector<float> key(d);
        for (float& x : key) x = normal(rng);
        std::vector<float> at_old = key, at_new = key;
        const int32_t old_position = position, new_position = position - delta;
        kernels::cpu::rope(at_old.data(), &old_position, inv_freq.data(), 1, 1, d);
        kernels::cpu::rope(at_new.data(), &new_position, inv_freq.data(), 1, 1, d);
        std::vector<char> stored(static_cast<size_t>(d) * dtype_size(dtype));
        convert_from_f32(at_old.data(), stored.data(), dtype, at_old.size());
        RotaryShift(inv_freq, -delta).apply(stored.data(), dtype);
        std::vector<float> moved(d);
        convert_to_f32(stored.data(), dtype, moved.data(), moved.size());
        for (int64_t i = 0; i < d; ++i) {
          ASSERT_NEAR(moved[i], at_new[i], tolerance)
              << dtype_name(dtype) << " position " << position << " delta " << delta << " " << i;
        }
        // The rotation is exact but for rounding: a round trip gives the key back.
        RotaryShift(inv_freq, delta).apply(stored.data(), dtype);
        convert_to_f32(stored.data(), dtype, moved.data(), moved.size());
        for (int64_t i = 0; i < d; ++i) ASSERT_NEAR(moved[i], at_old[i], 2 * tolerance);
      }
    }
  }
}

TEST(OverflowDrops, DropExactlyWhatTheTurnNeedsAfterTheKeptPrefix) {
  // held includes the last token; 64 positions; 10 new prompt tokens and 6 generated.
  EXPECT_EQ(overflow_drops({40, 48, 60}, {10, 10, 10}, 6, 64, 4, {}),
            std::vector<int64_t>({0, 0, 12}));
  EXPECT_EQ(overflow_drops({60}, {10}, 6, 64, 0, {}), std::vector<int64_t>({12}));
  // Every droppable token (held - 1 - keep_prefix) may go, no more.
  EXPECT_EQ(overflow_drops({60}, {51}, 6, 64, 6, {}), std::vector<int64_t>({53}));
  testing_util::expect_error([] { overflow_drops({60}, {52}, 6, 64, 6, {}); },
                             {"sequence 1: this turn's 52 prompt tokens and 6 generated need 54",
                              "only 53 history tokens after the kept prefix of 6"});
  // Sizes past int64 are refused, not wrapped.
  testing_util::expect_error(
      [] { overflow_drops({60}, {std::numeric_limits<int64_t>::max()}, 6, 64, 4, {}); },
      {"sequence 1: this turn's"});
  // A prefix other conversations share stays: the kept prefix must cover it.
  EXPECT_EQ(overflow_drops({60, 60}, {10, 10}, 6, 64, 8, {8, 0}), std::vector<int64_t>({12, 12}));
  testing_util::expect_error([] { overflow_drops({60, 60}, {10, 10}, 6, 64, 4, {8, 0}); },
                             {"sequence 1 shares a prompt prefix of 8 tokens",
                              "--keep-prefix must be at least that"});
  testing_util::expect_error([] { overflow_drops({60}, {10}, 6, 64, -1, {}); },
                             {"--keep-prefix must be at least 0"});
  // A margin drops more where a sequence must drop, as far as its history goes; none where it
  // fits.
  EXPECT_EQ(overflow_drops({60, 20}, {10, 10}, 6, 64, 4, {}, 20), std::vector<int64_t>({32, 0}));
  EXPECT_EQ(overflow_drops({60}, {10}, 6, 64, 4, {}, 1000), std::vector<int64_t>({55}));
  testing_util::expect_error([] { overflow_drops({60}, {10}, 6, 64, 4, {}, -1); },
                             {"--overflow-margin must be at least 0"});
}

// llama-tiny with a context of 64 positions: sequence 0's second turn passes it, sequence 1's
// does not.
constexpr int64_t kContext = 64, kKeep = 4, kGen = 5;

ModelSource small_context_llama() {
  ModelSource source = session_model("llama-tiny");
  source.config.max_positions = kContext;
  return source;
}

std::vector<std::vector<int32_t>> first_prompts() {
  std::vector<std::vector<int32_t>> prompts(2, {2});
  for (int32_t t = 0; t < 40; ++t) prompts[0].push_back(10 + t);
  for (int32_t t = 0; t < 30; ++t) prompts[1].push_back(100 + 3 * t);
  return prompts;
}

std::vector<std::vector<int32_t>> second_prompts() {
  std::vector<std::vector<int32_t>> prompts(2);
  for (int32_t t = 0; t < 20; ++t) {
    prompts[0].push_back(300 + t);
    prompts[1].push_back(400 + t);
  }
  return prompts;
}

// (rows, width) of stream `name` of (layer, sequence b, KV head h) over the session's segments in
// order: the rows of b's own history (after any shared prefix), widened to fp32.
std::vector<std::vector<float>> saved_rows(const fs::path& directory, int64_t layer,
                                           const std::string& name, int64_t b, int64_t h) {
  const SavedSession saved = read_saved_session(directory);
  std::vector<std::vector<float>> rows;
  for (const SessionSegment& segment : saved.manifest.segments) {
    const auto file = SafetensorsFile::open(
        (directory / segment.layers[static_cast<size_t>(layer)].path).string());
    const SafetensorsEntry& entry = *file->find(name);
    const int64_t H = entry.shape[1], R = entry.shape[2], width = entry.shape[3];
    const size_t row_bytes = static_cast<size_t>(width) * dtype_size(entry.dtype);
    const char* data = static_cast<const char*>(file->bytes(entry));
    for (int64_t j = 0; j < segment.rows[static_cast<size_t>(b)]; ++j) {
      std::vector<float> row(static_cast<size_t>(width));
      convert_to_f32(data + static_cast<size_t>((b * H + h) * R + j) * row_bytes, entry.dtype,
                     row.data(), row.size());
      rows.push_back(std::move(row));
    }
  }
  return rows;
}

struct Overflowed {
  fs::path before;  // the session after its first turn
  fs::path after;   // the same session after the second turn, which overflowed
  SessionStats stats;
  std::vector<std::vector<int32_t>> tokens;     // the conversations as the second turn saved them
  std::vector<std::vector<int32_t>> generated;  // the second turn's tokens
};

// The first turn saved, copied, then continued past the context with `options` on `device`.
Overflowed overflow_session(const TempDir& dir, const OffloadOptions& options,
                            Device device = Device::Cpu) {
  const ModelSource source = small_context_llama();
  const SessionKey key = session_key(source, options, DType::F16, device);
  Overflowed out{dir.path() / "before", dir.path() / "after", {}, {}, {}};
  GenerationRequest request;
  request.gen_len = kGen;
  {
    auto session = DiskSession::create(out.before, key);
    request.prompts = session->turn_prompts(first_prompts());
    run_offloaded(source, request, options, device, {}, session.get());
  }
  fs::copy(out.before, out.after, fs::copy_options::recursive);
  auto session = DiskSession::open(out.after, key);
  EXPECT_EQ(session->drop_oldest(source.config, {20, 20}, kGen, kKeep), 7);
  request.prompts = session->turn_prompts(second_prompts());
  out.generated = run_offloaded(source, request, options, device, {}, session.get()).result.tokens;
  out.stats = session->stats();
  out.tokens = session->tokens();
  return out;
}

class SessionOverflow : public ::testing::TestWithParam<std::string> {};

// The kept rows are the saved ones at their new places: values and the kept prefix's keys byte
// for byte, the moved keys rotated back by the tokens dropped, which at layer 0 (whose keys depend
// on the token and its position alone) makes them the keys a first turn over the kept tokens
// computes.
TEST_P(SessionOverflow, KeptRowsMoveAndTheirKeysAreRotatedToTheNewPositions) {
  TempDir dir("overflow");
  OffloadOptions options = testing_util::session_options(GetParam());
  const Overflowed run = overflow_session(dir, options);
  // Sequence 0: 41 + 5 held, 20 new and 5 generated pass 64 by 7 (it keeps the last 64 minus
  // the one token without KV); sequence 1 fits.
  EXPECT_EQ(run.stats.tokens_dropped, 7);
  EXPECT_GT(run.stats.shift_seconds, 0.0);
  ASSERT_EQ(run.tokens.size(), 2u);
  EXPECT_EQ(std::ssize(run.tokens[0]), kContext);
  EXPECT_EQ(std::ssize(run.tokens[1]), 31 + kGen + 20 + kGen);
  // The old segments went with the overflow: one for the moved history and the first pass, one
  // for the decode steps.
  EXPECT_EQ(read_saved_session(run.after).manifest.segments.size(), 2u);

  const ModelSource source = small_context_llama();
  const int64_t L = source.config.num_layers, H = source.config.kv_heads();
  const int64_t dropped = 7, history = 41 + kGen - 1;
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t b = 0; b < 2; ++b) {
        const int64_t drop = b == 0 ? dropped : 0;
        const int64_t held = b == 0 ? history : 30 + kGen;
        const auto old_values = saved_rows(run.before, l, "values", b, h);
        const auto new_values = saved_rows(run.after, l, "values", b, h);
        const auto old_keys = saved_rows(run.before, l, "keys", b, h);
        const auto new_keys = saved_rows(run.after, l, "keys", b, h);
        ASSERT_EQ(std::ssize(old_values), held);
        for (int64_t o = 0; o < held - drop; ++o) {
          const int64_t from = o < kKeep ? o : o + drop;
          ASSERT_EQ(new_values[o], old_values[from]) << l << " " << h << " " << b << " " << o;
          if (o < kKeep || drop == 0) {
            ASSERT_EQ(new_keys[o], old_keys[from]);
          } else {
            ASSERT_NE(new_keys[o], old_keys[from]);
          }
        }
      }
    }
  }
  // Layer 0 of a first turn over sequence 0's kept history.
  GenerationRequest request;
  request.gen_len = 1;
  request.prompts = {std::vector<int32_t>(run.tokens[0].begin(),
                                          run.tokens[0].begin() + (history - dropped))};
  {
    auto fresh = DiskSession::create(dir.path() / "fresh",
                                     session_key(source, options, DType::F16, Device::Cpu));
    request.prompts = fresh->turn_prompts(request.prompts);
    run_offloaded(source, request, options, Device::Cpu, {}, fresh.get());
  }
  for (int64_t h = 0; h < H; ++h) {
    const auto moved = saved_rows(run.after, 0, "keys", 0, h);
    const auto direct = saved_rows(dir.path() / "fresh", 0, "keys", 0, h);
    for (int64_t o = 0; o < history - dropped; ++o) {
      for (size_t i = 0; i < direct[o].size(); ++i) {
        ASSERT_NEAR(moved[o][i], direct[o][i], 2e-3 + 4e-3 * std::abs(direct[o][i]))
            << "head " << h << " row " << o << " channel " << i;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Policies, SessionOverflow,
                         ::testing::Values("full", "gpu", "infinigen"));

// InfiniGen's partial keys are derived again from the moved keys: each saved partial key is its
// key's partial columns (llama-tiny has no skew), after the move as before it.
TEST(SessionOverflowInfinigen, PartialKeysFollowTheMovedKeys) {
  TempDir dir("overflow");
  OffloadOptions options;
  options.policy = "infinigen";
  const Overflowed run = overflow_session(dir, options);
  const ModelSource source = small_context_llama();
  const int64_t H = source.config.kv_heads();
  const SavedSession saved = read_saved_session(run.after);
  int64_t checked = 0;
  for (int64_t l = 0; l < source.config.num_layers; ++l) {
    const SessionFile& state = saved.manifest.state[static_cast<size_t>(l)];
    if (state.path.empty()) continue;  // a dense layer
    const auto file = SafetensorsFile::open((run.after / state.path).string());
    const SafetensorsEntry& columns = *file->find("partial_columns");  // (H_kv, r) int32
    const int32_t* cols = static_cast<const int32_t*>(file->bytes(columns));
    const int64_t r = columns.shape[1];
    for (int64_t b = 0; b < 2; ++b) {
      for (int64_t h = 0; h < H; ++h) {
        const auto keys = saved_rows(run.after, l, "keys", b, h);
        const auto partial = saved_rows(run.after, l, "partial_keys", b, h);
        ASSERT_EQ(keys.size(), partial.size());
        for (size_t t = 0; t < keys.size(); ++t) {
          for (int64_t j = 0; j < r; ++j) {
            ASSERT_EQ(partial[t][j], keys[t][cols[h * r + j]]) << l << " " << b << " " << t;
            ++checked;
          }
        }
      }
    }
  }
  EXPECT_GT(checked, 0);
}

// What cannot move refuses with one line: OPT's learned positions, int4's quantised rows, a
// capped pool's positions (its session keeps no rows per token).
TEST(SessionOverflowRefusal, LearnedPositionsInt4AndCappedPoolsRefuse) {
  for (const auto& [model, policy, fragment] :
       {std::tuple{"opt-tiny", "full", "learns its positions"},
        std::tuple{"llama-tiny", "int4", "the policy int4's saved rows cannot move"},
        std::tuple{"llama-tiny", "capped", "keeps its store's positions (--kv-pool-limit)"}}) {
    TempDir dir("overflow");
    ModelSource source = session_model(model);
    source.config.max_positions = kContext;
    OffloadOptions options =
        testing_util::session_options(std::string(policy) == "capped" ? "infinigen" : policy);
    if (std::string(policy) == "capped") options.kv_pool_limit = 0.5;
    const SessionKey key = session_key(source, options, DType::F16, Device::Cpu);
    {
      auto session = DiskSession::create(dir.path() / "s", key);
      GenerationRequest request;
      request.gen_len = kGen;
      request.prompts = session->turn_prompts(first_prompts());
      run_offloaded(source, request, options, Device::Cpu, {}, session.get());
    }
    auto session = DiskSession::open(dir.path() / "s", key);
    testing_util::expect_error(
        [&] { session->drop_oldest(source.config, {20, 20}, kGen, kKeep); },
        {"passes the model's context of 64 positions", fragment});
    // A turn that fits changes nothing, whatever the model.
    EXPECT_EQ(session->drop_oldest(source.config, {2, 2}, 2, kKeep), 0);
  }
}

// On the device the restore moves the rows in host memory before they go up: the overflowed turn
// gives the CPU's tokens, for every policy that can move its rows.
TEST(SessionOverflowGpu, AnOverflowedTurnOnTheDeviceGivesTheCpuTokens) {
  INFINIGEN_SKIP_WITHOUT_CUDA_DEVICE();
  for (const std::string policy : {"full", "gpu", "infinigen"}) {
    TempDir cpu_dir("overflow-cpu"), cuda_dir("overflow-cuda");
    const OffloadOptions options = testing_util::session_options(policy);
    const Overflowed cpu = overflow_session(cpu_dir, options, Device::Cpu);
    const Overflowed cuda = overflow_session(cuda_dir, options, Device::Cuda);
    EXPECT_EQ(cuda.stats.tokens_dropped, 7) << policy;
    EXPECT_EQ(cuda.generated, cpu.generated) << policy;
    EXPECT_EQ(cuda.tokens, cpu.tokens) << policy;
  }
}

// A conversation of many turns on the built-in Llama runs past its context of 2048 positions to
// the end, each turn that would pass it dropping what it needs (and --overflow-margin more), and
// the session never holds more than the context. 408 tokens a turn: the sixth is the first past
// 2048 (by 400); with no margin the seventh drops too, with a margin of 600 it fits.
class ManyTurns : public ::testing::TestWithParam<int> {};

TEST_P(ManyTurns, PastTheContextRunToTheEnd) {
  const int margin = GetParam();
  TempDir dir("overflow-cli");
  const std::string session = (dir.path() / "chat").string();
  int64_t dropped = 0;
  std::vector<int32_t> first_tokens;  // the conversation's first 16 tokens
  for (int turn = 1; turn <= 7; ++turn) {
    std::vector<std::string> args = {"run",          "--model",   "builtin-llama", "--policy",
                                     "infinigen",    "--json",    "--prompt-len",  "400",
                                     "--gen-len",    "8",         "--temperature", "0"};
    if (turn == 1) {
      args.insert(args.end(), {"--session", session});
    } else {
      args.insert(args.end(), {"--resume", session, "--overflow", "drop-oldest", "--keep-prefix",
                               "16", "--overflow-margin", std::to_string(margin)});
    }
    const testing_util::CommandResult run =
        testing_util::run_infinigen(args, {"INFINIGEN_CACHE_DIR=" + dir.str()});
    ASSERT_EQ(run.exit_code, 0) << "turn " << turn << ": " << run.err;
    const nlohmann::json report = nlohmann::json::parse(run.out, nullptr, false);
    ASSERT_FALSE(report.is_discarded()) << run.out;
    const int64_t turn_dropped = report["session"]["tokens_dropped"];
    EXPECT_EQ(turn_dropped > 0, margin == 0 ? turn >= 6 : turn == 6) << "turn " << turn;
    if (turn == 6) {
      EXPECT_EQ(turn_dropped, 400 + margin);
    }
    dropped += turn_dropped;
    const SavedSession saved = read_saved_session(session);
    ASSERT_EQ(saved.manifest.tokens.size(), 1u);
    EXPECT_LE(std::ssize(saved.manifest.tokens[0]), 2048 + 1) << "turn " << turn;
    EXPECT_EQ(std::ssize(saved.manifest.tokens[0]), 408 * turn - dropped) << "turn " << turn;
    const std::vector<int32_t>& tokens = saved.manifest.tokens[0];
    if (turn == 1) first_tokens.assign(tokens.begin(), tokens.begin() + 16);
    // --keep-prefix 16 keeps them through every drop.
    EXPECT_TRUE(std::equal(first_tokens.begin(), first_tokens.end(), tokens.begin()))
        << "turn " << turn;
  }
  EXPECT_GT(dropped, 0);
}

INSTANTIATE_TEST_SUITE_P(Margins, ManyTurns, ::testing::Values(0, 600));

// Bad uses of the overflow options end with one line.
TEST(SessionOverflowCli, BadUsesEndWithOneLine) {
  TempDir dir("overflow-cli");
  const std::string session = (dir.path() / "chat").string();
  for (const auto& [args, fragment] :
       std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"run", "--overflow", "drop-oldest", "--gen-len", "2"}, "--overflow requires --resume"},
           {{"run", "--resume", session, "--prompt", "x", "--overflow", "truncate"},
            "--overflow: truncate not in {refuse,drop-oldest}"},
           {{"run", "--resume", session, "--prompt", "x", "--keep-prefix", "8"},
            "--keep-prefix requires --overflow"}}) {
    const testing_util::CommandResult run =
        testing_util::run_infinigen(args, {"INFINIGEN_CACHE_DIR=" + dir.str()});
    EXPECT_NE(run.exit_code, 0);
    EXPECT_NE(run.err.find(fragment), std::string::npos) << run.err;
    EXPECT_EQ(std::count(run.err.begin(), run.err.end(), '\n'), 1) << run.err;
  }
}

}  // namespace
}  // namespace infinigen
