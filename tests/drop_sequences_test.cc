// tests: sequences that end leave the batch (KvStore::drop_sequences, generate()): for every KV
// policy the survivors' tokens and logits are the static batch's (where every ended sequence keeps
// its row to the end), an exact policy's are each sequence's alone, shared prefixes stay correct
// when their group's leader ends first, and the steps after a drop compute and load less.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "core/device.h"
#include "offload/runtime.h"
#include "tests/test_util.h"

namespace infinigen {
namespace {

// A policy with the options it runs under.
struct DropCase {
  std::string name;
  OffloadOptions options;
};

std::vector<DropCase> drop_cases() {
  std::vector<DropCase> cases;
  const auto with = [&](std::string name, std::string policy, auto&& tweak) {
    OffloadOptions o;
    o.policy = std::move(policy);
    tweak(o);
    cases.push_back({std::move(name), o});
  };
  const auto none = [](OffloadOptions&) {};
  with("gpu", "gpu", none);
  with("full", "full", none);
  with("int4", "int4", none);
  with("h2o", "h2o", none);
  with("infinigen", "infinigen", none);
  with("infinigen, dense KV on the device", "infinigen",
       [](OffloadOptions& o) { o.dense_kv = KvPlacement::Device; });
  with("infinigen, partial keys in host memory", "infinigen",
       [](OffloadOptions& o) { o.partial_key_host_layers = 1; });
  with("infinigen, capped pool", "infinigen", [](OffloadOptions& o) { o.kv_pool_limit = 0.5; });
  return cases;
}

// opt-tiny with 4 layers (InfiniGen's two dense layers and two speculated ones), three prompts of
// different lengths (left padding), each sequence with its own length: the first ends after 2
// tokens, the third after 4, the second runs all 7.
class DropSequences : public testing_util::OptTinyTest {
 protected:
  void SetUp() override {
    OptTinyTest::SetUp();
    source_.config.num_layers = 4;
    request_.prompts = {{2, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20},
                        {2, 500, 600, 700, 800, 900, 1000, 1100, 1200},
                        {2, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52}};
    request_.gen_len = 7;
    request_.sequence_gen_len = {2, 7, 4};
  }
  // Two groups sharing 8 prompt tokens (two blocks of 4), whose leaders end first: sequence 0
  // after 2 tokens (its group's other member runs all 7), sequence 2 after 3 (the other after 4).
  void use_shared_prefixes() {
    const std::vector<int32_t> a = {2, 10, 11, 12, 13, 14, 15, 16};
    const std::vector<int32_t> b = {2, 40, 41, 42, 43, 44, 45, 46};
    request_.prompts = {a, a, b, b};
    request_.prompts[0].insert(request_.prompts[0].end(), {20, 21, 22});
    request_.prompts[1].insert(request_.prompts[1].end(), {30, 31});
    request_.prompts[2].insert(request_.prompts[2].end(), {50});
    request_.prompts[3].insert(request_.prompts[3].end(), {60, 61, 62});
    request_.sequence_gen_len = {2, 7, 3, 4};
  }
  OffloadRun run(const OffloadOptions& options, bool drop, Device device = Device::Cpu) {
    GenerationRequest request = request_;
    request.drop_ended = drop;
    return run_offloaded(source_, request, options, device);
  }
  // The survivors' tokens and the longest sequence's logits are the static batch's; the rows the
  // steps computed, and each offloading policy's loads, fall once a sequence has left.
  void expect_same_and_cheaper(const DropCase& c, Device device) {
    SCOPED_TRACE(c.name);
    const OffloadRun kept = run(c.options, false, device);
    const OffloadRun dropped = run(c.options, true, device);
    EXPECT_EQ(dropped.result.tokens, kept.result.tokens);
    ASSERT_EQ(dropped.result.gen_len, 7);
    // The longest sequence's last logits, up to the rounding of matrix products over fewer rows
    // (a batch of one is a matrix-vector product, summed in another order).
    const int64_t V = kept.result.last_logits.dim(1);
    const float* a = kept.result.last_logits.data<float>() + V;
    const float* b = dropped.result.last_logits.data<float>() + V;
    float worst = 0;
    for (int64_t i = 0; i < V; ++i) worst = std::max(worst, std::abs(a[i] - b[i]));
    EXPECT_LT(worst, 1e-3f);
    // Rows: 3 per step in the static batch; 3, 3, then 2 (steps 2, 3), then 1 (steps 4 to 6).
    EXPECT_EQ(kept.result.rows, 3 * 7);
    EXPECT_EQ(dropped.result.rows, 3 + 3 + 2 + 2 + 1 + 1 + 1);
    const auto& k = kept.stats.steps();
    const auto& d = dropped.stats.steps();
    ASSERT_EQ(k.size(), 7u);
    ASSERT_EQ(d.size(), 7u);
    for (size_t step = 0; step < 7; ++step) {
      uint64_t k_fetched = 0, d_fetched = 0;
      for (const LayerTraffic& t : k[step].layers) k_fetched += t.tokens_fetched;
      for (const LayerTraffic& t : d[step].layers) d_fetched += t.tokens_fetched;
      if (step < 2) {  // every sequence still runs
        EXPECT_EQ(d[step].h2d_bytes, k[step].h2d_bytes) << "step " << step;
        EXPECT_EQ(d_fetched, k_fetched) << "step " << step;
      } else if (c.options.policy != "gpu") {  // gpu loads nothing
        EXPECT_LT(d[step].h2d_bytes, k[step].h2d_bytes) << "step " << step;
        EXPECT_LT(d[step].d2h_bytes, k[step].d2h_bytes) << "step " << step;
        EXPECT_LT(d_fetched, k_fetched) << "step " << step;
      }
    }
  }
};

TEST_F(DropSequences, EveryPolicyGivesTheStaticBatchsTokensAndLoadsLess) {
  for (const DropCase& c : drop_cases()) expect_same_and_cheaper(c, Device::Cpu);
}

// With the NaN poison of KV that was not transferred: a dropped sequence's rows are never read.
TEST_F(DropSequences, NothingReadsWhatWasNotLoaded) {
  set_debug_poison(true);
  for (const DropCase& c : drop_cases()) expect_same_and_cheaper(c, Device::Cpu);
}

// An exact policy's survivors generate what each sequence generates alone.
TEST_F(DropSequences, ExactPoliciesGiveEachSequenceItsTokensAlone) {
  for (const std::string policy : {"gpu", "full"}) {
    OffloadOptions options;
    options.policy = policy;
    const OffloadRun batch = run(options, true);
    for (size_t b = 0; b < 3; ++b) {
      GenerationRequest alone;
      alone.prompts = {request_.prompts[b]};
      alone.gen_len = request_.sequence_gen_len[b];
      EXPECT_EQ(run_offloaded(source_, alone, options, Device::Cpu).result.tokens[0],
                batch.result.tokens[b])
          << policy << ", sequence " << b;
    }
  }
}

// Groups that share a prompt prefix (blocks of 4 tokens): the leader of the first group (sequence
// 0) ends first, and its group's other member reads the prefix from its own rows from then on; a
// group that loses every member stops being read.
TEST_F(DropSequences, SharedPrefixesSurviveTheirLeader) {
  use_shared_prefixes();
  for (const std::string policy : {"gpu", "full", "infinigen"}) {
    for (const KvPlacement dense : {KvPlacement::Host, KvPlacement::Device}) {
      if (policy != "infinigen" && dense == KvPlacement::Device) continue;
      OffloadOptions options;
      options.policy = policy;
      options.kv_block_tokens = 4;
      options.dense_kv = dense;
      SCOPED_TRACE(policy + (dense == KvPlacement::Device ? ", dense KV on the device" : ""));
      const OffloadRun kept = run(options, false);
      const OffloadRun dropped = run(options, true);
      ASSERT_EQ(dropped.shared_prefixes.num_groups(), 2);
      EXPECT_EQ(dropped.result.tokens, kept.result.tokens);
      EXPECT_LT(dropped.result.rows, kept.result.rows);
      if (policy == "infinigen") continue;
      for (size_t b = 0; b < 4; ++b) {  // exact: each as it generates alone
        GenerationRequest alone;
        alone.prompts = {request_.prompts[b]};
        alone.gen_len = request_.sequence_gen_len[b];
        EXPECT_EQ(run_offloaded(source_, alone, options, Device::Cpu).result.tokens[0],
                  dropped.result.tokens[b])
            << "sequence " << b;
      }
    }
  }
}

// Sampled tokens, each sequence with its own generator, and stop callbacks: the same as the
// static batch. A request-wide sampler draws for every row, so there ended sequences keep theirs.
TEST_F(DropSequences, OwnSamplersAndStopsGiveTheStaticBatchsTokens) {
  request_.sequence_sampling = {{1.0f, 0.9f, 3}, {0.8f, 1.0f, 4}, {1.2f, 0.95f, 5}};
  request_.sequence_gen_len.clear();
  request_.stop = [](int64_t b, const std::vector<int32_t>& generated) {
    return std::ssize(generated) == 2 + 2 * b % 5;  // sequence 0 after 2, 2 after 3 tokens
  };
  OffloadOptions options;
  options.policy = "infinigen";
  const OffloadRun kept = run(options, false);
  const OffloadRun dropped = run(options, true);
  EXPECT_EQ(dropped.result.tokens, kept.result.tokens);
  EXPECT_LT(dropped.result.rows, kept.result.rows);
  request_.sequence_sampling.clear();
  request_.sampling = {1.0f, 1.0f, 7};
  EXPECT_EQ(run(options, true).result.rows, kept.result.rows);
}

// --fetch-rule batch: n' is the mean over every sequence's rows, so ended sequences keep theirs.
TEST_F(DropSequences, TheBatchFetchRuleKeepsEndedRows) {
  OffloadOptions options;
  options.policy = "infinigen";
  options.speculation.fetch_rule = FetchRule::Batch;
  const OffloadRun kept = run(options, false);
  const OffloadRun dropped = run(options, true);
  EXPECT_EQ(dropped.result.tokens, kept.result.tokens);
  EXPECT_EQ(dropped.result.rows, kept.result.rows);
}

// The CUDA path (the emulated device in CI): the same for every policy that drops there.
TEST_F(DropSequences, CudaEveryPolicyGivesTheStaticBatchsTokensAndLoadsLess) {
  INFINIGEN_SKIP_WITHOUT_CUDA_DEVICE();
  for (const DropCase& c : drop_cases()) expect_same_and_cheaper(c, Device::Cuda);
}

// Shared prefixes whose leader ends first, on the CUDA device (InfiniGen's partial keys there).
TEST_F(DropSequences, CudaSharedPrefixesSurviveTheirLeader) {
  INFINIGEN_SKIP_WITHOUT_CUDA_DEVICE();
  use_shared_prefixes();
  for (const std::string policy : {"gpu", "full", "infinigen"}) {
    OffloadOptions options;
    options.policy = policy;
    options.kv_block_tokens = 4;
    SCOPED_TRACE(policy);
    const OffloadRun kept = run(options, false, Device::Cuda);
    const OffloadRun dropped = run(options, true, Device::Cuda);
    ASSERT_EQ(dropped.shared_prefixes.num_groups(), 2);
    EXPECT_EQ(dropped.result.tokens, kept.result.tokens);
    EXPECT_LT(dropped.result.rows, kept.result.rows);
  }
}

}  // namespace
}  // namespace infinigen
