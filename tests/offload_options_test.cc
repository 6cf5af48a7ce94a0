// tests: the options of an offloaded run (one table for every front end) and the registry of KV
// policies.
#include "offload/offload_options.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include "offload/kv_policy.h"
#include "offload/memory_planner.h"
#include "tests/test_util.h"

namespace infinigen {
namespace {

using testing_util::expect_error;

const OptionSpec<OffloadOptions>& spec(const std::string& key) {
  const OptionSpec<OffloadOptions>* found = find_option(offload_option_table(), key);
  EXPECT_NE(found, nullptr) << key;
  return *found;
}

TEST(OffloadOptionTable, EveryOptionReadsBackWhatItWritesAndKeysAreUnique) {
  std::set<std::string> keys;
  const OffloadOptions defaults;
  for (const OptionSpec<OffloadOptions>& option : offload_option_table()) {
    EXPECT_TRUE(keys.insert(option.key).second) << option.key << " twice";
    EXPECT_FALSE(option.help.empty()) << option.key;
    OffloadOptions parsed;
    option.parse(parsed, option.format(defaults));
    EXPECT_EQ(option.format(parsed), option.format(defaults)) << option.key;
  }
  EXPECT_NO_THROW(defaults.validate());
}

TEST(OffloadOptionTable, ValuesLandInTheirFields) {
  OffloadOptions o;
  spec("policy").parse(o, "h2o");
  spec("alpha").parse(o, "6.5");
  spec("partial_index_rule").parse(o, "q");
  spec("fetch_rule").parse(o, "batch");
  spec("partial_key_dtype").parse(o, "f16");
  spec("eviction").parse(o, "lru");
  spec("max_num_kv").parse(o, "300");
  spec("device_memory").parse(o, "1.5");
  spec("check_recall").parse(o, "true");
  spec("emulate_link_gbps").parse(o, "12");
  EXPECT_EQ(o.policy, "h2o");
  EXPECT_EQ(o.speculation.alpha, 6.5);
  EXPECT_EQ(o.speculation.index_rule, PartialIndexRule::Q);
  EXPECT_EQ(o.speculation.fetch_rule, FetchRule::Batch);
  EXPECT_EQ(o.speculation.partial_key_dtype, DType::F16);
  EXPECT_EQ(o.eviction, EvictionPolicy::Lru);
  EXPECT_EQ(o.speculation.max_num_kv, 300);
  EXPECT_EQ(o.device_memory, size_t{3} << 29);
  EXPECT_TRUE(o.check_recall);
  EXPECT_EQ(o.link.gbps, 12.0);
}

TEST(OffloadOptionTable, BadTextNamesTheOption) {
  OffloadOptions o;
  expect_error([&] { spec("alpha").parse(o, "four"); }, {"--alpha", "'four'", "not a number"});
  expect_error([&] { spec("alpha").parse(o, "4x"); }, {"--alpha"});
  expect_error([&] { spec("alpha").parse(o, "inf"); }, {"--alpha", "finite"});
  expect_error([&] { spec("max_num_kv").parse(o, "1.5"); }, {"--max-num-kv", "whole number"});
  expect_error([&] { spec("max_num_kv").parse(o, "99999999999999999999"); },
               {"--max-num-kv", "out of range"});
  expect_error([&] { spec("eviction").parse(o, "random"); },
               {"--eviction", "'random'", "counter, lru or fifo"});
  expect_error([&] { spec("policy").parse(o, "vllm"); }, {"--policy", "'vllm'", "infinigen"});
  expect_error([&] { spec("check_recall").parse(o, "maybe"); }, {"--check-recall"});
  expect_error([&] { spec("device_memory").parse(o, "-1"); }, {"--device-memory"});
}

TEST(OffloadOptions, ValidateNamesTheOptionOutOfRange) {
  const auto bad = [](auto change, const char* flag) {
    OffloadOptions o;
    change(o);
    expect_error([&] { o.validate(); }, {flag});
  };
  bad([](OffloadOptions& o) { o.speculation.alpha = -1; }, "--alpha");
  bad([](OffloadOptions& o) { o.speculation.partial_ratio = 0; }, "--partial-ratio");
  bad([](OffloadOptions& o) { o.speculation.dense_layers = 0; }, "--dense-layers");
  bad([](OffloadOptions& o) { o.speculation.max_fetch_share = 0; }, "--max-fetch-share");
  bad([](OffloadOptions& o) { o.speculation.max_fetch_share = 1.5; }, "--max-fetch-share");
  bad([](OffloadOptions& o) { o.weights_gpu_percent = 101; }, "--weights-gpu-percent");
  bad([](OffloadOptions& o) { o.kv_block_tokens = 0; }, "--kv-block-tokens");
  bad([](OffloadOptions& o) { o.h2o_budget = 0; }, "--h2o-budget");
  bad([](OffloadOptions& o) { o.link.gbps = -1; }, "--emulate-link-gbps");
  bad([](OffloadOptions& o) { o.policy = "nope"; }, "--policy");
  // A pool limit needs a policy with a pool to limit.
  bad(
      [](OffloadOptions& o) {
        o.policy = "full";
        o.kv_pool_limit = 0.5;
      },
      "--kv-pool-limit");
  OffloadOptions capped;
  capped.kv_pool_limit = 0.5;
  EXPECT_NO_THROW(capped.validate());
}

// A pool limit on a policy that takes none says why in one line: `full` has a pool, but it reads
// every token at every step; h2o's pool has its own budget.
TEST(OffloadOptions, APoolLimitOnAnotherPolicySaysWhy) {
  const auto refused = [](const std::string& policy, const std::vector<std::string>& fragments) {
    OffloadOptions o;
    o.policy = policy;
    o.kv_pool_limit = 0.5;
    expect_error([&] { o.validate(); }, fragments);
  };
  for (const char* policy : {"full", "gpu", "int4"}) {
    refused(policy, {"--kv-pool-limit", policy, "attends to every stored token at every step",
                     "only infinigen chooses which tokens a capped pool evicts"});
  }
  refused("h2o", {"--kv-pool-limit", "sizes its pool with --h2o-budget", "only infinigen"});
}

TEST(OffloadOptionTable, EvictionIsInEffectOnlyWithAPoolLimit) {
  OffloadOptions o;
  EXPECT_FALSE(spec("eviction").in_effect(o));
  o.kv_pool_limit = 0.5;
  EXPECT_TRUE(spec("eviction").in_effect(o));
}

TEST(KvPolicies, EveryEntryIsCompleteAndFoundByName) {
  std::set<std::string> names;
  for (const KvPolicy* policy : kv_policies()) {
    EXPECT_TRUE(names.insert(policy->name).second) << policy->name;
    EXPECT_FALSE(policy->help.empty()) << policy->name;
    EXPECT_NE(policy->runs_on, nullptr) << policy->name;
    EXPECT_NE(policy->memory, nullptr) << policy->name;
    EXPECT_NE(policy->make_store, nullptr) << policy->name;
    EXPECT_EQ(&kv_policy(policy->name), policy);
    EXPECT_TRUE(policy->runs_on(Device::Cpu)) << policy->name;  // the CPU backend runs them all
    for (const std::string& key : policy->options) {
      EXPECT_NE(find_option(offload_option_table(), key), nullptr) << policy->name << ": " << key;
    }
  }
  EXPECT_EQ(names, (std::set<std::string>{"infinigen", "full", "int4", "h2o", "gpu"}));
  expect_error([] { kv_policy("vllm"); }, {"--policy", "'vllm'", "gpu"});
}

TEST(KvPolicies, OptionsArePolicySpecificOrCommon) {
  EXPECT_TRUE(policy_reads_option("infinigen", "alpha"));
  EXPECT_FALSE(policy_reads_option("full", "alpha"));
  EXPECT_TRUE(policy_reads_option("h2o", "h2o_budget"));
  EXPECT_FALSE(policy_reads_option("infinigen", "h2o_budget"));
  for (const KvPolicy* policy : kv_policies()) {
    EXPECT_TRUE(policy_reads_option(policy->name, "weights_gpu_percent")) << policy->name;
  }
}

// The exact policies compute over every stored token; the planner offers them as fallbacks and
// names the leanest of them when nothing fits.
TEST(KvPolicies, FullNeedsTheLeastDeviceMemoryOfTheExactOnes) {
  MemoryRequest r;
  r.config = load_preset("opt-13b");
  r.batch = 8;
  r.prompt_len = 1024;
  r.gen_len = 128;
  size_t full = 0, least = SIZE_MAX;
  for (const KvPolicy* policy : kv_policies()) {
    if (!policy->exact) continue;
    const size_t device = policy->memory(r).device;
    least = std::min(least, device);
    if (policy->name == "full") full = device;
  }
  EXPECT_EQ(full, least);
}

// InfiniGen's fetch cap: max_num_kv when given, else max_fetch_share of the capacity, rounded
// down, at least 1 (20% by default: 8320 tokens cap at 1664, as capacity / 5 did).
TEST(SpeculationOptions, FetchCapIsTheTokenCapOrTheShareOfTheCapacity) {
  SpeculationOptions s;
  for (int64_t capacity = 1; capacity <= 200000; ++capacity) {
    ASSERT_EQ(s.fetch_cap(capacity), std::max<int64_t>(1, capacity / 5)) << capacity;
  }
  EXPECT_EQ(s.fetch_cap(8320), 1664);
  EXPECT_EQ(s.fetch_cap(32896), 32896 / 5);
  EXPECT_EQ(s.fetch_cap(4), 1);
  s.max_fetch_share = 0.05;
  EXPECT_EQ(s.fetch_cap(2040), 102);
  EXPECT_EQ(s.fetch_cap(19), 1);
  s.max_num_kv = 300;
  EXPECT_EQ(s.fetch_cap(2040), 300);
}

}  // namespace
}  // namespace infinigen
