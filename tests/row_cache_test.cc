// tests: InfiniGen's row cache (offload/row_cache.h): with it the tokens and every step's logits
// are bitwise those without it (OPT and Llama's grouped queries, left padding, shared prefixes,
// sequences leaving the batch), with the cache's unwritten rows NaN; the link carries exactly the
// rows it did not hold; the planner counts it and drops it where it does not fit; a dry run
// prices the replayed share; bad values get one line.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/device.h"
#include "offload/memory_planner.h"
#include "offload/run_summary.h"
#include "offload/runtime.h"
#include "predict/cost_model.h"
#include "predict/hardware_profile.h"
#include "tests/test_util.h"

namespace infinigen {
namespace {

OffloadOptions infinigen_options(RowCacheUse row_cache, double alpha = 1.0,
                                 int64_t max_num_kv = 5) {
  OffloadOptions options;
  options.policy = "infinigen";
  options.kv_block_tokens = 4;
  options.row_cache = row_cache;
  options.speculation.alpha = alpha;
  options.speculation.max_num_kv = max_num_kv;
  return options;
}

// The runs with and without the cache compute bitwise the same: tokens, every step's chosen
// token's log-probability and the last logits (NaN in a cache row read before it was written
// would break all three); the cache served some rows, and every layer's bytes are the uncached
// run's minus the K and V rows it served. Without a shared prefix the served rows are exactly
// those fetched at the step before too.
// On CUDA (`exact` false) the logits agree within rounding: a step's kernels may sum in another
// order from run to run.
void expect_same_and_fewer_bytes(const OffloadRun& on, const OffloadRun& off,
                                 const ModelConfig& config, bool shared_prefix = false,
                                 bool exact = true) {
  EXPECT_EQ(on.result.tokens, off.result.tokens);
  ASSERT_EQ(on.result.last_logits.nbytes(), off.result.last_logits.nbytes());
  const std::vector<float> a = on.result.last_logits.to_floats();
  const std::vector<float> b = off.result.last_logits.to_floats();
  if (exact) {
    EXPECT_EQ(on.result.token_log_probs, off.result.token_log_probs);
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0);
  } else {
    EXPECT_LT(testing_util::relative_error(a.data(), b.data(), a.size()), 1e-5);
  }
  for (float x : a) ASSERT_FALSE(std::isnan(x));
  const uint64_t row_bytes = static_cast<uint64_t>(config.head_dim()) * 2;  // fp16
  const auto& s_on = on.stats.steps();
  const auto& s_off = off.stats.steps();
  ASSERT_EQ(s_on.size(), s_off.size());
  uint64_t served = 0;
  for (size_t i = 0; i < s_on.size(); ++i) {
    uint64_t step_served = 0;
    for (size_t l = 0; l < s_on[i].layers.size(); ++l) {
      const LayerTraffic& x = s_on[i].layers[l];
      const LayerTraffic& y = s_off[i].layers[l];
      EXPECT_EQ(y.tokens_from_row_cache, 0u);
      EXPECT_EQ(x.tokens_fetched, y.tokens_fetched) << "step " << i << " layer " << l;
      EXPECT_EQ(x.kv_h2d_bytes + 2 * row_bytes * x.tokens_from_row_cache, y.kv_h2d_bytes)
          << "step " << i << " layer " << l;
      // Known where both steps' selections are on the host for the same batch (not right after
      // sequences left it).
      if (!shared_prefix && i > 0 && x.tokens_fetched_again >= 0) {
        EXPECT_EQ(static_cast<int64_t>(x.tokens_from_row_cache), x.tokens_fetched_again)
            << "step " << i << " layer " << l;
      }
      if (i <= 1) {
        EXPECT_EQ(x.tokens_from_row_cache, 0u);  // the prompt, then an empty cache
      }
      step_served += x.tokens_from_row_cache;
    }
    EXPECT_EQ(s_on[i].h2d_bytes + 2 * row_bytes * step_served, s_off[i].h2d_bytes) << i;
    served += step_served;
  }
  EXPECT_GT(served, 0u);
  EXPECT_GT(summarize(on).row_cache_fraction, 0.0);
  EXPECT_LE(summarize(off).row_cache_fraction, 0.0);  // 0, or -1 where nothing is known (CUDA)
}

class RowCache : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    source_ = resolve_model(GetParam(), {});
    source_.config.num_layers = 4;  // two dense layers, two speculated
    request_.prompts = {{2, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20},
                        {2, 500, 600, 700, 800, 900, 1000, 1100, 1200},
                        {2, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52}};
    request_.gen_len = 12;
    request_.sampling.temperature = 0;
    request_.score_tokens = true;
    set_debug_poison(true);  // the cache's rows are NaN until a step writes them
  }
  void TearDown() override { set_debug_poison(false); }
  OffloadRun run(const OffloadOptions& options) {
    return run_offloaded(source_, request_, options, Device::Cpu);
  }
  ModelSource source_;
  GenerationRequest request_;
};

TEST_P(RowCache, ComputesWhatTheUncachedRunDoesAndLoadsOnlyTheRowsItDidNotHold) {
  for (const auto& [alpha, cap] : std::vector<std::pair<double, int64_t>>{{1.0, 5}, {4.0, 0}}) {
    SCOPED_TRACE(cat("alpha ", alpha, ", max_num_kv ", cap));
    const OffloadRun on = run(infinigen_options(RowCacheUse::On, alpha, cap));
    const OffloadRun off = run(infinigen_options(RowCacheUse::Off, alpha, cap));
    EXPECT_EQ(on.plan.row_cache, true);
    EXPECT_EQ(off.plan.row_cache, false);
    expect_same_and_fewer_bytes(on, off, source_.config);
  }
}

// The default (auto) keeps the cache where it fits: here it does.
TEST_P(RowCache, IsOnByDefaultWhereItFits) {
  OffloadOptions options = infinigen_options(RowCacheUse::Auto);
  const OffloadRun on = run(options);
  EXPECT_EQ(on.plan.row_cache, true);
  expect_same_and_fewer_bytes(on, run(infinigen_options(RowCacheUse::Off)), source_.config);
}

TEST_P(RowCache, SequencesLeavingTheBatchKeepTheirCachedRows) {
  request_.sequence_gen_len = {3, 12, 6};
  request_.drop_ended = true;
  const OffloadRun on = run(infinigen_options(RowCacheUse::On));
  const OffloadRun off = run(infinigen_options(RowCacheUse::Off));
  EXPECT_LT(on.result.rows, 3 * 12);  // sequences did leave
  expect_same_and_fewer_bytes(on, off, source_.config);
}

TEST_P(RowCache, SharedPrefixRowsComeOnceFromTheLinkOrTheCache) {
  const std::vector<int32_t> prefix = {2, 10, 11, 12, 13, 14, 15, 16, 17};
  request_.prompts = {prefix, prefix, prefix};
  request_.prompts[0].insert(request_.prompts[0].end(), {30, 31, 32});
  request_.prompts[1].insert(request_.prompts[1].end(), {500, 600, 700, 800, 900, 1000});
  request_.prompts[2].insert(request_.prompts[2].end(), {7});
  OffloadOptions on = infinigen_options(RowCacheUse::On, 4.0, 0);
  OffloadOptions off = infinigen_options(RowCacheUse::Off, 4.0, 0);
  const OffloadRun a = run(on), b = run(off);
  ASSERT_GT(summarize(a).shared_prefix_groups, 0);
  expect_same_and_fewer_bytes(a, b, source_.config, /*shared_prefix=*/true);
}

TEST_P(RowCache, PromptInChunksStartsFromAnEmptyCache) {
  OffloadOptions on = infinigen_options(RowCacheUse::On), off = infinigen_options(RowCacheUse::Off);
  on.prefill_chunk = off.prefill_chunk = 5;
  expect_same_and_fewer_bytes(run(on), run(off), source_.config);
}

// The CUDA path: the selection stays on the device, a kernel matches it against the cached
// positions, the gather copies the rows held from the cache and reads only the others from the
// mapped pool, and a kernel stores the staged selection into the cache.
TEST_P(RowCache, CudaComputesWhatTheUncachedRunDoesAndLoadsOnlyTheRowsItDidNotHold) {
  INFINIGEN_SKIP_WITHOUT_CUDA_DEVICE();
  for (const auto& [alpha, cap] : std::vector<std::pair<double, int64_t>>{{1.0, 5}, {4.0, 0}}) {
    SCOPED_TRACE(cat("alpha ", alpha, ", max_num_kv ", cap));
    const OffloadRun on = run_offloaded(
        source_, request_, infinigen_options(RowCacheUse::On, alpha, cap), Device::Cuda);
    const OffloadRun off = run_offloaded(
        source_, request_, infinigen_options(RowCacheUse::Off, alpha, cap), Device::Cuda);
    EXPECT_EQ(on.plan.row_cache, true);
    expect_same_and_fewer_bytes(on, off, source_.config, /*shared_prefix=*/false, /*exact=*/false);
  }
}

TEST_P(RowCache, CudaSequencesLeavingTheBatchKeepTheirCachedRows) {
  INFINIGEN_SKIP_WITHOUT_CUDA_DEVICE();
  request_.sequence_gen_len = {3, 12, 6};
  request_.drop_ended = true;
  const OffloadRun on =
      run_offloaded(source_, request_, infinigen_options(RowCacheUse::On), Device::Cuda);
  const OffloadRun off =
      run_offloaded(source_, request_, infinigen_options(RowCacheUse::Off), Device::Cuda);
  EXPECT_LT(on.result.rows, 3 * 12);
  expect_same_and_fewer_bytes(on, off, source_.config, /*shared_prefix=*/false, /*exact=*/false);
}

INSTANTIATE_TEST_SUITE_P(Families, RowCache, ::testing::Values("opt-tiny", "llama-tiny"),
                         [](const auto& param) {
                           return param.param == "opt-tiny" ? "Opt" : "Llama";
                         });

// The plan counts the cache (its K and V rows of the fetch cap per speculated layer, sequence and
// KV head) in the device part; auto keeps it when it fits beside everything else and drops it
// otherwise; on refuses where it does not fit; a capped pool has none.
TEST(RowCachePlan, CountedDroppedWhereItDoesNotFitAndRefusedWhenAsked) {
  MemoryRequest r =
      testing_util::preset_request<MemoryRequest>("llama-3.1-8b", 8, 8192, 128, "infinigen");
  r.host_capacity = size_t{1} << 44;
  r.device_capacity = size_t{1} << 44;
  // Placements fixed: nothing else can move to the host to make room.
  r.options.dense_kv = KvPlacement::Device;
  r.options.partial_key_host_layers = 0;
  r.options.row_cache = RowCacheUse::Off;
  const MemoryPlan without = plan_memory(r);
  r.options.row_cache = RowCacheUse::On;
  const MemoryPlan with = plan_memory(r);
  const ModelConfig& c = r.config;
  const int64_t cap = r.options.speculation.fetch_cap(8192 + 128);
  const size_t cache = static_cast<size_t>(c.num_layers - 2) * 2 * 8 * c.kv_heads() *
                       static_cast<size_t>(cap) * c.head_dim() * 2;
  EXPECT_EQ(with.row_cache, true);
  EXPECT_EQ(without.row_cache, false);
  // The cache joins the decode steps' need. Without it the prompt's last pass needs the most:
  // its whole staging of 8320 rows a layer where a decode step keeps cap + 1.
  const size_t staging_shrinks = size_t{2} * 2 * 8 * c.kv_heads() *
                                 static_cast<size_t>(8192 + 128 - (cap + 1)) * c.head_dim() * 2;
  EXPECT_EQ(with.device_kv, without.device_kv - staging_shrinks + cache);
  r.options.row_cache = RowCacheUse::Auto;
  EXPECT_EQ(plan_memory(r).row_cache, true);

  // Room for everything but the cache: auto drops it, on is refused.
  r.device_capacity = without.device_total() + cache / 2;
  const MemoryPlan dropped = plan_memory(r);
  EXPECT_EQ(dropped.row_cache, false);
  EXPECT_EQ(dropped.device_total(), without.device_total());
  r.options.row_cache = RowCacheUse::On;
  EXPECT_THROW(plan_memory(r), Error);
  // Placements left to the planner: on makes room by moving partial keys to the host.
  r.options.partial_key_host_layers = -1;
  const MemoryPlan room = plan_memory(r);
  EXPECT_EQ(room.row_cache, true);
  EXPECT_GT(room.partial_key_host_layers.value_or(0), 0);

  // A capped pool: none, under auto; on is refused by the options.
  r.options.row_cache = RowCacheUse::Auto;
  r.kv_pool_tokens = 1024;
  r.device_capacity = size_t{1} << 44;
  EXPECT_EQ(plan_memory(r).row_cache, false);
  OffloadOptions capped = infinigen_options(RowCacheUse::On);
  capped.kv_pool_limit = 0.5;
  testing_util::expect_error([&] { capped.validate(); }, {"--row-cache on", "--kv-pool-limit"});
}

// A dry run (the cost model's schedule) serves the replayed share of each speculated layer's rows
// from the cache after the first decode step: none with a share of 0 (the same bytes as without
// the cache), fewer with a share; where the selected rows bound the step, it is shorter.
TEST(RowCachePrediction, PricesOnlyTheRowsTheCacheDoesNotServe) {
  CostModelInput in =
      testing_util::preset_request<CostModelInput>("opt-1.3b", 16, 2000, 8, "infinigen");
  in.fetched.fraction.assign(static_cast<size_t>(in.config.num_layers), 0.2);
  const HardwareProfile profile = load_hardware_profile("a100-pcie4");
  const auto predicted = [&](RowCacheUse use, double again) {
    CostModelInput input = in;
    input.options.row_cache = use;
    input.fetched.again.assign(static_cast<size_t>(in.config.num_layers), again);
    const PredictedRun run = predict_run(input, profile);
    EXPECT_TRUE(run.fits) << run.does_not_fit;
    return run;
  };
  const PredictedRun off = predicted(RowCacheUse::Off, 0.6);
  const PredictedRun none = predicted(RowCacheUse::On, 0.0);
  const PredictedRun some = predicted(RowCacheUse::On, 0.6);
  ASSERT_EQ(off.steps.size(), some.steps.size());
  for (size_t s = 0; s < off.steps.size(); ++s) {
    EXPECT_EQ(none.steps[s].h2d_bytes, off.steps[s].h2d_bytes) << s;
    if (s <= 1) {
      EXPECT_EQ(some.steps[s].h2d_bytes, off.steps[s].h2d_bytes) << s;
    } else {
      EXPECT_LT(some.steps[s].h2d_bytes, off.steps[s].h2d_bytes) << s;
      for (size_t l = 0; l < 2; ++l) {  // dense layers: loaded as before
        EXPECT_EQ(some.steps[s].layers[l].kv_h2d_bytes, off.steps[s].layers[l].kv_h2d_bytes);
      }
    }
  }
  EXPECT_LT(some.decode_s, off.decode_s);
}

TEST(RowCacheCli, BadValueIsOneLine) {
  const testing_util::CommandResult r =
      testing_util::run_infinigen({"run", "--row-cache", "maybe", "--gen-len", "2"});
  EXPECT_NE(r.exit_code, 0);
  EXPECT_NE(r.err.find("--row-cache"), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}

}  // namespace
}  // namespace infinigen
