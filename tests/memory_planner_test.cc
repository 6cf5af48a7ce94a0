// tests: weight placement and the memory planner: byte counts, failures and their suggestions.
#include "offload/memory_planner.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "core/activations.h"
#include "core/error.h"
#include "offload/weight_placement.h"
#include "tests/test_util.h"

namespace infinigen {
namespace {

constexpr size_t kGiB = size_t{1} << 30;

// OPT-13B, batch 20, 1920 prompt + 128 generated (the paper's main setting).
MemoryRequest opt13b_request() {
  MemoryRequest r = testing_util::preset_request<MemoryRequest>("opt-13b", 20, 1920, 128, "full");
  r.options.weights_gpu_percent = 100;
  r.device_capacity = 48 * kGiB;
  r.host_capacity = 256 * kGiB;
  return r;
}

// Group of a tensor as the placement rule sees it: its layer, or -1 for the embeddings group.
int64_t group_of(const std::string& name) {
  const std::string layers = "model.decoder.layers.";
  if (name.rfind(layers, 0) != 0) return -1;
  return std::stoll(name.substr(layers.size()));
}

std::string plan_error(const MemoryRequest& request) {
  try {
    plan_memory(request);
  } catch (const Error& error) {
    return testing_util::cli_message(error);
  }
  return "";
}

// Applies the flags after "try " in a failure message to `request`.
MemoryRequest apply_suggestion(MemoryRequest request, const std::string& message) {
  for (const auto& [flag, value] : testing_util::suggested_flags(message)) {
    if (flag == "--batch") {
      request.batch = std::stoll(value);
    } else if (flag == "--weights-gpu-percent") {
      request.options.weights_gpu_percent = std::stod(value);
    } else if (flag == "--policy") {
      request.options.policy = value;
      if (value != "infinigen") request.kv_pool_tokens = 0;
    } else if (flag == "--kv-block-tokens") {
      request.options.kv_block_tokens = std::stoll(value);
    } else if (flag == "--prefill-chunk") {
      request.options.prefill_chunk = std::stoll(value);
    } else if (flag == "--dense-kv") {
      EXPECT_EQ(value, "host") << message;  // the only placement the planner changes
      request.options.dense_kv = KvPlacement::Host;
    } else if (flag == "--partial-key-host-layers") {
      request.options.partial_key_host_layers = std::stoll(value);
    } else if (flag == "--gen-len") {
      request.gen_len = std::stoll(value);
    } else if (flag == "--kv-pool-limit") {
      // As the runtime reads it: a share of prompt + generated positions.
      request.kv_pool_tokens = static_cast<int64_t>(
          std::floor(std::stod(value) * static_cast<double>(request.prompt_len + request.gen_len)));
    } else {
      ADD_FAILURE() << "unknown flag " << flag << " in: " << message;
    }
  }
  return request;
}

// The planner's refusal of `request` and the request with its suggestion applied.
struct Suggestion {
  std::string refusal;
  MemoryRequest fixed;
};

// Plans `request`, expecting a one-line refusal holding `fragment` whose suggestion the planner
// accepts.
Suggestion expect_suggestion_fits(const MemoryRequest& request, const std::string& fragment) {
  Suggestion s;
  s.refusal = plan_error(request);
  EXPECT_EQ(s.refusal.find('\n'), std::string::npos) << s.refusal;
  EXPECT_NE(s.refusal.find(fragment), std::string::npos) << s.refusal;
  s.fixed = apply_suggestion(request, s.refusal);
  EXPECT_NO_THROW(plan_memory(s.fixed)) << s.refusal;
  return s;
}

std::string gib1(size_t bytes) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.1f", static_cast<double>(bytes) / static_cast<double>(kGiB));
  return text;
}

TEST(WeightPlacement, AllNoneAndHalf) {
  const ModelConfig config = load_preset("opt-13b");
  size_t total = 0;
  for (const WeightHome& home : place_weights(config, 100)) {
    EXPECT_TRUE(home.on_device) << home.name;
    total += home.bytes;
  }
  EXPECT_EQ(total, config.weight_bytes());
  // Embeddings, positions and the final LayerNorm stay on the device whatever the percent.
  for (const WeightHome& home : place_weights(config, 0)) {
    EXPECT_EQ(home.on_device, group_of(home.name) < 0) << home.name;
  }

  // The midpoint rule misses the target share of a group by at most half of one tensor.
  for (double percent : {50.0, 30.0, 85.0}) {
    std::map<int64_t, size_t> group_total, group_device, group_largest;
    const std::vector<WeightHome> homes = place_weights(config, percent);
    ASSERT_EQ(homes.size(), 4 + 16 * static_cast<size_t>(config.num_layers));
    for (const WeightHome& home : homes) {
      const int64_t group = group_of(home.name);
      group_total[group] += home.bytes;
      if (home.on_device) group_device[group] += home.bytes;
      group_largest[group] = std::max(group_largest[group], home.bytes);
    }
    EXPECT_EQ(group_total.size(), static_cast<size_t>(config.num_layers) + 1);
    for (const auto& [group, bytes] : group_total) {
      if (group < 0) {
        EXPECT_EQ(group_device[group], bytes);
        continue;
      }
      const double target = percent / 100.0 * static_cast<double>(bytes);
      EXPECT_LE(std::abs(static_cast<double>(group_device[group]) - target),
                0.5 * static_cast<double>(group_largest[group]))
          << "group " << group << " at " << percent << "%";
    }
  }
}

TEST(WeightPlacement, MidpointRuleOnATinyModel) {
  ModelConfig c;
  c.name = "tiny";
  c.hidden_size = 4;
  c.num_heads = 2;
  c.ffn_dim = 8;
  c.vocab_size = 16;
  c.max_positions = 6;
  c.num_layers = 1;
  c.dtype = DType::F32;
  // Layer elements in order (offsets): q.w 16 [0, 16), q.b 4 [16, 20), k.w 16 [20, 36),
  // k.b 4 [36, 40), v.w 16 [40, 56), v.b 4, out.w 16, out.b 4 [76, 80), ln.w 4 [80, 84),
  // ln.b 4 [84, 88), fc1.w 32, fc1.b 8, fc2.w 32, fc2.b 4, ln.w 4, ln.b 4: 172 in all.
  // Embeddings group: embed_tokens 64 [0, 64), positions 32 [64, 96), final ln 4 + 4: 104.
  auto on_device = [&](double percent) {
    std::vector<std::string> names;
    for (const WeightHome& home : place_weights(c, percent)) {
      const std::string name = home.name.substr(std::string("model.decoder.").size());
      if (!name.starts_with("layers.")) {
        EXPECT_TRUE(home.on_device) << name;  // embeddings and final LayerNorm: always
      } else if (home.on_device) {
        names.push_back(name);
      }
    }
    return names;
  };
  // 25%: layer limit 43 elements, so v.w (midpoint 48) is the first on the host.
  EXPECT_EQ(on_device(25), (std::vector<std::string>{
                               "layers.0.self_attn.q_proj.weight",
                               "layers.0.self_attn.q_proj.bias",
                               "layers.0.self_attn.k_proj.weight",
                               "layers.0.self_attn.k_proj.bias",
                           }));
  // 50%: layer limit 86: self_attn_layer_norm.weight (midpoint 82) stays, its bias (midpoint
  // exactly 86) does not.
  EXPECT_EQ(on_device(50), (std::vector<std::string>{
                               "layers.0.self_attn.q_proj.weight",
                               "layers.0.self_attn.q_proj.bias",
                               "layers.0.self_attn.k_proj.weight",
                               "layers.0.self_attn.k_proj.bias",
                               "layers.0.self_attn.v_proj.weight",
                               "layers.0.self_attn.v_proj.bias",
                               "layers.0.self_attn.out_proj.weight",
                               "layers.0.self_attn.out_proj.bias",
                               "layers.0.self_attn_layer_norm.weight",
                           }));
  const std::vector<WeightHome> homes = place_weights(c, 50);
  EXPECT_EQ(homes[0].bytes, 64u * 4);
  EXPECT_EQ(homes.back().name, "model.decoder.final_layer_norm.bias");
}

TEST(WeightPlacement, PercentOutOfRangeNamesTheFlag) {
  const ModelConfig config = load_preset("opt-125m");
  for (double percent : {-1.0, 100.5, std::nan("")}) {
    try {
      place_weights(config, percent);
      ADD_FAILURE() << "no error for " << percent;
    } catch (const Error& error) {
      EXPECT_NE(testing_util::cli_message(error).find("--weights-gpu-percent"), std::string::npos);
    }
  }
}

TEST(MemoryPlanner, Opt13bByteCountsMatchTheFormulas) {
  const MemoryRequest r = opt13b_request();
  const MemoryPlan plan = compute_memory_plan(r);
  // D 5120, F 20480, V 50272, 2050 position rows, L 40, fp16 weights.
  // Per layer: 4 * (D*D + D) + 2*D*F + F + D + 4*D = 314,639,360 parameters.
  const size_t params = 40 * size_t{314639360} + 50272 * 5120 + 2050 * 5120 + 2 * 5120;
  EXPECT_EQ(params * 2, 25706946560u);
  EXPECT_EQ(plan.device_weights, 25706946560u);
  EXPECT_EQ(plan.device_weight_staging, 0u);
  EXPECT_EQ(plan.host_weights, 0u);
  // Full policy: K and V of one layer, double-buffered: 2 * 2 * B * H * 2048 * d * 2.
  EXPECT_EQ(plan.device_kv, 2u * 2 * 20 * 40 * 2048 * 128 * 2);
  EXPECT_EQ(plan.device_kv, 1677721600u);
  // The pool: 2 * L * B * 2048 * D * 2 bytes (2048 is a whole number of 64-token blocks).
  EXPECT_EQ(plan.host_kv_pool, 33554432000u);
  EXPECT_EQ(plan.host_kv_pool, 2048 * 20 * r.config.kv_bytes_per_token(DType::F16));
  // Prefill activations, fp32 (core/activations.h), n = 1920: hidden, normed, q, k, v and the
  // attention output 6 * B*n*D, the FFN B*n*F; the LM head's last rows and final norm 2 * B*D
  // and logits B*V; then the attention kernel's scores 64*n*16.
  EXPECT_EQ(plan.device_activations,
            size_t{4718592000} + size_t{3145728000} + 819200 + 4021760 + 7864320);
  EXPECT_EQ(plan.device_activations,
            activation_bytes(r.config, 20, 1920) + size_t{64} * 1920 * 4 * 16);
  EXPECT_EQ(plan.device_total(), 25706946560u + 1677721600u + 7877025280u);
  EXPECT_EQ(plan.host_total(), 33554432000u);

  const std::string table = plan.describe();
  EXPECT_NE(table.find("KV cache"), std::string::npos) << table;
  EXPECT_NE(table.find("31.25 GiB"), std::string::npos) << table;  // the pool
  EXPECT_NE(table.find("23.94 GiB"), std::string::npos) << table;  // the weights
  EXPECT_GE(std::count(table.begin(), table.end(), '\n'), 5);

  // On the CUDA backend the GEMMs add their scratch: fc2's input B*n*F as fp16 (the 1.6 GB the
  // OPT-13B point needs) and cuBLAS's 32 MiB workspace.
  MemoryRequest cuda = r;
  cuda.gemm_scratch = true;
  const MemoryPlan with_scratch = compute_memory_plan(cuda);
  EXPECT_EQ(with_scratch.device_scratch, size_t{20} * 1920 * 20480 * 2 + (size_t{32} << 20));
  EXPECT_EQ(with_scratch.device_total(), plan.device_total() + with_scratch.device_scratch);
  EXPECT_NE(with_scratch.describe().find("GEMM scratch"), std::string::npos);
  EXPECT_EQ(with_scratch.device_gather, 0u);  // the device gather needs only its lists

  // The host gather lands each way's largest transfer (a layer's K and V at 2048 positions) on
  // the device and in pinned staging: as much as the double-buffered staging again, each side.
  cuda.options.gather = GatherMode::Host;
  const MemoryPlan host_gather = compute_memory_plan(cuda);
  EXPECT_EQ(host_gather.device_gather, 1677721600u);
  EXPECT_EQ(host_gather.host_gather, 1677721600u);
  EXPECT_EQ(host_gather.device_total(), with_scratch.device_total() + 1677721600u);
  EXPECT_EQ(host_gather.host_total(), plan.host_total() + 1677721600u);
  EXPECT_NE(host_gather.describe().find("host gather"), std::string::npos);
}

TEST(MemoryPlanner, GpuPolicyNeedsTheWholeKvOnTheDevice) {
  MemoryRequest r = opt13b_request();
  r.options.policy = "gpu";
  const MemoryPlan plan = compute_memory_plan(r);
  EXPECT_EQ(plan.device_kv, 33554432000u);
  EXPECT_EQ(plan.host_kv_pool, 0u);
  EXPECT_EQ(plan.host_total(), 0u);
}

TEST(MemoryPlanner, H2oPoolsTheKeptEntriesAndStagesOnlyThemOnTheDevice) {
  MemoryRequest r = opt13b_request();
  r.options.policy = "h2o";
  r.options.h2o_budget = 0.2;
  const MemoryPlan plan = compute_memory_plan(r);
  // slots = floor(0.2 * 2048) = 409 per (layer, sequence, head). Host: 2 * L * B * H * slots * d
  // * 2; device: K and V of one layer with the new token's row, double-buffered.
  EXPECT_EQ(plan.host_kv_pool, size_t{2} * 40 * 20 * 40 * 409 * 128 * 2);
  EXPECT_EQ(plan.host_kv_pool, 6701056000u);
  EXPECT_EQ(plan.device_kv, size_t{2} * 2 * 20 * 40 * 410 * 128 * 2);
  EXPECT_EQ(plan.host_total(), plan.host_kv_pool);
  EXPECT_LT(plan.device_kv, compute_memory_plan(opt13b_request()).device_kv);  // less than full
}

TEST(MemoryPlanner, H2oRefusalKeepsThePolicyInItsSuggestion) {
  MemoryRequest r = opt13b_request();
  r.options.policy = "h2o";
  r.device_capacity = 24 * kGiB;  // the weights alone are 23.9 GiB
  const std::string refusal = expect_suggestion_fits(r, "; try --weights-gpu-percent ").refusal;
  EXPECT_EQ(refusal.find("--policy"), std::string::npos) << refusal;

  r = opt13b_request();
  r.options.policy = "h2o";
  r.host_capacity = 4 * kGiB;  // the kept entries take 6.24 GiB, 0.31 GiB per sequence
  EXPECT_EQ(expect_suggestion_fits(r, "; try --batch 12").refusal,
            "plan does not fit: the host needs 6.2 GiB of pinned memory (weights 0.0, KV pool "
            "6.2) but has 4.0 GiB available; try --batch 12");
}

TEST(MemoryPlanner, HalfTheWeightsOnTheHostNeedStagingForTwoLayers) {
  MemoryRequest r = opt13b_request();
  r.options.weights_gpu_percent = 50;
  const MemoryPlan plan = compute_memory_plan(r);
  // Per layer the midpoint rule keeps attention and fc1.weight (midpoint 157,317,120 of
  // 314,639,360 parameters); fc1.bias, fc2 and the final LayerNorm (F + D*F + D + 2*D) go to the
  // host. Embeddings, positions and the final norm always stay on the device.
  const size_t D = 5120, F = 20480;
  const size_t layer_host = (F + D * F + D + 2 * D) * 2;
  EXPECT_EQ(plan.host_weights, 40 * layer_host);
  EXPECT_EQ(plan.device_weights + plan.host_weights, 25706946560u);
  EXPECT_EQ(plan.device_weight_staging, 2 * layer_host);
  EXPECT_EQ(plan.host_total(), plan.host_weights + 33554432000u);
}

TEST(MemoryPlanner, FittingPlanIsReturned) {
  const MemoryRequest r = opt13b_request();
  const MemoryPlan plan = plan_memory(r);
  EXPECT_EQ(plan.device_total(), compute_memory_plan(r).device_total());
}

TEST(MemoryPlanner, SmallerBatchIsSuggestedAndFits) {
  MemoryRequest r = opt13b_request();
  r.device_capacity = 26 * kGiB;
  r.options.prefill_chunk = 256;  // the smallest chunk offered: a smaller batch comes next
  const MemoryPlan plan = compute_memory_plan(r);
  const auto [refusal, fixed] = expect_suggestion_fits(r, "; try --batch ");
  EXPECT_EQ(refusal.rfind("plan does not fit: the device needs " + gib1(plan.device_total()) +
                              " GiB (weights " + gib1(plan.device_weights) + ", KV " +
                              gib1(plan.device_kv) + ", activations " +
                              gib1(plan.device_activations) + ") but has 26.0 GiB; try --batch ",
                          0),
            0u)
      << refusal;
  EXPECT_LT(fixed.batch, r.batch);
  MemoryRequest one_more = fixed;
  one_more.batch += 1;
  EXPECT_THROW(plan_memory(one_more), Error);  // the largest batch that fits
}

// A long prompt whose one pass needs more activations than the device has is offered the
// largest chunk that fits, before anything that changes the batch or the policy; the plan counts
// the chunk's activations, not the prompt's.
TEST(MemoryPlanner, ALongPromptIsOfferedTheLargestChunkThatFits) {
  MemoryRequest r =
      testing_util::preset_request<MemoryRequest>("llama-3.1-8b", 4, 32768, 128, "full");
  r.device_capacity = 32 * kGiB;  // weights 15.0 GiB, activations of one pass 23.1 GiB
  r.host_capacity = 512 * kGiB;
  const MemoryPlan whole = compute_memory_plan(r);
  const MemoryRequest fixed = expect_suggestion_fits(r, "; try --prefill-chunk ").fixed;
  EXPECT_EQ(fixed.batch, r.batch);
  EXPECT_EQ(fixed.options.policy, r.options.policy);
  EXPECT_EQ(std::popcount(static_cast<uint64_t>(fixed.options.prefill_chunk)), 1);
  MemoryRequest larger = fixed;
  larger.options.prefill_chunk *= 2;
  EXPECT_THROW(plan_memory(larger), Error);  // the largest that fits
  const MemoryPlan chunked = compute_memory_plan(fixed);
  // Half the rows; the attention kernel's score blocks still span the whole prompt's keys.
  EXPECT_LT(chunked.device_activations, whole.device_activations * 6 / 10);
  EXPECT_EQ(chunked.device_kv, whole.device_kv);
  EXPECT_EQ(chunked.host_kv_pool, whole.host_kv_pool);
  // Where even the smallest chunk offered does not fit, the refusal says it was tried.
  r.device_capacity = kGiB;
  EXPECT_NE(plan_error(r).find("no configuration fits: even batch 1 with the 32768-token prompt "
                               "in chunks of 256,"),
            std::string::npos)
      << plan_error(r);
}

TEST(MemoryPlanner, WeightsOffTheDeviceWhenEvenBatchOneDoesNotFit) {
  MemoryRequest r = opt13b_request();
  r.device_capacity = 24 * kGiB;  // the weights alone are 23.9 GiB
  const MemoryRequest fixed =
      expect_suggestion_fits(r, "but has 24.0 GiB; try --weights-gpu-percent ").fixed;
  EXPECT_LT(fixed.options.weights_gpu_percent, 100);
  MemoryRequest more = fixed;
  more.options.weights_gpu_percent += 5;
  if (more.batch == r.batch) {
    EXPECT_THROW(plan_memory(more), Error);  // the largest share that fits
  }
}

TEST(MemoryPlanner, GpuPolicySuggestsOffloadingTheKv) {
  MemoryRequest r = opt13b_request();
  r.options.policy = "gpu";
  r.batch = 40;  // the KV alone is 62.5 GiB; a smaller batch still fits with the gpu policy
  const std::string refusal = expect_suggestion_fits(r, "; try --batch 12").refusal;
  EXPECT_NE(refusal.find("KV 62.5"), std::string::npos) << refusal;

  // Even one sequence does not fit (23.9 GiB weights + 1.6 GiB KV + activations): offload the KV
  // and move some weights to the host.
  r.batch = 20;
  r.device_capacity = 25 * kGiB;
  EXPECT_EQ(expect_suggestion_fits(r, "; try --policy full --weights-gpu-percent ").fixed.batch,
            20);
}

TEST(MemoryPlanner, HostShortfallSaysNeededAndAvailable) {
  MemoryRequest r = opt13b_request();
  r.host_capacity = 16 * kGiB;  // the pool is 31.25 GiB, 1.5625 GiB per sequence
  EXPECT_EQ(expect_suggestion_fits(r, "; try --batch 10").refusal,
            "plan does not fit: the host needs 31.2 GiB of pinned memory (weights 0.0, KV pool "
            "31.2) but has 16.0 GiB available; try --batch 10");
}

// A refused plan carries its table with the capacities and where it is short, for --dry-run to
// print above the refusal (a dry run printed only the refusal).
TEST(MemoryPlanner, ARefusalShowsThePlanWithWhatDoesNotFit) {
  MemoryRequest r = opt13b_request();
  r.device_capacity = 26 * kGiB;
  const MemoryPlan plan = compute_memory_plan(r);
  std::string marked;
  try {
    plan_memory(r);
  } catch (const PlanRefused& refused) {
    marked = refused.marked_plan();
  }
  EXPECT_EQ(marked, plan.describe(r));
  const std::string table = plan.describe();
  ASSERT_EQ(marked.rfind(table.substr(0, table.find("  total")), 0), 0u) << marked;
  EXPECT_NE(marked.find("  available           26.00 GiB     256.00 GiB\n"), std::string::npos)
      << marked;
  const double short_gib = (static_cast<double>(plan.device_total()) - 26 * kGiB) / kGiB;
  char line[96];
  std::snprintf(line, sizeof line, "  does not fit: the device is %.2f GiB short\n", short_gib);
  EXPECT_NE(marked.find(line), std::string::npos) << marked;
  EXPECT_EQ(marked.find("the host"), std::string::npos) << marked;

  // The host short as well: one RAM for both (the CPU backend) counts the device's part there.
  r.host_capacity = 16 * kGiB;
  r.shared_memory = true;
  const std::string both = plan.describe(r);
  EXPECT_NE(both.find("does not fit: the device is"), std::string::npos) << both;
  EXPECT_NE(both.find("does not fit: the host is"), std::string::npos) << both;
  EXPECT_NE(both.find("(it holds the device's part too: "), std::string::npos) << both;
  r.pinned_capacity = kGiB;
  EXPECT_NE(plan.describe(r).find("more than could be pinned"), std::string::npos);
  // A plan that fits: the capacities and no such line.
  EXPECT_EQ(compute_memory_plan(opt13b_request()).describe(opt13b_request()).find("does not fit"),
            std::string::npos);
}

TEST(MemoryPlanner, NothingFitsSaysSo) {
  MemoryRequest r = opt13b_request();
  r.device_capacity = kGiB / 2;
  const std::string message = plan_error(r);
  EXPECT_NE(message.find("the device needs"), std::string::npos) << message;
  EXPECT_EQ(message.find("try "), std::string::npos) << message;
  EXPECT_NE(message.find("no configuration fits: even batch 1 with the 1920-token prompt"),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("GiB more than the device has"), std::string::npos) << message;
}

// Sizes far beyond any machine saturate instead of wrapping round to a plan that fits.
TEST(MemoryPlanner, AbsurdSizesAreRefusedNotWrapped) {
  const int64_t huge = std::numeric_limits<int64_t>::max();
  // Each size the user gives: batch, prompt and generation lengths, pool block tokens.
  const std::vector<std::function<int64_t&(MemoryRequest&)>> sizes = {
      [](MemoryRequest& r) -> int64_t& { return r.batch; },
      [](MemoryRequest& r) -> int64_t& { return r.prompt_len; },
      [](MemoryRequest& r) -> int64_t& { return r.gen_len; },
      [](MemoryRequest& r) -> int64_t& { return r.options.kv_block_tokens; }};
  for (size_t field = 0; field < sizes.size(); ++field) {
    for (int64_t value : {int64_t{1000000000}, huge / 3, huge}) {
      for (const std::string policy : {"gpu", "full", "infinigen", "int4", "h2o"}) {
        // Only the paged pools of full and infinigen have blocks.
        if (field == 3 && policy != "full" && policy != "infinigen") continue;
        MemoryRequest r = opt13b_request();
        r.options.policy = policy;
        sizes[field](r) = value;
        const MemoryPlan plan = compute_memory_plan(r);
        EXPECT_TRUE(plan.device_total() > r.device_capacity || plan.host_total() > r.host_capacity)
            << policy << " " << value;
        EXPECT_THROW(plan_memory(r), Error) << policy << " " << value;
      }
    }
  }
}

// The CPU backend: device and host are one RAM, and OPT-13B's 23.9 GiB of weights cannot fit in
// 20 GiB whatever the placement, policy or batch. Said in those terms, with no suggestion.
TEST(MemoryPlanner, SharedMemoryTooSmallForTheWeightsSaysSo) {
  MemoryRequest r = opt13b_request();
  r.shared_memory = true;
  r.device_capacity = r.host_capacity = 20 * kGiB;
  const std::string message = plan_error(r);
  EXPECT_EQ(message.find("try "), std::string::npos) << message;
  EXPECT_NE(message.find("the host cannot hold the weights: opt-13b's weights are 23.9 GiB and "
                         "the host has 20.0 GiB available"),
            std::string::npos)
      << message;
}

// With device and host in one RAM, moving weights between them frees nothing: a suggestion must
// shrink what the run needs in total, and the planner must accept it.
TEST(MemoryPlanner, SharedMemorySuggestionsFit) {
  for (const std::string policy : {"gpu", "full", "infinigen", "h2o"}) {
    for (size_t gib : {16, 24, 40}) {
      for (int64_t batch : {8, 64, 1000000000}) {
        MemoryRequest r = opt13b_request();
        r.config = load_preset("opt-6.7b");
        r.shared_memory = true;
        r.options.policy = policy;
        r.batch = batch;
        r.device_capacity = r.host_capacity = gib * kGiB;
        if (plan_error(r).empty()) continue;
        expect_suggestion_fits(r, "; try ");
      }
    }
  }
}

// A host too small for InfiniGen's whole pool is offered a capped pool before anything that
// changes the policy.
// InfiniGen's dense layers keep their whole KV on the device when the plan fits with it there
// (auto), and stay in the host pool when it does not; asked on the device, a plan that does not
// fit is offered the host.
TEST(MemoryPlanner, DenseLayersKvIsPlacedOnTheDeviceWhenItFits) {
  MemoryRequest r =
      testing_util::preset_request<MemoryRequest>("llama-3.1-8b", 4, 32768, 128, "infinigen");
  r.options.prefill_chunk = 4096;
  r.options.row_cache = RowCacheUse::Off;  // decided after these placements (row_cache_test.cc)
  r.host_capacity = 512 * kGiB;
  r.device_capacity = 80 * kGiB;
  MemoryRequest host = r;
  host.options.dense_kv = KvPlacement::Host;
  const MemoryPlan loaded = compute_memory_plan(host);
  EXPECT_EQ(loaded.dense_kv, KvPlacement::Host);
  const MemoryPlan placed = plan_memory(r);
  EXPECT_EQ(placed.dense_kv, KvPlacement::Device);
  // No layer loads its whole KV in a decode step: the staging shrinks after the prompt to a
  // speculated layer's rows, the default cap of 20% of 32896 tokens and the new token. The
  // prompt's last pass needs the most in both plans, the whole staging beside every speculated
  // layer's partial keys (written on the device there), so the plans differ by the two dense
  // layers' K and V, (4, 8, 32896, 128) fp16 each.
  EXPECT_EQ(placed.decode_staging_rows, 32896 / 5 + 1);
  EXPECT_FALSE(loaded.decode_staging_rows.has_value());
  EXPECT_EQ(placed.device_kv - loaded.device_kv, size_t{2} * 2 * 4 * 8 * 32896 * 128 * 2);
  EXPECT_EQ(placed.host_kv_pool, loaded.host_kv_pool);  // the pool keeps every layer still
  EXPECT_NE(placed.describe().find("dense layers' KV is kept on the device"), std::string::npos);
  EXPECT_NE(placed.describe().find("the KV staging shrinks to 6580 rows"), std::string::npos);
  EXPECT_NE(loaded.describe().find("dense layers' KV is in the host pool"), std::string::npos);
  // Each step of the host placement loads the dense layers' KV; of the device one, nothing.
  const size_t dense_kv = size_t{2} * 2 * 4 * 8 * 32896 * 128 * 2;
  EXPECT_EQ(loaded.placement_reads, dense_kv);
  EXPECT_EQ(placed.placement_reads, 0);
  // Between the two plans' needs, auto keeps the dense layers' KV on the device and moves the
  // seven layers' partial keys, (4, 8, 32896, 38) fp16 each, that make room to host memory: a step
  // reads fewer bytes than the dense layers' KV.
  r.device_capacity = (loaded.device_total() + placed.device_total()) / 2;
  const MemoryPlan between = plan_memory(r);
  EXPECT_EQ(between.dense_kv, KvPlacement::Device);
  EXPECT_EQ(between.partial_key_host_layers, 7);
  EXPECT_EQ(between.placement_reads, size_t{7} * 4 * 8 * 32896 * 38 * 2);
  EXPECT_LT(between.placement_reads, dense_kv);
  // Asked on the device with every partial key there too, the refusal offers those seven layers'.
  r.options.dense_kv = KvPlacement::Device;
  r.options.partial_key_host_layers = 0;
  EXPECT_EQ(expect_suggestion_fits(r, "; try --partial-key-host-layers 7").fixed.batch, r.batch);
  // Where even every partial key in host memory leaves the device short with the dense layers'
  // KV on it (the prompt's passes hold it beside the whole staging), the refusal offers the host
  // pool.
  MemoryRequest lean = host;
  lean.options.partial_key_host_layers = 30;
  r.device_capacity = compute_memory_plan(lean).device_total();
  r.options.partial_key_host_layers = 30;
  EXPECT_EQ(expect_suggestion_fits(r, "; try --dense-kv host").fixed.batch, r.batch);
  // A policy without dense layers has no placement to report, and a capped pool keeps positions.
  EXPECT_FALSE(compute_memory_plan(opt13b_request()).dense_kv.has_value());
  MemoryRequest capped = host;
  capped.options.dense_kv = KvPlacement::Auto;
  capped.options.prefill_chunk = 0;
  capped.kv_pool_tokens = 1000;
  EXPECT_EQ(compute_memory_plan(capped).dense_kv, KvPlacement::Host);
}

// ShadowKV's points on an A100 (79 GiB usable, the a100-pcie4 profile), Llama-3.1-8B with its
// prompt in chunks: the largest do not fit with every speculated layer's partial keys on the
// device; the planner keeps as few layers' of them in host memory as it must.
TEST(MemoryPlanner, PartialKeysOfTheFewestLayersGoToHostMemoryWhenTheDeviceIsShort) {
  struct Point {
    int64_t batch, prompt_len, chunk;
  };
  for (const Point p : {Point{24, 124928, 1024}, Point{48, 61440, 512}}) {
    MemoryRequest r = testing_util::preset_request<MemoryRequest>("llama-3.1-8b", p.batch,
                                                                  p.prompt_len, 128, "infinigen");
    r.options.prefill_chunk = p.chunk;
    r.device_capacity = size_t{84825604096};
    r.host_capacity = 4096 * kGiB;
    r.gemm_scratch = true;
    const MemoryPlan plan = plan_memory(r);
    ASSERT_TRUE(plan.partial_key_host_layers.has_value());
    const int64_t on_host = *plan.partial_key_host_layers;
    EXPECT_GT(on_host, 0) << p.batch;
    EXPECT_LT(on_host, 30) << p.batch;
    MemoryRequest fewer = r;
    fewer.options.partial_key_host_layers = on_host - 1;
    fewer.options.dense_kv = *plan.dense_kv;
    EXPECT_THROW(plan_memory(fewer), Error) << p.batch;  // the fewest
    // One layer's partial keys, (B, 8, tokens, 38) fp16, moved from the device to the host.
    MemoryRequest one_more = fewer;
    one_more.options.partial_key_host_layers = on_host;
    const MemoryPlan a = compute_memory_plan(fewer), b = compute_memory_plan(one_more);
    const size_t layer = size_t{2} * p.batch * 8 * (p.prompt_len + 128) * 38;
    EXPECT_EQ(a.device_kv - b.device_kv, layer);
    EXPECT_EQ(b.host_kv_pool - a.host_kv_pool, layer);
    EXPECT_NE(plan.describe().find(" speculated layers keep their partial keys in host memory"),
              std::string::npos);
    // Asked for fewer than it needs, the refusal offers the number that fits.
    expect_suggestion_fits(fewer, cat("; try --partial-key-host-layers ", on_host));
  }
  // A point that fits keeps every partial key on the device.
  MemoryRequest small =
      testing_util::preset_request<MemoryRequest>("llama-3.1-8b", 4, 32768, 128, "infinigen");
  small.options.prefill_chunk = 4096;
  small.device_capacity = size_t{84825604096};
  small.host_capacity = 512 * kGiB;
  EXPECT_EQ(plan_memory(small).partial_key_host_layers, 0);
}

TEST(MemoryPlanner, InfinigenIsOfferedACappedPool) {
  MemoryRequest r = opt13b_request();
  r.options.policy = "infinigen";
  r.batch = 1;
  r.host_capacity = kGiB;  // the whole pool of one sequence is 1.56 GiB
  expect_suggestion_fits(r, "; try --kv-pool-limit 0.5");
}

// A run that could pin less than its plan is planned again with what it pinned: the refusal names
// the pinned share, and the suggestion fits in it.
TEST(MemoryPlanner, APinnedCapacityBoundsTheHostPartAndItsSuggestion) {
  MemoryRequest r = opt13b_request();
  r.options.policy = "full";
  r.batch = 8;
  EXPECT_NO_THROW(plan_memory(r));
  const MemoryPlan plan = compute_memory_plan(r);
  r.pinned_capacity = plan.host_total() / 2;
  const auto [refusal, fixed] = expect_suggestion_fits(r, "could be pinned; try ");
  EXPECT_NE(refusal.find("of host memory (weights "), std::string::npos) << refusal;
  EXPECT_LE(compute_memory_plan(fixed).host_total(), r.pinned_capacity);

  r.pinned_capacity = 0;  // nothing can be pinned: only the policy that keeps KV on the device
  expect_suggestion_fits(r, "; try ");
}

// When only the generation is too long, fewer generated tokens are offered, the most that fit.
TEST(MemoryPlanner, ShorterGenerationIsOfferedLast) {
  MemoryRequest r = opt13b_request();
  r.options.policy = "gpu";
  r.batch = 1;
  r.prompt_len = 64;
  r.gen_len = 1000000000;
  MemoryRequest one_more = expect_suggestion_fits(r, "; try --gen-len ").fixed;
  ++one_more.gen_len;
  EXPECT_THROW(plan_memory(one_more), Error);
}

TEST(MemoryPlanner, EverySuggestionFits) {
  for (const std::string policy : {"gpu", "full"}) {
    for (size_t device_gib : {2, 8, 16, 24, 40, 80}) {
      for (size_t host_gib : {4, 16, 64}) {
        for (int64_t batch : {1, 8, 64}) {
          for (double percent : {100.0, 37.0, 0.0}) {
            MemoryRequest r = opt13b_request();
            r.config = load_preset("opt-6.7b");
            r.options.policy = policy;
            r.batch = batch;
            r.options.weights_gpu_percent = percent;
            r.device_capacity = device_gib * kGiB;
            r.host_capacity = host_gib * kGiB;
            const std::string message = plan_error(r);
            if (message.empty() || message.find("; try ") == std::string::npos) continue;
            expect_suggestion_fits(r, "; try ");
          }
        }
      }
    }
  }
}

TEST(MemoryPlanner, BadRequestsThrow) {
  MemoryRequest r = opt13b_request();
  r.batch = 0;
  EXPECT_THROW(compute_memory_plan(r), Error);
  r = opt13b_request();
  r.options.weights_gpu_percent = 120;
  EXPECT_THROW(compute_memory_plan(r), Error);
}

}  // namespace
}  // namespace infinigen
