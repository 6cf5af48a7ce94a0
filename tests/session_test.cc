// tests: conversations kept on disk (offload/session.h): a resumed turn computes what one run
// over the concatenated turns computes, and a damaged or foreign session is refused with one line
// without being overwritten.
#include "offload/session.h"

#include <signal.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "core/file_io.h"
#include "core/model_loader.h"
#include "core/safetensors.h"
#include "offload/h2o_kv.h"
#include "offload/infinigen_kv.h"
#include "offload/kv_policy.h"
#include "offload/runtime.h"
#include "predict/cost_model.h"
#include "predict/hardware_profile.h"
#include "predict/schedule.h"
#include "tests/session_test_util.h"
#include "tests/test_util.h"

namespace infinigen {
namespace {

namespace fs = std::filesystem;
using testing_util::read_bytes;
using testing_util::resume_store;
using testing_util::ResumedStore;
using testing_util::session_model;
using testing_util::session_options;
using testing_util::TempDir;
using testing_util::write_bytes;

// What the first turn's prompts share: nothing, 9 tokens for the batch (two blocks of 4
// shared), or 9 tokens for sequences 1 and 2 only (a group led by sequence 1).
enum class Sharing { None, Batch, Group };

// Turn prompts of different lengths per sequence, ids the vocabulary holds.
std::vector<std::vector<int32_t>> turn_prompts(int turn, Sharing sharing = Sharing::None) {
  if (turn == 1 && sharing == Sharing::Batch) {
    return {{2, 20, 21, 22, 23, 24, 25, 26, 27, 10, 11, 12, 13},
            {2, 20, 21, 22, 23, 24, 25, 26, 27, 500, 600, 700, 800, 900, 1000, 1100, 1200},
            {2, 20, 21, 22, 23, 24, 25, 26, 27, 7, 8}};
  }
  if (turn == 1 && sharing == Sharing::Group) {
    return {{2, 10, 11, 12, 13},
            {2, 20, 21, 22, 23, 24, 25, 26, 27, 500, 600, 700, 800, 900, 1000, 1100, 1200},
            {2, 20, 21, 22, 23, 24, 25, 26, 27, 7, 8}};
  }
  if (turn == 1)
    return {{2, 10, 11, 12, 13}, {2, 500, 600, 700, 800, 900, 1000, 1100, 1200}, {2, 7, 8}};
  if (turn == 2) return {{40, 41}, {42, 43, 44, 45, 46}, {47}};
  return {{60, 61, 62, 63}, {64}, {65, 66}};
}

struct Turns {
  std::vector<std::vector<std::vector<int32_t>>> generated;  // per turn, per sequence
  std::vector<std::vector<float>> last_logits;               // per turn: (B, V)
};

std::vector<float> logits_of(const GenerationResult& result) {
  const float* data = result.last_logits.data<float>();
  return {data, data + result.last_logits.numel()};
}

// Three turns of 5 tokens each, saved in `directory`, each after the first resumed from it, on
// `device`.
Turns run_session(const ModelSource& source, const OffloadOptions& options,
                  const fs::path& directory, Sharing sharing = Sharing::None,
                  Device device = Device::Cpu) {
  const SessionKey key = session_key(source, options, DType::F16, device);
  Turns turns;
  for (int turn = 1; turn <= 3; ++turn) {
    auto session =
        turn == 1 ? DiskSession::create(directory, key) : DiskSession::open(directory, key);
    GenerationRequest request;
    request.prompts = session->turn_prompts(turn_prompts(turn, sharing));
    request.gen_len = 5;
    const OffloadRun run = run_offloaded(source, request, options, device, {}, session.get());
    turns.generated.push_back(run.result.tokens);
    turns.last_logits.push_back(logits_of(run.result));
    // The later turns keep sharing.
    EXPECT_EQ(run.shared_prefixes.kept_tokens(), sharing == Sharing::None ? 0 : 8);
    if (sharing == Sharing::Group) {
      EXPECT_EQ(run.shared_prefixes.groups(), std::vector<int32_t>({-1, 0, 0}));
    }
    EXPECT_EQ(std::ssize(run.stats.steps()), request.gen_len);  // the prompt, then each step
  }
  return turns;
}

// Turn `turn` computed by one run over every earlier turn's prompts and outputs.
GenerationResult uninterrupted_run(const ModelSource& source, const OffloadOptions& options,
                                   const Turns& turns, int turn, Sharing sharing = Sharing::None) {
  GenerationRequest request;
  request.gen_len = 5;
  request.prompts.assign(3, {});
  for (int t = 1; t <= turn; ++t) {
    for (size_t b = 0; b < 3; ++b) {
      const auto prompt = turn_prompts(t, sharing)[b];
      request.prompts[b].insert(request.prompts[b].end(), prompt.begin(), prompt.end());
      if (t < turn) {
        const auto& out = turns.generated[static_cast<size_t>(t - 1)][b];
        request.prompts[b].insert(request.prompts[b].end(), out.begin(), out.end());
      }
    }
  }
  return run_offloaded(source, request, options, Device::Cpu).result;
}

// The tokens of that run.
std::vector<std::vector<int32_t>> uninterrupted(const ModelSource& source,
                                                const OffloadOptions& options, const Turns& turns,
                                                int turn, Sharing sharing = Sharing::None) {
  return uninterrupted_run(source, options, turns, turn, sharing).tokens;
}

class ResumedTurns : public ::testing::TestWithParam<std::tuple<std::string, std::string>> {};

TEST_P(ResumedTurns, EqualOneRunOverTheConcatenatedTurns) {
  const auto& [model, policy] = GetParam();
  const ModelSource source = session_model(model);
  const OffloadOptions options = session_options(policy);
  TempDir dir("session");
  const Turns turns = run_session(source, options, dir.path() / "s");
  for (int turn = 2; turn <= 3; ++turn) {
    EXPECT_EQ(turns.generated[static_cast<size_t>(turn - 1)],
              uninterrupted(source, options, turns, turn))
        << model << ", " << policy << ", turn " << turn;
  }
}

TEST_P(ResumedTurns, KeepTheirSharedPrefixOnceAndEqualAnUnsharedRun) {
  const auto& [model, policy] = GetParam();
  const ModelSource source = session_model(model);
  OffloadOptions options = session_options(policy);
  options.kv_block_tokens = 4;
  TempDir dir("session");
  for (const Sharing sharing : {Sharing::Group, Sharing::Batch}) {
    fs::remove_all(dir.path() / "s");
    const Turns turns = run_session(source, options, dir.path() / "s", sharing);
    OffloadOptions unshared = options;
    unshared.share_prefix = false;
    for (int turn = 2; turn <= 3; ++turn) {
      EXPECT_EQ(turns.generated[static_cast<size_t>(turn - 1)],
                uninterrupted(source, unshared, turns, turn, sharing))
          << model << ", " << policy << ", turn " << turn;
    }
  }
  // The prefix is one segment of (1, H_kv, 8, d) rows; the others hold each sequence's own.
  const auto session =
      DiskSession::open(dir.path() / "s", session_key(source, options, DType::F16, Device::Cpu));
  EXPECT_EQ(session->shared_prefixes().kept_tokens(), 8);
  session->verify();
  if (policy != "gpu") {  // a pool of other blocks cannot hold it: one line, nothing written
    options.kv_block_tokens = 3;
    const std::string manifest = read_bytes(dir.path() / "s" / "manifest.json");
    testing_util::expect_error(
        [&] {
          auto resumed = DiskSession::open(dir.path() / "s",
                                           session_key(source, options, DType::F16, Device::Cpu));
          GenerationRequest request;
          request.prompts = resumed->turn_prompts(turn_prompts(2));
          request.gen_len = 2;
          run_offloaded(source, request, options, Device::Cpu, {}, resumed.get());
        },
        {"8-token prefix", "kv-block-tokens 3"});
    EXPECT_EQ(read_bytes(dir.path() / "s" / "manifest.json"), manifest);
  }
}

INSTANTIATE_TEST_SUITE_P(Policies, ResumedTurns,
                         ::testing::Combine(::testing::Values("opt-tiny", "llama-tiny"),
                                            ::testing::Values("full", "gpu", "infinigen")));

// int4 saves its pool's codes and scales as they are, and restores them into the same rows. A
// resumed turn attends to its history dequantised (as decode steps do), where one run over the
// concatenated turns computes the history in its prefill from fresh rows: the two differ by the
// quantisation error, so the tokens must agree and the logits within that error. (The restored
// bytes are checked below; a compacted session's turns equal the uncompacted one's bit for bit,
// session_compact_test.cc.)
TEST(Int4Session, ResumedTurnsAgreeWithOneRunOverTheConcatenatedTurns) {
  // Rows no load brought are NaN: a resumed turn that read one would give garbage.
  set_debug_poison(true);
  for (const std::string model : {"opt-tiny", "llama-tiny"}) {
    const ModelSource source = session_model(model);
    const OffloadOptions options = session_options("int4");
    TempDir dir("session");
    const Turns turns = run_session(source, options, dir.path() / "s");
    for (int turn = 2; turn <= 3; ++turn) {
      const GenerationResult expected = uninterrupted_run(source, options, turns, turn);
      const auto& got = turns.last_logits[static_cast<size_t>(turn - 1)];
      EXPECT_EQ(turns.generated[static_cast<size_t>(turn - 1)], expected.tokens)
          << model << ", turn " << turn;
      EXPECT_LT(testing_util::relative_error(got.data(), logits_of(expected).data(), got.size()),
                5e-2)
          << model << ", turn " << turn;
    }
  }
  set_debug_poison(false);
}

// What an int4 store holds after a resume is what the session saved: the codes and scales of
// every history token, byte for byte, at the rows the new layout puts them.
TEST(Int4Session, RestoredCodesAndScalesAreTheSavedOnes) {
  TempDir dir("session");
  const ModelSource source = session_model("opt-tiny");
  const OffloadOptions options = session_options("int4");
  const fs::path path = dir.path() / "s";
  const SessionKey key = session_key(source, options, DType::F16, Device::Cpu);
  {
    auto session = DiskSession::create(path, key);
    GenerationRequest request;
    request.prompts = session->turn_prompts(turn_prompts(1));
    request.gen_len = 1;  // one segment: the prompt's rows
    run_offloaded(source, request, options, Device::Cpu, {}, session.get());
  }
  auto session = DiskSession::open(path, key);
  const auto& history = session->history();
  const int64_t B = std::ssize(history), L = source.config.num_layers;
  const std::unique_ptr<ResumedStore> resumed = resume_store(*session, source, options);
  const std::unique_ptr<KvStore>& store = resumed->store;
  const std::vector<int32_t>& first_valid = resumed->first_valid;
  const std::vector<KvStore::TokenStream> streams = store->token_streams(0);
  ASSERT_EQ(streams.size(), 4u);
  for (int64_t l = 0; l < L; ++l) {
    const auto saved =
        SafetensorsFile::open((path / "seg-000001" / session_layer_file("layer", l)).string());
    for (size_t k = 0; k < streams.size(); ++k) {
      const SafetensorsEntry& entry = *saved->find(streams[k].name);  // (B, H, R, width)
      const int64_t H = entry.shape[1], R = entry.shape[2];
      const size_t row = static_cast<size_t>(entry.shape[3]) * dtype_size(entry.dtype);
      const char* data = static_cast<const char*>(saved->bytes(entry));
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t h = 0; h < H; ++h) {
          for (int64_t j = 0; j < std::ssize(history[b]); ++j) {
            ASSERT_EQ(std::memcmp(store->token_row(l, k, b, h, first_valid[b] + j),
                                  data + static_cast<size_t>((b * H + h) * R + j) * row, row),
                      0)
                << streams[k].name << " layer " << l << " " << b << " " << h << " " << j;
          }
        }
      }
    }
  }
}

// H2O keeping every token (budget 1) attends as the full cache does, so its sessions must give
// the full cache's turns: the kept entries and scores saved at each turn's end, restored at the
// rows of the new layout less the newest history rows that a sequence with fewer new tokens
// computes again (the turns' prompts differ in length), and the first pass of each resumed turn
// an extension over the kept rows. Rows no load brought are NaN.
TEST(H2oSession, AtAFullBudgetGivesTheFullCachesTurns) {
  set_debug_poison(true);
  for (const std::string model : {"opt-tiny", "llama-tiny"}) {
    const ModelSource source = session_model(model);
    OffloadOptions options = session_options("h2o");
    options.h2o_budget = 1.0;
    TempDir dir("session-h2o");
    const Turns h2o = run_session(source, options, dir.path() / "h2o");
    const Turns full = run_session(source, session_options("full"), dir.path() / "full");
    EXPECT_EQ(h2o.generated, full.generated) << model;
    for (size_t turn = 0; turn < full.last_logits.size(); ++turn) {
      const auto& got = h2o.last_logits[turn];
      EXPECT_LT(testing_util::relative_error(got.data(), full.last_logits[turn].data(), got.size()),
                1e-4)
          << model << ", turn " << turn + 1;
    }
  }
  set_debug_poison(false);
}

// The saved state of a session whose turns are prompts only (one token generated each), and
// the turns' tokens (prompts and what was generated), in `path`.
std::vector<std::vector<int32_t>> prompt_turns(
    const ModelSource& source, const OffloadOptions& options, const fs::path& path,
    const std::vector<std::vector<std::vector<int32_t>>>& turns, DType kv_dtype = DType::F16) {
  const SessionKey key = session_key(source, options, kv_dtype, Device::Cpu);
  for (size_t t = 0; t < turns.size(); ++t) {
    auto session = t == 0 ? DiskSession::create(path, key) : DiskSession::open(path, key);
    GenerationRequest request;
    request.prompts = session->turn_prompts(turns[t]);
    request.gen_len = 1;
    request.kv_dtype = kv_dtype;
    run_offloaded(source, request, options, Device::Cpu, {}, session.get());
  }
  return DiskSession::open(path, key)->tokens();
}

// Two turns of prompts (20 and 17 new tokens after 6 and 9) that fill a session to 27 tokens per
// sequence, in `dir`/turns, and one prompt over the same 27 tokens in `dir`/once.
void two_turns_and_one_prompt(const ModelSource& source, const OffloadOptions& options,
                              const fs::path& dir, DType kv_dtype = DType::F16) {
  const std::vector<std::vector<int32_t>> conversation = prompt_turns(
      source, options, dir / "turns",
      {{{2, 10, 11, 12, 13, 14}, {2, 500, 600, 700, 800, 900, 1000, 1100, 1200}},
       {{40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59},
        {60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74, 75, 76}}},
      kv_dtype);
  std::vector<std::vector<int32_t>> whole = conversation;
  for (auto& tokens : whole) tokens.pop_back();  // the second turn's token, not yet computed
  prompt_turns(source, options, dir / "once", {whole}, kv_dtype);
}

// A resumed turn's first pass scores and keeps as H2O's prefill does: when the first turn evicted
// nothing, the entries kept after the second turn's prompt are the ones one prefill over the
// whole conversation keeps (the same tokens, budget and capacity), with the same scores within
// the rounding of the queries computed over stored rather than fresh keys.
TEST(H2oSession, AnExtensionKeepsWhatOnePrefillOverTheSameTokensKeeps) {
  const ModelSource source = session_model("llama-tiny");
  OffloadOptions options = session_options("h2o");
  // Capacity 10 in the first turn (9 kept of at most 9), 28 in the second: 25 slots for 27.
  options.h2o_budget = 0.9;
  TempDir dir("session-h2o");
  two_turns_and_one_prompt(source, options, dir.path());
  const SessionManifest turns = read_saved_session(dir.path() / "turns").manifest;
  const SessionManifest once = read_saved_session(dir.path() / "once").manifest;
  int64_t evicted = 0;
  for (int64_t l = 0; l < source.config.num_layers; ++l) {
    const auto a = SafetensorsFile::open((dir.path() / "turns" / turns.state[l].path).string());
    const auto b = SafetensorsFile::open((dir.path() / "once" / once.state[l].path).string());
    const SafetensorsEntry& tokens_a = *a->find("h2o_tokens");
    const SafetensorsEntry& tokens_b = *b->find("h2o_tokens");
    ASSERT_EQ(tokens_a.shape, tokens_b.shape);
    ASSERT_EQ(tokens_a.shape[2], 25);
    const auto* ta = static_cast<const int32_t*>(a->bytes(tokens_a));
    const auto* tb = static_cast<const int32_t*>(b->bytes(tokens_b));
    const auto* sa = static_cast<const float*>(a->bytes(*a->find("h2o_scores")));
    const auto* sb = static_cast<const float*>(b->bytes(*b->find("h2o_scores")));
    const size_t n = tokens_a.nbytes / sizeof(int32_t);
    EXPECT_EQ(std::vector<int32_t>(ta, ta + n), std::vector<int32_t>(tb, tb + n)) << "layer " << l;
    EXPECT_LT(testing_util::relative_error(sa, sb, n), 1e-3) << "layer " << l;
    // Each (sequence, head) kept 25 of its 27 tokens: 2 evicted, the oldest not always.
    for (size_t i = 0; i < n; ++i) evicted += ta[i] < 0 ? 0 : 1;
  }
  EXPECT_EQ(evicted, source.config.num_layers * 2 * source.config.kv_heads() * 25);
}

// One turn of turn_prompts(1) generating `gen_len` tokens, saved in a new session at `path`; the
// session's key.
SessionKey save_first_turn(const ModelSource& source, const OffloadOptions& options,
                           const fs::path& path, int64_t gen_len) {
  const SessionKey key = session_key(source, options, DType::F16, Device::Cpu);
  auto session = DiskSession::create(path, key);
  GenerationRequest request;
  request.prompts = session->turn_prompts(turn_prompts(1));
  request.gen_len = gen_len;
  run_offloaded(source, request, options, Device::Cpu, {}, session.get());
  return key;
}

// What an H2O store holds after a resume is what its session saved: each (sequence, head)'s kept
// tokens at the rows of the new layout, their scores, and their keys and values byte for byte.
TEST(H2oSession, RestoresTheEntriesItSaved) {
  TempDir dir("session-h2o");
  const ModelSource source = session_model("opt-tiny");
  OffloadOptions options = session_options("h2o");
  options.h2o_budget = 0.5;
  const fs::path path = dir.path() / "s";
  const SessionKey key = save_first_turn(source, options, path, 4);  // decode steps that evict
  OffloadOptions other = options;
  other.h2o_budget = 0.3;
  testing_util::expect_error(
      [&] { DiskSession::open(path, session_key(source, other, DType::F16, Device::Cpu)); },
      {"saved with --h2o-budget 0.5; this run has 0.3"});
  const SessionManifest saved = read_saved_session(path).manifest;
  auto session = DiskSession::open(path, key);
  const std::unique_ptr<ResumedStore> resumed = resume_store(*session, source, options);
  const auto& store = dynamic_cast<const H2oKv&>(*resumed->store);
  const int64_t B = store.batch(), H = source.config.kv_heads();
  for (int64_t l = 0; l < source.config.num_layers; ++l) {
    const auto file = SafetensorsFile::open((path / saved.state[l].path).string());
    const SafetensorsEntry& tokens = *file->find("h2o_tokens");
    const int64_t S = tokens.shape[2];
    const auto* token = static_cast<const int32_t*>(file->bytes(tokens));
    const auto* score = static_cast<const float*>(file->bytes(*file->find("h2o_scores")));
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t h = 0; h < H; ++h) {
        std::map<int32_t, float> expected;
        for (int64_t r = 0; r < S; ++r) {
          const int64_t at = (b * H + h) * S + r;
          if (token[at] >= 0) expected[resumed->first_valid[b] + token[at]] = score[at];
        }
        const std::vector<int32_t> kept = store.kept_tokens(l, b, h);
        const std::vector<float> scores = store.kept_scores(l, b, h);
        ASSERT_EQ(kept.size(), expected.size()) << l << " " << b << " " << h;
        for (size_t i = 0; i < kept.size(); ++i) {
          ASSERT_TRUE(expected.count(kept[i])) << "token " << kept[i];
          EXPECT_EQ(scores[i], expected[kept[i]]);
        }
      }
    }
  }
}

// A capped InfiniGen pool (--kv-pool-limit) keeps positions, not tokens: its session is its
// state, saved whole at every turn's end, and a resumed turn's first pass is an extension that
// keeps what the pool's eviction policy chooses among the held and the new tokens.
OffloadOptions capped_options(double limit, EvictionPolicy eviction = EvictionPolicy::Counter) {
  OffloadOptions options = session_options("infinigen");
  options.kv_pool_limit = limit;
  options.eviction = eviction;
  return options;
}

// A cap that never binds (a session's pool keeps capacity - 1 positions at a limit of 1) keeps
// every token in the order it came, through saves, restores and extensions: the uncapped pool's
// turns, with rows no load brought NaN.
TEST(CappedSession, ACapThatNeverBindsGivesTheUncappedTurns) {
  set_debug_poison(true);
  for (const std::string model : {"opt-tiny", "llama-tiny"}) {
    const ModelSource source = session_model(model);
    TempDir dir("session-capped");
    const Turns capped = run_session(source, capped_options(1.0), dir.path() / "capped");
    const Turns uncapped =
        run_session(source, session_options("infinigen"), dir.path() / "uncapped");
    EXPECT_EQ(capped.generated, uncapped.generated) << model;
    for (size_t turn = 0; turn < uncapped.last_logits.size(); ++turn) {
      const auto& got = capped.last_logits[turn];
      EXPECT_LT(
          testing_util::relative_error(got.data(), uncapped.last_logits[turn].data(), got.size()),
          1e-4)
          << model << ", turn " << turn + 1;
    }
    EXPECT_TRUE(read_saved_session(dir.path() / "capped").manifest.segments.empty());
  }
  set_debug_poison(false);
}

// Per (sequence, head) of layer `layer` of the capped session in `path`: its tokens (relative to
// the sequence's first row) and their eviction records.
std::vector<std::map<int32_t, int32_t>> saved_capped_rows(const fs::path& path, int64_t layer) {
  const SessionManifest manifest = read_saved_session(path).manifest;
  const auto file =
      SafetensorsFile::open((path / manifest.state[static_cast<size_t>(layer)].path).string());
  const SafetensorsEntry& tokens = *file->find("capped_tokens");
  const auto* token = static_cast<const int32_t*>(file->bytes(tokens));
  const auto* record = static_cast<const int32_t*>(file->bytes(*file->find("capped_records")));
  const int64_t rows = tokens.shape[0] * tokens.shape[1], S = tokens.shape[2];
  std::vector<std::map<int32_t, int32_t>> held(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows * S; ++i) {
    if (token[i] >= 0) held[static_cast<size_t>(i / S)][token[i]] = record[i];
  }
  return held;
}

// The same, of a resumed store.
std::vector<std::map<int32_t, int32_t>> held_capped_rows(const InfinigenKv& store, int64_t layer) {
  const CappedPool& pool = *store.capped_pool();
  const int64_t rows = store.batch() * store.pool().shape().num_heads, S = pool.slots();
  std::vector<int32_t> tokens(static_cast<size_t>(rows * S)), records(tokens.size());
  pool.save(layer, store.first_valid(), tokens.data(), records.data());
  std::vector<std::map<int32_t, int32_t>> held(static_cast<size_t>(rows));
  for (int64_t i = 0; i < rows * S; ++i) {
    if (tokens[static_cast<size_t>(i)] >= 0) {
      held[static_cast<size_t>(i / S)][tokens[static_cast<size_t>(i)]] =
          records[static_cast<size_t>(i)];
    }
  }
  return held;
}

// A resumed turn's first pass keeps as a prompt does: when the first turn evicted nothing, the
// tokens a capped pool holds after the second turn's prompt, with their eviction records (fetch
// counts, last fetches), are the ones one prompt over the whole conversation leaves (the same
// tokens, limit and capacity: 25 positions for 27 tokens), under each eviction policy. The KV is
// fp32, so that the held keys the extension scores are the prompt's own.
TEST(CappedSession, AnExtensionKeepsWhatOnePromptOverTheSameTokensKeeps) {
  const ModelSource source = session_model("llama-tiny");
  for (const EvictionPolicy eviction : kEvictionPolicies) {
    OffloadOptions options = capped_options(0.9, eviction);
    options.speculation = OffloadOptions{}.speculation;  // the default alpha: counts that differ
    TempDir dir("session-capped");
    two_turns_and_one_prompt(source, options, dir.path(), DType::F32);
    int64_t held = 0;
    for (int64_t l = 0; l < source.config.num_layers; ++l) {
      const auto turns = saved_capped_rows(dir.path() / "turns", l);
      EXPECT_EQ(turns, saved_capped_rows(dir.path() / "once", l))
          << eviction_policy_name(eviction) << ", layer " << l;
      for (const auto& row : turns) held += std::ssize(row);
    }
    EXPECT_EQ(held, source.config.num_layers * 2 * source.config.kv_heads() * 25);
  }
}

// What a capped store holds after a resume is what its session saved: each (sequence, head)'s
// tokens with their eviction records, their keys and values byte for byte, and the partial keys
// of the speculated layers derived from those keys again. Another limit or rule is refused.
TEST(CappedSession, RestoresThePositionsItSaved) {
  const ModelSource source = session_model("opt-tiny");
  for (const EvictionPolicy eviction : {EvictionPolicy::Counter, EvictionPolicy::Lru}) {
    OffloadOptions options = capped_options(0.5, eviction);
    options.speculation = OffloadOptions{}.speculation;
    TempDir dir("session-capped");
    const fs::path path = dir.path() / "s";
    // Decode steps that evict: 6 positions for up to 12 tokens.
    const SessionKey key = save_first_turn(source, options, path, 4);
    OffloadOptions other = options;
    other.kv_pool_limit = 0.3;
    testing_util::expect_error(
        [&] { DiskSession::open(path, session_key(source, other, DType::F16, Device::Cpu)); },
        {"saved with --kv-pool-limit 0.5; this run has 0.3"});
    other = options;
    other.eviction = EvictionPolicy::Fifo;
    testing_util::expect_error(
        [&] { DiskSession::open(path, session_key(source, other, DType::F16, Device::Cpu)); },
        {"saved with --eviction", "this run has fifo"});
    const SessionManifest saved = read_saved_session(path).manifest;
    auto session = DiskSession::open(path, key);
    const std::unique_ptr<ResumedStore> resumed = resume_store(*session, source, options);
    const auto& store = dynamic_cast<const InfinigenKv&>(*resumed->store);
    const int64_t B = store.batch(), H = source.config.kv_heads(), d = source.config.head_dim();
    for (int64_t l = 0; l < source.config.num_layers; ++l) {
      const auto expected = saved_capped_rows(path, l);
      EXPECT_EQ(held_capped_rows(store, l), expected) << "layer " << l;
      const auto file = SafetensorsFile::open((path / saved.state[l].path).string());
      const SafetensorsEntry& tokens = *file->find("capped_tokens");
      const int64_t S = tokens.shape[2];
      const auto* token = static_cast<const int32_t*>(file->bytes(tokens));
      const auto* keys = static_cast<const char*>(file->bytes(*file->find("capped_keys")));
      const auto* values = static_cast<const char*>(file->bytes(*file->find("capped_values")));
      const size_t row_bytes = static_cast<size_t>(d) * 2;
      int64_t evicted_somewhere = 0;
      for (int64_t b = 0; b < B; ++b) {
        for (int64_t h = 0; h < H; ++h) {
          for (int64_t p = 0; p < store.capped_pool()->slots(); ++p) {
            const int32_t at = store.token_at(l, b, h, p);
            if (at < 0) continue;
            const int64_t relative = at - resumed->first_valid[static_cast<size_t>(b)];
            int64_t from = -1;
            for (int64_t q = 0; q < S; ++q) {
              if (token[(b * H + h) * S + q] == relative) from = (b * H + h) * S + q;
            }
            ASSERT_GE(from, 0);
            EXPECT_EQ(std::memcmp(store.pool().row(l, KvKind::Key, b, h, p),
                                  keys + static_cast<size_t>(from) * row_bytes, row_bytes),
                      0);
            EXPECT_EQ(std::memcmp(store.pool().row(l, KvKind::Value, b, h, p),
                                  values + static_cast<size_t>(from) * row_bytes, row_bytes),
                      0);
            evicted_somewhere += relative > p ? 1 : 0;
            if (l < options.speculation.dense_layers) continue;
            std::vector<float> row(static_cast<size_t>(d));
            convert_to_f32(keys + static_cast<size_t>(from) * row_bytes, DType::F16, row.data(),
                           row.size());
            const PartialLayer& partial = store.partial(l);
            std::vector<float> want(static_cast<size_t>(partial.r()));
            partial.partial_of(row.data(), h, want.data());
            const std::vector<float> got = partial.partial_key(b, h, p);
            EXPECT_LT(testing_util::relative_error(got.data(), want.data(), want.size()), 1e-3);
          }
        }
      }
      EXPECT_GT(evicted_somewhere, 0) << "layer " << l;  // decode steps overwrote victims
    }
  }
}

// A pool of fewer positions than its session saved (a later turn whose share of a shorter
// capacity is smaller) keeps what its policy would: under fifo, each row's newest tokens.
TEST(CappedSession, AResumeIntoFewerPositionsKeepsWhatThePolicyKeeps) {
  const ModelSource source = session_model("opt-tiny");
  const OffloadOptions options = capped_options(0.5, EvictionPolicy::Fifo);
  TempDir dir("session-capped");
  const fs::path path = dir.path() / "s";
  const SessionKey key = save_first_turn(source, options, path, 4);
  OffloadOptions smaller = options;
  smaller.kv_pool_limit = 0.25;  // 4 positions of 18, where 6 were saved
  auto session = DiskSession::open(path, key);
  const std::unique_ptr<ResumedStore> resumed = resume_store(*session, source, smaller);
  const auto& store = dynamic_cast<const InfinigenKv&>(*resumed->store);
  ASSERT_EQ(store.capped_pool()->slots(), 4);
  for (int64_t l = 0; l < source.config.num_layers; ++l) {
    const auto saved = saved_capped_rows(path, l);
    const auto held = held_capped_rows(store, l);
    for (size_t row = 0; row < saved.size(); ++row) {
      ASSERT_EQ(saved[row].size(), 6u);
      std::map<int32_t, int32_t> newest(std::next(saved[row].begin(), 2), saved[row].end());
      EXPECT_EQ(held[row], newest) << "layer " << l << ", row " << row;
    }
  }
}

// On a CUDA device (the emulated one in CI) the pools of `full`, `int4`, `infinigen` and `h2o` are
// pinned host memory that a session reads and writes as on the CPU (InfiniGen's partial keys, on
// the device, are copied to the host before a save reads them, as `gpu`'s whole KV is, and a resume
// copies `gpu`'s back; H2O's scores and tokens on the device are copied both ways, and its resumed
// turn's first pass scores on the host, as a capped InfiniGen pool's does): three turns give the
// CPU's tokens, and logits within the backends' rounding. The int4 codec is bit for bit the CPU's
// but the GEMMs are not, and a key that rounds differently may take the next code
// (llama-tiny: 1.3e-3 in the first turn already, 2e-3 by the third).
TEST(SessionGpu, ContinuesAConversationAsTheCpuDoes) {
  INFINIGEN_SKIP_WITHOUT_CUDA_DEVICE();
  set_debug_poison(true);  // rows no load brought are NaN
  for (const std::string model : {"opt-tiny", "llama-tiny"}) {
    for (const std::string policy : {"int4", "full", "infinigen", "gpu", "h2o", "capped"}) {
      const ModelSource source = session_model(model);
      // "capped": infinigen under a pool limit, whose decode steps and extensions evict.
      const OffloadOptions options =
          policy == "capped" ? capped_options(0.6) : session_options(policy);
      TempDir dir("session-gpu");
      const Turns cpu = run_session(source, options, dir.path() / "cpu");
      const Turns cuda =
          run_session(source, options, dir.path() / "cuda", Sharing::None, Device::Cuda);
      EXPECT_EQ(cuda.generated, cpu.generated) << model << ", " << policy;
      for (size_t turn = 0; turn < cpu.last_logits.size(); ++turn) {
        const auto& got = cuda.last_logits[turn];
        EXPECT_LT(
            testing_util::relative_error(got.data(), cpu.last_logits[turn].data(), got.size()),
            policy == "int4" ? 1e-2 : 1e-3)
            << model << ", " << policy << ", turn " << turn + 1;
      }
      // What the device's session saved is the CPU's: every fp16 stream (keys, values, InfiniGen's
      // partial keys from the device, int4's scales) of every segment, within the same rounding.
      const SessionManifest saved = read_saved_session(dir.path() / "cpu").manifest;
      for (const SessionSegment& segment : saved.segments) {
        for (const SessionFile& file : segment.layers) {
          const auto on_cpu = SafetensorsFile::open((dir.path() / "cpu" / file.path).string());
          const auto on_cuda = SafetensorsFile::open((dir.path() / "cuda" / file.path).string());
          for (const SafetensorsEntry& entry : on_cpu->entries()) {
            if (entry.dtype != DType::F16) continue;
            const SafetensorsEntry* other = on_cuda->find(entry.name);
            ASSERT_TRUE(other != nullptr && other->shape == entry.shape) << file.path;
            std::vector<float> a(entry.nbytes / 2), b(a.size());
            convert_to_f32(on_cuda->bytes(*other), DType::F16, a.data(), a.size());
            convert_to_f32(on_cpu->bytes(entry), DType::F16, b.data(), b.size());
            EXPECT_LT(testing_util::relative_error(a.data(), b.data(), a.size()), 1e-2)
                << model << ", " << policy << ", " << file.path << " " << entry.name;
          }
        }
      }
    }
  }
  set_debug_poison(false);
}

// A session of opt-tiny with `policy` after one turn, in `dir`/s.
fs::path saved_session(const TempDir& dir, const std::string& policy = "full") {
  const ModelSource source = session_model("opt-tiny");
  const OffloadOptions options = session_options(policy);
  const fs::path path = dir.path() / "s";
  auto session = DiskSession::create(path, session_key(source, options, DType::F16, Device::Cpu));
  GenerationRequest request;
  request.prompts = session->turn_prompts(turn_prompts(1));
  request.gen_len = 4;
  run_offloaded(source, request, options, Device::Cpu, {}, session.get());
  return path;
}

// Resumes the session at `path` with opt-tiny and `policy`.
void resume(const fs::path& path, const std::string& policy = "full",
            const std::string& model = "opt-tiny") {
  const ModelSource source = session_model(model);
  const OffloadOptions options = session_options(policy);
  auto session = DiskSession::open(path, session_key(source, options, DType::F16, Device::Cpu));
  GenerationRequest request;
  request.prompts = session->turn_prompts(turn_prompts(2));
  request.gen_len = 3;
  run_offloaded(source, request, options, Device::Cpu, {}, session.get());
}

// Every damage below is refused with one line naming it, and leaves the manifest as it was.
void expect_refused(const fs::path& path, const std::vector<std::string>& fragments,
                    const std::string& policy = "full", const std::string& model = "opt-tiny") {
  const std::string manifest = read_bytes(path / "manifest.json");
  testing_util::expect_error([&] { resume(path, policy, model); }, fragments);
  EXPECT_EQ(read_bytes(path / "manifest.json"), manifest);
}

TEST(SessionFiles, DamageIsRefusedWithOneLine) {
  TempDir dir("session");
  const fs::path path = saved_session(dir);
  const fs::path layer = path / "seg-000001" / "layer-001.safetensors";
  const std::string original = read_bytes(layer);
  ASSERT_GT(original.size(), 200u);

  write_bytes(layer, original.substr(0, original.size() - 7));  // truncated
  expect_refused(path, {"layer-001.safetensors", "the manifest says"});
  std::string flipped = original;
  flipped[20] ^= 0x04;  // in the safetensors header
  write_bytes(layer, flipped);
  expect_refused(path, {"layer-001.safetensors", "checksum mismatch"});
  flipped = original;
  flipped[original.size() - 3] ^= 0x40;  // in the keys and values
  write_bytes(layer, flipped);
  expect_refused(path, {"layer-001.safetensors", "checksum mismatch"});
  write_bytes(layer, original);
  resume(path);  // whole again: it resumes (and saves turn 2)

  fs::remove(path / "seg-000002" / "layer-000.safetensors");
  expect_refused(path, {"layer-000.safetensors", "missing"});
}

TEST(SessionFiles, ADamagedManifestIsRefused) {
  TempDir dir("session");
  const fs::path path = saved_session(dir);
  const std::string manifest = read_bytes(path / "manifest.json");
  // Every byte that matters is covered: a token id, a file's checksum, the checksum itself.
  for (const std::string& field : {std::string("\"crc32\": \""), std::string("\"checksum\": \""),
                                   std::string("\"sequences\": [\n  [\n   ")}) {
    std::string damaged = manifest;
    const size_t at = damaged.find(field);
    ASSERT_NE(at, std::string::npos) << field;
    char& c = damaged[at + field.size()];
    c = c == '1' ? '2' : '1';
    write_bytes(path / "manifest.json", damaged);
    expect_refused(path, {"manifest.json", "checksum mismatch"});
  }
  write_bytes(path / "manifest.json", manifest.substr(0, manifest.size() / 2));
  expect_refused(path, {"manifest.json", "not valid JSON"});
}

// Replaces the manifest of the session at `path` by `edit` of it, its checksum made to match (as
// a build that wrote it would have).
void rewrite_manifest(const fs::path& path, const std::function<void(nlohmann::json&)>& edit) {
  nlohmann::json manifest = nlohmann::json::parse(read_bytes(path / "manifest.json"));
  edit(manifest);
  manifest.erase("checksum");
  manifest["checksum"] = hex32(crc32_of(manifest.dump()));
  write_bytes(path / "manifest.json", manifest.dump(1) + "\n");
}

// A session of another format version, newer or older than this build reads, is refused with
// one line that says which and what to do; the session is left as it was.
TEST(SessionFiles, AnotherFormatVersionIsRefusedWithOneLine) {
  TempDir dir("session");
  const fs::path path = saved_session(dir);
  const std::string manifest = read_bytes(path / "manifest.json");
  rewrite_manifest(path, [](nlohmann::json& m) { m["version"] = 2; });
  expect_refused(path, {"manifest.json", "session format version 2 was written by a newer",
                        "this build reads version 1", "continue it with that one"});
  rewrite_manifest(path, [](nlohmann::json& m) { m["version"] = 0; });
  expect_refused(path, {"manifest.json", "session format version 0 is older than this build reads",
                        "start a new session"});
  rewrite_manifest(path, [](nlohmann::json& m) { m.erase("version"); });
  expect_refused(path, {"manifest.json", "no session format version"});
  rewrite_manifest(path, [](nlohmann::json& m) { m["version"] = "1"; });
  expect_refused(path, {"manifest.json", "no session format version"});
  write_bytes(path / "manifest.json", manifest);
  resume(path);  // this build's version resumes
}

// A segment file that is not what a save writes, although the manifest's size and checksum match
// it (written so by something else), is refused with one line naming it.
TEST(SessionFiles, AMalformedSegmentIsRefusedWithOneLine) {
  TempDir dir("session");
  const fs::path path = saved_session(dir);
  const std::string manifest = read_bytes(path / "manifest.json");
  const std::string relative = "seg-000001/layer-001.safetensors";
  const fs::path layer = path / relative;
  const std::string original = read_bytes(layer);
  // The manifest's record of the layer file made to match what is there now.
  const auto record_layer_file = [&] {
    rewrite_manifest(path, [&](nlohmann::json& m) {
      for (auto& file : m["segments"][0]["files"]) {
        if (file["path"] != relative) continue;
        const SessionFile now = session_file(path, relative);
        file["bytes"] = now.bytes;
        file["crc32"] = hex32(now.crc32);
      }
    });
  };
  write_bytes(layer, original.substr(0, 5));  // not a safetensors file
  record_layer_file();
  expect_refused(path, {"layer-001.safetensors"});
  write_bytes(layer, original.substr(0, original.size() / 2));  // its data cut short
  record_layer_file();
  expect_refused(path, {"layer-001.safetensors"});
  // A safetensors file of other tensors: values missing, keys of another shape.
  write_safetensors(layer.string(), {{"keys", Tensor::zeros({1, 2, 3, 4}, DType::F16)}});
  record_layer_file();
  expect_refused(path, {"layer-001.safetensors", "no tensor keys", "the session is corrupt"});
  write_bytes(layer, original);
  write_bytes(path / "manifest.json", manifest);
  resume(path);
}

// A capped pool's state that is damaged yet checksummed as written (a bug's damage, not the
// disk's) is refused with one line naming what: a tensor missing or of another shape, a token
// outside its sequence's rows or held twice, a negative eviction record.
TEST(CappedSession, ADamagedStateIsRefusedWithOneLine) {
  const ModelSource source = session_model("opt-tiny");
  const OffloadOptions options = capped_options(0.5);
  TempDir dir("session-capped");
  const fs::path path = dir.path() / "s";
  const SessionKey key = save_first_turn(source, options, path, 4);
  const std::string manifest = read_bytes(path / "manifest.json");
  const std::string relative = read_saved_session(path).manifest.state[0].path;
  const fs::path file = path / relative;
  const std::string original = read_bytes(file);
  using State = std::vector<std::pair<std::string, Tensor>>;
  const auto tensor = [](State& state, const std::string& name) -> Tensor& {
    const auto at = std::find_if(state.begin(), state.end(),
                                 [&](const auto& entry) { return entry.first == name; });
    EXPECT_NE(at, state.end()) << name;
    return at->second;
  };
  // Layer 0's state edited, written and recorded in the manifest as written; then a resumed turn
  // must refuse it with one line holding `fragments`, and the session is put back.
  const auto expect_refused_after = [&](const std::function<void(State&)>& edit,
                                        const std::vector<std::string>& fragments) {
    State state;
    {
      const auto opened = SafetensorsFile::open(file.string());
      for (const SafetensorsEntry& entry : opened->entries()) {
        Tensor t = Tensor::empty(entry.shape, entry.dtype);
        std::memcpy(t.raw(), opened->bytes(entry), entry.nbytes);
        state.emplace_back(entry.name, std::move(t));
      }
    }
    edit(state);
    write_safetensors(file.string(), state);
    rewrite_manifest(path, [&](nlohmann::json& m) {
      for (auto& record : m["state"]) {
        if (record["path"] != relative) continue;
        const SessionFile now = session_file(path, relative);
        record["bytes"] = now.bytes;
        record["crc32"] = hex32(now.crc32);
      }
    });
    testing_util::expect_error(
        [&] {
          auto session = DiskSession::open(path, key);
          GenerationRequest request;
          request.prompts = session->turn_prompts(turn_prompts(2));
          request.gen_len = 2;
          run_offloaded(source, request, options, Device::Cpu, {}, session.get());
        },
        fragments);
    write_bytes(file, original);
    write_bytes(path / "manifest.json", manifest);
  };
  expect_refused_after(
      [](State& s) {
        std::erase_if(s, [](const auto& entry) { return entry.first == "capped_records"; });
      },
      {"layer 0", "no capped_records"});
  expect_refused_after(
      [&](State& s) {
        tensor(s, "capped_keys") = Tensor::zeros({1, 2, 3, 4}, DType::F16);
      },
      {"layer 0", "capped_keys is F16", "the session is corrupt"});
  expect_refused_after([&](State& s) { tensor(s, "capped_tokens").data<int32_t>()[0] = 1000; },
                       {"layer 0", "holds token 1000", "the session is corrupt"});
  expect_refused_after(
      [&](State& s) {
        int32_t* tokens = tensor(s, "capped_tokens").data<int32_t>();
        tokens[1] = tokens[0];
      },
      {"layer 0", "twice", "the session is corrupt"});
  expect_refused_after([&](State& s) { tensor(s, "capped_records").data<int32_t>()[0] = -3; },
                       {"layer 0", "eviction record -3", "the session is corrupt"});
  // Put back, it resumes.
  auto session = DiskSession::open(path, key);
  GenerationRequest request;
  request.prompts = session->turn_prompts(turn_prompts(2));
  request.gen_len = 2;
  EXPECT_NO_THROW(run_offloaded(source, request, options, Device::Cpu, {}, session.get()));
}

TEST(SessionFiles, AnotherModelPolicyOrOptionIsRefused) {
  TempDir dir("session");
  const fs::path path = saved_session(dir, "infinigen");
  expect_refused(path, {"saved with another model"}, "infinigen", "llama-tiny");
  expect_refused(path, {"saved with --policy infinigen, not full"}, "full");
  const ModelSource source = session_model("opt-tiny");
  OffloadOptions options = session_options("infinigen");
  options.speculation.partial_ratio = 0.5;
  testing_util::expect_error(
      [&] { DiskSession::open(path, session_key(source, options, DType::F16, Device::Cpu)); },
      {"saved with --partial-ratio 0.3; this run has 0.5"});
  testing_util::expect_error(
      [&] {
        DiskSession::open(
            path, session_key(source, session_options("infinigen"), DType::F32, Device::Cpu));
      },
      {"saved with KV dtype F16, not F32"});
  testing_util::expect_error(
      [&] {
        DiskSession::create(path,
                            session_key(source, session_options("full"), DType::F16, Device::Cpu));
      },
      {"already holds a session"});
}

// A session written before an option was part of the key (infinigen's --kv-pool-limit and
// --eviction) counts as written with its default: it opens with the defaults, and another value
// is refused with one line.
TEST(SessionFiles, OptionsRecordedLaterCountAsTheirDefaults) {
  TempDir dir("session");
  const fs::path path = saved_session(dir, "infinigen");
  rewrite_manifest(path, [](nlohmann::json& manifest) {
    manifest["key"]["options"].erase("kv_pool_limit");
    manifest["key"]["options"].erase("eviction");
  });
  const ModelSource source = session_model("opt-tiny");
  OffloadOptions options = session_options("infinigen");
  EXPECT_NO_THROW(DiskSession::open(path, session_key(source, options, DType::F16, Device::Cpu)));
  options.kv_pool_limit = 0.5;
  testing_util::expect_error(
      [&] { DiskSession::open(path, session_key(source, options, DType::F16, Device::Cpu)); },
      {"saved with --kv-pool-limit 0; this run has 0.5"});
}

TEST(SessionFiles, InfinigenStateIsSavedAndRestored) {
  TempDir dir("session");
  const fs::path path = saved_session(dir, "infinigen");
  // opt-tiny: layers past the two dense ones keep their partial columns and weights.
  EXPECT_FALSE(fs::exists(path / "seg-000001" / "state-000.safetensors"));
  EXPECT_TRUE(fs::exists(path / "seg-000001" / "state-002.safetensors"));
  const auto state =
      SafetensorsFile::open((path / "seg-000001" / "state-002.safetensors").string());
  EXPECT_NE(state->find("partial_columns"), nullptr);
  EXPECT_NE(state->find("partial_weight"), nullptr);
  const auto layer =
      SafetensorsFile::open((path / "seg-000001" / "layer-002.safetensors").string());
  EXPECT_NE(layer->find("partial_keys"), nullptr);
  // At the default alpha the resumed turn speculates from the restored state.
  const ModelSource source = session_model("opt-tiny");
  OffloadOptions options;
  options.policy = "infinigen";
  options.speculation.partial_ratio = 0.3;
  auto session = DiskSession::open(path, session_key(source, options, DType::F16, Device::Cpu));
  GenerationRequest request;
  request.prompts = session->turn_prompts(turn_prompts(2));
  request.gen_len = 6;
  const OffloadRun run = run_offloaded(source, request, options, Device::Cpu, {}, session.get());
  EXPECT_EQ(run.result.tokens.size(), 3u);
}

// What InfiniGen's speculation reads after a resume is what the session saved: the partial keys
// of every history token, at the rows the new layout puts them.
TEST(SessionFiles, RestoredPartialKeysAreTheSavedOnes) {
  TempDir dir("session");
  const fs::path path = saved_session(dir, "infinigen");
  const ModelSource source = session_model("opt-tiny");
  const OffloadOptions options = session_options("infinigen");
  auto session = DiskSession::open(path, session_key(source, options, DType::F16, Device::Cpu));
  const int64_t B = std::ssize(session->history());
  const std::unique_ptr<ResumedStore> resumed = resume_store(*session, source, options);
  const std::unique_ptr<KvStore>& store = resumed->store;
  const std::vector<int32_t>& first_valid = resumed->first_valid;

  const auto& infinigen = dynamic_cast<const InfinigenKv&>(*store);
  const auto saved =
      SafetensorsFile::open((path / "seg-000001" / "layer-002.safetensors").string());
  const SafetensorsEntry& keys = *saved->find("partial_keys");  // (B, H, R, r), the key dtype
  EXPECT_EQ(keys.dtype, SpeculationOptions{}.partial_key_dtype);
  const int64_t H = keys.shape[1], R = keys.shape[2], r = keys.shape[3];
  std::vector<float> widened(keys.nbytes / dtype_size(keys.dtype));
  convert_to_f32(saved->bytes(keys), keys.dtype, widened.data(), widened.size());
  const float* data = widened.data();
  const std::vector<std::vector<int32_t>> prompts = turn_prompts(1);
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t j = 0; j < std::ssize(prompts[b]); ++j) {
        const std::vector<float> restored =
            infinigen.partial(2).partial_key(b, h, first_valid[b] + j);
        for (int64_t c = 0; c < r; ++c) {
          ASSERT_EQ(restored[c], data[((b * H + h) * R + j) * r + c]) << b << " " << h << " " << j;
        }
      }
    }
  }
}

// The cost model prices the reads a resumed turn makes: its disk lane carries the bytes a real
// turn reads (the files' headers aside), one read per layer, each before the layer's pass.
// H2O's state is priced at this turn's slots (its budget's share of this turn's capacity, 15
// tokens here), where the session saved the last turn's (of 9): an upper bound, by that ratio.
TEST(SessionCostModel, DiskBytesAreTheRuntimes) {
  for (const std::string policy : {"full", "infinigen", "int4", "h2o"}) {
    TempDir dir("session");
    const ModelSource source = session_model("opt-tiny");
    const OffloadOptions options = session_options(policy);
    const fs::path path = dir.path() / "s";
    const SessionKey key = session_key(source, options, DType::F16, Device::Cpu);
    GenerationRequest request;
    {
      auto session = DiskSession::create(path, key);
      request.prompts = session->turn_prompts({{2, 10, 11, 12, 13, 14}, {2, 20, 21, 22, 23, 24}});
      request.gen_len = 3;
      run_offloaded(source, request, options, Device::Cpu, {}, session.get());
    }
    auto session = DiskSession::open(path, key);
    request.prompts = session->turn_prompts({{30, 31, 32}, {33, 34, 35}});
    run_offloaded(source, request, options, Device::Cpu, {}, session.get());
    const int64_t files = policy == "h2o"
                              ? source.config.num_layers
                              : 2 * source.config.num_layers + (policy == "infinigen" ? 2 : 0);

    CostModelInput input;
    input.config = source.config;
    input.batch = 2;
    input.history_len = 6 + 3 - 1;  // the first turn's prompt and generated tokens but the last
    input.prompt_len = 4;           // that last token and the three new ones
    input.gen_len = 3;
    input.options = options;
    input.fetched.fraction.assign(static_cast<size_t>(source.config.num_layers), 1.0);
    const Schedule schedule = run_schedule(input);
    uint64_t disk = 0;
    int64_t reads = 0;
    for (const ScheduledOp& op : schedule.ops) {
      if (op.lane != Lane::Disk) continue;
      disk += op.disk_bytes;
      ++reads;
    }
    EXPECT_EQ(reads, source.config.num_layers) << policy;
    const uint64_t read = session->stats().bytes_read;
    if (policy == "h2o") {
      // Slots 3 (0.2 of 15) priced, 2 (at least 2 of 9) saved.
      EXPECT_GE(disk + 512 * static_cast<uint64_t>(files), read);
      EXPECT_LE(disk, read * 3 / 2);
      continue;
    }

    EXPECT_LE(disk, read) << policy;
    EXPECT_GE(disk + 512 * static_cast<uint64_t>(files), read) << policy;
  }
}

// Where the disk outruns recomputation (a GQA model on the A6000's assumed NVMe), the predicted
// resumed turn reaches its first token sooner than a prefill of the whole conversation.
TEST(SessionCostModel, AResumedTurnOfAGqaModelBeatsRecomputingOnTheA6000) {
  CostModelInput input;
  input.config = load_preset("llama-3.1-8b");
  input.batch = 8;
  input.gen_len = 2;
  input.options.policy = "full";
  input.prompt_len = 1616;
  const HardwareProfile a6000 = load_hardware_profile("rtx-a6000-pcie3");
  const double recomputed = predict_run(input, a6000).prefill_s;
  input.history_len = 1552;
  input.prompt_len = 64;
  const double resumed = predict_run(input, a6000).prefill_s;
  EXPECT_LT(resumed, recomputed / 2);
  // Reading 1552 tokens' KV at the profile's disk rate bounds it from below.
  const double bytes = 2.0 * 32 * 8 * 128 * 2 * 1552 * 8;
  EXPECT_GT(resumed, bytes / a6000.disk_read_bytes_per_s);
}

TEST(SessionFiles, AConversationBeyondTheContextIsRefused) {
  TempDir dir("session");
  const fs::path path = saved_session(dir);
  const ModelSource source = session_model("opt-tiny");
  auto session = DiskSession::open(
      path, session_key(source, session_options("full"), DType::F16, Device::Cpu));
  GenerationRequest request;
  request.prompts = session->turn_prompts(turn_prompts(2));
  request.gen_len = source.config.max_positions;
  testing_util::expect_error(
      [&] {
        run_offloaded(source, request, session_options("full"), Device::Cpu, {}, session.get());
      },
      {"sequence 1: the conversation reaches", "exceed the model's context"});
}

// A save killed at any moment leaves the previous session whole: the next resume reads it.
TEST(SessionCli, ASaveKilledAtRandomLeavesThePreviousSessionLoadable) {
  TempDir dir("session");
  const std::string path = (dir.path() / "s").string();
  const std::vector<std::string> common = {"run",  "--model",   "builtin", "--policy",
                                           "full", "--gen-len", "16",      "--json"};
  // Generous: under the sanitizers, beside other tests, a turn takes many times its usual time.
  const auto patient = testing_util::ChildOptions().timeout(600);
  auto args = common;
  args.insert(args.end(), {"--prompt-len", "400", "--batch", "4", "--session", path});
  ASSERT_EQ(testing_util::run_infinigen_measured(args, patient).exit_code, 0);
  // A turn's save runs in its second half (the first pass's rows while decoding, the rest and
  // the manifest at the end): the kills land there, timed from an unkilled turn.
  args = common;
  args.insert(args.end(), {"--prompt-len", "120", "--resume", path});
  const auto whole = testing_util::run_infinigen_measured(args, patient);
  ASSERT_EQ(whole.exit_code, 0) << whole.err;
  const ModelSource source = resolve_model("builtin", {});
  OffloadOptions options;
  options.policy = "full";
  const SessionKey key = session_key(source, options, DType::F16, Device::Cpu);
  std::mt19937 rng(7);
  int killed = 0;
  // Six kills in the second half of a turn; a machine that got faster since the unkilled turn
  // (other tests finished) may let them all come too late, and then earlier ones follow. Each
  // kill that came after the turn ended halves the time the next ones are drawn from, so a turn
  // timed while the machine was many times busier than now still gets kills that land.
  double turn_seconds = whole.seconds;
  for (int attempt = 0; attempt < 6 || (killed == 0 && attempt < 12); ++attempt) {
    testing_util::BackgroundInfinigen child(args);
    const double from = attempt < 6 ? 0.5 : 0.2;
    const double at = turn_seconds * (from + 0.6 * static_cast<double>(rng() % 1000) / 1000.0);
    std::this_thread::sleep_for(std::chrono::duration<double>(at));
    double seconds = 0.0;
    const bool landed = child.signal_and_wait(SIGKILL, 10.0, &seconds).exit_code == -1;
    killed += landed ? 1 : 0;
    if (!landed) turn_seconds /= 2;
    // The session the kill left, old or new, is whole.
    const auto session = DiskSession::open(path, key);
    session->verify();
    EXPECT_EQ(session->batch(), 4);
  }
  EXPECT_GT(killed, 0);  // some kills landed before the end
  args = common;
  args.insert(args.end(), {"--prompt-len", "3", "--resume", path});
  const auto resumed = testing_util::run_infinigen_measured(args, patient);
  EXPECT_EQ(resumed.exit_code, 0) << resumed.err;
}

// A save that cannot be written (a full disk: here a file size limit) ends with one line and
// leaves the session as it was; the next turn that can write resumes it.
TEST(SessionCli, AFullDiskLeavesTheSessionAsItWas) {
  TempDir dir("session");
  const std::string path = (dir.path() / "s").string();
  const std::vector<std::string> common = {"run",  "--model",   "builtin", "--policy",
                                           "full", "--gen-len", "4"};
  auto args = common;
  args.insert(args.end(), {"--prompt-len", "100", "--batch", "2", "--session", path});
  ASSERT_EQ(testing_util::run_infinigen_measured(args, testing_util::ChildOptions().timeout(600))
                .exit_code,
            0);
  const std::string manifest = read_bytes(fs::path(path) / "manifest.json");
  args = common;
  args.insert(args.end(), {"--prompt-len", "100", "--resume", path});
  testing_util::expect_one_line_failure(
      args, testing_util::ChildOptions().timeout(600).file_limit(20000), {"write failed"});
  EXPECT_EQ(read_bytes(fs::path(path) / "manifest.json"), manifest);
  const auto resumed =
      testing_util::run_infinigen_measured(args, testing_util::ChildOptions().timeout(600));
  EXPECT_EQ(resumed.exit_code, 0) << resumed.err;
  // What the failed save left is gone: two turns, two segments each.
  int segments = 0;
  for (const auto& entry : fs::directory_iterator(path)) {
    segments += entry.path().filename().string().rfind("seg-", 0) == 0 ? 1 : 0;
  }
  EXPECT_EQ(segments, 4);
}

// Ctrl-C during a resumed turn stops it with status 130 and keeps the session as it was.
TEST(SessionCli, AnInterruptedTurnKeepsTheSession) {
  TempDir dir("session");
  const std::string path = (dir.path() / "s").string();
  const std::vector<std::string> common = {"run", "--model", "builtin", "--policy", "full"};
  auto args = common;
  args.insert(args.end(),
              {"--prompt-len", "100", "--batch", "2", "--gen-len", "4", "--session", path});
  ASSERT_EQ(testing_util::run_infinigen_measured(args, testing_util::ChildOptions().timeout(600))
                .exit_code,
            0);
  const std::string manifest = read_bytes(fs::path(path) / "manifest.json");
  args = common;
  args.insert(args.end(), {"--prompt-len", "100", "--gen-len", "1000", "--resume", path});
  testing_util::BackgroundInfinigen child(args);
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  double seconds = 0.0;
  const auto stopped = child.signal_and_wait(SIGINT, 10.0, &seconds);
  EXPECT_EQ(stopped.exit_code, 130) << stopped.err;
  EXPECT_EQ(read_bytes(fs::path(path) / "manifest.json"), manifest);
  args = common;
  args.insert(args.end(), {"--prompt-len", "3", "--gen-len", "2", "--resume", path});
  const auto resumed =
      testing_util::run_infinigen_measured(args, testing_util::ChildOptions().timeout(600));
  EXPECT_EQ(resumed.exit_code, 0) << resumed.err;
}

// Ctrl-C while a new session's first save runs (its writer saves the prompt's rows during the
// decode steps) saves nothing: no segment files are left, and no directory.
TEST(SessionCli, AnInterruptedFirstTurnLeavesNothing) {
  TempDir dir("session");
  const fs::path path = dir.path() / "s";
  testing_util::BackgroundInfinigen child({"run", "--model", "builtin", "--policy", "full",
                                           "--prompt-len", "200", "--batch", "8", "--gen-len",
                                           "1800", "--session", path.string()});
  // Until the first save has written something (the prompt's segment directory).
  for (int i = 0; i < 200 && !fs::exists(path); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_TRUE(fs::exists(path)) << "the first save never started";
  double seconds = 0.0;
  const auto stopped = child.signal_and_wait(SIGINT, 10.0, &seconds);
  EXPECT_EQ(stopped.exit_code, 130) << stopped.err;
  EXPECT_FALSE(fs::exists(path)) << "an interrupted first turn left " << path;
}

TEST(SessionCli, BadUsesEndWithOneLine) {
  TempDir dir("session");
  const std::string path = (dir.path() / "s").string();
  testing_util::expect_one_line_error({"run", "--model", "opt-tiny", "--prompt-len", "4",
                                       "--resume", (dir.path() / "none").string()},
                                      {"no session here"});
  fs::create_directories(dir.path() / "notes");
  std::ofstream(dir.path() / "notes" / "todo.txt") << "keep me\n";
  testing_util::expect_one_line_error(
      {"run", "--model", "opt-tiny", "--prompt-len", "4", "--policy", "full", "--session",
       (dir.path() / "notes").string()},
      {"holds todo.txt", "needs an empty directory"});
  EXPECT_TRUE(fs::exists(dir.path() / "notes" / "todo.txt"));
  testing_util::expect_one_line_error(
      {"run", "--model", "opt-tiny", "--prompt-len", "4", "--policy", "full", "--kv-pool-limit",
       "0.5", "--session", path},
      {"--kv-pool-limit"});
}

}  // namespace
}  // namespace infinigen
