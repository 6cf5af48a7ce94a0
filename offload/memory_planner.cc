// offload: the memory plan of a request, and what to change when it does not fit.
#include "offload/memory_planner.h"

#include <algorithm>
#include <cstdio>
#include <limits>
#include <map>
#include <optional>
#include <vector>

#include "core/error.h"
#include "core/saturating.h"
#include "offload/h2o_kv.h"
#include "offload/int4_codec.h"
#include "offload/kv_pool.h"
#include "offload/weight_placement.h"
#include "speculate/speculation.h"

namespace infinigen {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
constexpr double kMiB = 1024.0 * 1024.0;

// Prefill attention scores: one block of query rows per worker thread, fp32.
constexpr int64_t kScoreBlockRows = 64;
constexpr int64_t kScoreThreads = 16;

// "12.3" (GiB, no unit), with `digits` decimals.
std::string gib(size_t bytes, int digits = 1) {
  char text[64];
  std::snprintf(text, sizeof(text), "%.*f", digits, static_cast<double>(bytes) / kGiB);
  return text;
}

// A size for the table: GiB from 1 GiB on, MiB below.
std::string human(size_t bytes) {
  if (bytes == 0) return "0";
  char text[64];
  if (static_cast<double>(bytes) >= kGiB) {
    std::snprintf(text, sizeof(text), "%.2f GiB", static_cast<double>(bytes) / kGiB);
  } else {
    std::snprintf(text, sizeof(text), "%.1f MiB", static_cast<double>(bytes) / kMiB);
  }
  return text;
}

// Enough decimals that a need above the capacity never prints as equal to it.
int digits_to_tell_apart(size_t need, size_t have) {
  int digits = 1;
  while (digits < 6 && gib(need, digits) == gib(have, digits)) ++digits;
  return digits;
}

// Positions per sequence, prompt and generated (saturating: both lengths come from the user).
int64_t positions(const MemoryRequest& r) {
  return r.prompt_len > std::numeric_limits<int64_t>::max() - r.gen_len
             ? std::numeric_limits<int64_t>::max()
             : r.prompt_len + r.gen_len;
}

// What the host must give: its pinned part, and where device and host share one RAM (the CPU
// backend) the device part as well.
size_t host_need(const MemoryPlan& plan, const MemoryRequest& request) {
  return request.shared_memory ? saturating_sum({plan.host_total(), plan.device_total()})
                               : plan.host_total();
}

bool device_fits(const MemoryPlan& plan, const MemoryRequest& request) {
  return plan.device_total() <= request.device_capacity;
}
bool pinned_fits(const MemoryPlan& plan, const MemoryRequest& request) {
  return plan.host_total() <= request.pinned_capacity;
}
bool host_fits(const MemoryPlan& plan, const MemoryRequest& request) {
  return host_need(plan, request) <= request.host_capacity && pinned_fits(plan, request);
}
bool fits(const MemoryRequest& request) {
  const MemoryPlan plan = compute_memory_plan(request);
  return device_fits(plan, request) && host_fits(plan, request);
}

// The largest value in [1, most] of the size `field` with which `request` fits, 0 if none. Every
// term of the plan grows with the batch and with the lengths, so a binary search finds it.
int64_t largest_fitting(MemoryRequest request, int64_t MemoryRequest::*field, int64_t most) {
  request.*field = 1;
  if (most < 1 || !fits(request)) return 0;
  int64_t lo = 1, hi = most;  // fits at lo
  while (lo < hi) {
    request.*field = lo + (hi - lo + 1) / 2;
    if (fits(request)) {
      lo = request.*field;
    } else {
      hi = request.*field - 1;
    }
  }
  return lo;
}

}  // namespace

const char* kv_policy_name(KvPolicy policy) {
  switch (policy) {
    case KvPolicy::Gpu:
      return "gpu";
    case KvPolicy::Full:
      return "full";
    case KvPolicy::Infinigen:
      return "infinigen";
    case KvPolicy::Int4:
      return "int4";
    case KvPolicy::H2o:
      return "h2o";
  }
  return "?";
}

namespace {

// Shares of the full KV that a capped InfiniGen pool is offered at (--kv-pool-limit).
constexpr double kPoolLimits[] = {0.5, 0.25, 0.1};

// A configuration that fits, the flags that make it, and the pool limit those flags name.
struct Candidate {
  MemoryRequest request;
  double pool_limit = 0.0;  // --kv-pool-limit, 0 = unchanged
};

// The flags that turn `from` into `to`, e.g. "--policy full --weights-gpu-percent 60".
std::string flags_for(const MemoryRequest& from, const Candidate& to) {
  std::string flags;
  auto add = [&flags](const std::string& flag) { flags += (flags.empty() ? "" : " ") + flag; };
  const MemoryRequest& r = to.request;
  if (r.policy != from.policy) add(cat("--policy ", kv_policy_name(r.policy)));
  if (r.weights_gpu_percent != from.weights_gpu_percent) {
    add(cat("--weights-gpu-percent ", r.weights_gpu_percent));
  }
  if (r.kv_block_tokens != from.kv_block_tokens) add(cat("--kv-block-tokens ", r.kv_block_tokens));
  if (to.pool_limit > 0) add(cat("--kv-pool-limit ", to.pool_limit));
  if (r.batch != from.batch) add(cat("--batch ", r.batch));
  if (r.gen_len != from.gen_len) add(cat("--gen-len ", r.gen_len));
  return flags;
}

// A configuration close to `request` that fits; none when nothing does. Every candidate is
// planned here, so what is suggested is what the planner accepts. Preference, from the change
// that alters the experiment least: pool blocks no longer than the default; a smaller batch; for
// infinigen a capped host pool; per policy (offloading first, as it needs the least device memory)
// the largest share of weights on the device (steps of 5) with the batch kept, then with the
// largest batch that fits at that share; last, fewer generated tokens.
std::optional<Candidate> suggest_fitting(const MemoryRequest& asked) {
  // Candidates are planned against the capacities less the margin, and flags are relative to
  // what was asked.
  MemoryRequest request = asked;
  if (request.suggestion_margin > 0) {
    const double keep = 1.0 - request.suggestion_margin;
    request.device_capacity =
        static_cast<size_t>(static_cast<double>(request.device_capacity) * keep);
    request.host_capacity = static_cast<size_t>(static_cast<double>(request.host_capacity) * keep);
    if (request.pinned_capacity != std::numeric_limits<size_t>::max()) {
      request.pinned_capacity =
          static_cast<size_t>(static_cast<double>(request.pinned_capacity) * keep);
    }
  }
  // Pool blocks longer than a sequence only add padding: blocks of the default size first.
  const int64_t default_block = MemoryRequest{}.kv_block_tokens;
  if (request.kv_block_tokens > std::max(default_block, positions(request))) {
    Candidate shorter_blocks{request};
    shorter_blocks.request.kv_block_tokens = default_block;
    if (fits(shorter_blocks.request)) return shorter_blocks;
  }
  if (const int64_t batch = largest_fitting(request, &MemoryRequest::batch, request.batch - 1);
      batch > 0) {
    Candidate smaller{request};
    smaller.request.batch = batch;
    return smaller;
  }
  if (request.policy == KvPolicy::Infinigen && request.kv_pool_tokens == 0) {
    const int64_t tokens = positions(request);
    for (double limit : kPoolLimits) {
      Candidate capped{request, limit};
      capped.request.kv_pool_tokens = static_cast<int64_t>(limit * static_cast<double>(tokens));
      if (capped.request.kv_pool_tokens >= 2 && fits(capped.request)) return capped;
    }
  }
  // h2o keeps its own policy first: its staging is smaller than `full`'s, and switching would
  // change what the run measures.
  std::vector<KvPolicy> policies = {KvPolicy::Full, KvPolicy::Gpu};
  if (request.policy == KvPolicy::H2o) policies.insert(policies.begin(), KvPolicy::H2o);
  for (KvPolicy policy : policies) {
    Candidate candidate{request};
    candidate.request.policy = policy;
    candidate.request.kv_pool_tokens = 0;  // a pool limit is infinigen's alone
    for (int percent = 100; percent >= 0; percent -= 5) {
      candidate.request.weights_gpu_percent = percent;
      if (fits(candidate.request)) return candidate;
    }
    for (int percent = 100; percent >= 0; percent -= 5) {
      candidate.request.weights_gpu_percent = percent;
      if (const int64_t batch =
              largest_fitting(candidate.request, &MemoryRequest::batch, request.batch);
          batch > 0) {
        candidate.request.batch = batch;
        return candidate;
      }
    }
  }
  if (const int64_t gen = largest_fitting(request, &MemoryRequest::gen_len, request.gen_len - 1);
      gen > 0) {
    Candidate shorter{request};
    shorter.request.gen_len = gen;
    return shorter;
  }
  return std::nullopt;
}

// Why nothing fits, in terms of the resource that is short: the weights alone when the host
// cannot hold them (device and host sharing one RAM), else the leanest plan there is (batch 1,
// one generated token, all weights streamed by the `full` policy) and what it lacks.
std::string why_nothing_fits(const MemoryRequest& request) {
  MemoryRequest lean = request;
  lean.batch = 1;
  lean.gen_len = 1;
  lean.policy = KvPolicy::Full;
  lean.weights_gpu_percent = 0;
  lean.kv_pool_tokens = 0;
  const MemoryPlan plan = compute_memory_plan(lean);
  const size_t weights = saturating_sum({plan.device_weights, plan.host_weights});
  if (request.shared_memory && weights > request.host_capacity) {
    const int digits = digits_to_tell_apart(weights, request.host_capacity);
    return cat("the host cannot hold the weights: ", request.config.name, "'s weights are ",
               gib(weights, digits), " GiB and the host has ", gib(request.host_capacity, digits),
               " GiB available");
  }
  const std::string lean_setting =
      cat("even batch 1 with the ", request.prompt_len,
          "-token prompt, --gen-len 1, --policy full --weights-gpu-percent 0");
  if (!device_fits(plan, lean)) {
    const size_t short_by = plan.device_total() - request.device_capacity;
    return cat("no configuration fits: ", lean_setting, " needs ", gib(plan.device_total(), 2),
               " GiB of device memory, ", gib(short_by, 2), " GiB more than the device has");
  }
  if (!pinned_fits(plan, lean)) {
    const size_t short_by = plan.host_total() - request.pinned_capacity;
    return cat("no configuration fits: ", lean_setting, " pins ", gib(plan.host_total(), 2),
               " GiB of host memory, ", gib(short_by, 2), " GiB more than could be pinned");
  }
  const size_t need = host_need(plan, lean);
  const size_t short_by = need > request.host_capacity ? need - request.host_capacity : 0;
  return cat("no configuration fits: ", lean_setting, " needs ", gib(need, 2),
             " GiB of host memory, ", gib(short_by, 2), " GiB more than is available");
}

}  // namespace

size_t MemoryPlan::device_total() const {
  return saturating_sum({device_weights, device_weight_staging, device_kv, device_activations});
}

size_t MemoryPlan::host_total() const {
  return saturating_sum({host_weights, host_kv_pool});
}

std::string MemoryPlan::describe() const {
  char line[160];
  std::string text;
  auto row = [&](const char* what, const std::string& device, const std::string& host) {
    std::snprintf(line, sizeof(line), "  %-16s %12s %14s\n", what, device.c_str(), host.c_str());
    text += line;
  };
  row("memory plan", "device", "host (pinned)");
  row("weights", human(device_weights), human(host_weights));
  row("weight staging", human(device_weight_staging), "-");
  row("KV cache", human(device_kv), human(host_kv_pool));
  row("activations", human(device_activations), "-");
  row("total", human(device_total()), human(host_total()));
  return text;
}

MemoryPlan compute_memory_plan(const MemoryRequest& r) {
  const ModelConfig& c = r.config;
  INFINIGEN_CHECK(
      c.num_layers > 0 && c.hidden_size > 0 && c.num_heads > 0 && c.ffn_dim > 0 && c.vocab_size > 0,
      "memory plan: model ", c.name, " has an invalid configuration");
  INFINIGEN_CHECK(r.batch >= 1, "memory plan: batch must be at least 1, got ", r.batch);
  INFINIGEN_CHECK(r.prompt_len >= 1, "memory plan: prompt length must be at least 1, got ",
                  r.prompt_len);
  INFINIGEN_CHECK(r.gen_len >= 0, "memory plan: generation length must be at least 0, got ",
                  r.gen_len);
  MemoryPlan plan;

  // Weights: by tensor; staging holds the host-resident part of two groups (the one in use and
  // the one being loaded), sized by the largest group.
  std::map<std::string, size_t> host_group_bytes;
  for (const WeightHome& home : place_weights(c, r.weights_gpu_percent)) {
    if (home.on_device) {
      plan.device_weights += home.bytes;
    } else {
      plan.host_weights += home.bytes;
      // Group key: "model.decoder.layers.N." for a layer, "" for the embeddings group.
      const std::string layers = "model.decoder.layers.";
      std::string group;
      if (home.name.starts_with(layers)) {
        group = home.name.substr(0, home.name.find('.', layers.size()) + 1);
      }
      host_group_bytes[group] += home.bytes;
    }
  }
  size_t largest_host_group = 0;
  for (const auto& [group, bytes] : host_group_bytes) {
    largest_host_group = std::max(largest_host_group, bytes);
  }
  plan.device_weight_staging = 2 * largest_host_group;

  // KV: the gpu policy keeps all of it, 2 * L * B * (prompt + gen) * D; offloading policies stage
  // one layer's K and V, double-buffered, 2 * 2 * B * H * (prompt + gen) * d. Products saturate:
  // sizes come from the user and an absurd one must read as too large, not wrap round.
  const int64_t B = r.batch;
  const int64_t tokens = positions(r);
  const auto kv_size = static_cast<int64_t>(dtype_size(r.kv_dtype));
  const int64_t L = c.num_layers, H = c.num_heads, D = c.hidden_size, d = c.head_dim();
  if (r.policy == KvPolicy::Gpu) {
    plan.device_kv = saturating_product({2, L, B, tokens, D, kv_size});
  } else if (r.policy == KvPolicy::H2o) {
    // The kept entries (`slots` per layer, sequence and head) in the host pool; on the device only
    // their staging, K and V of one layer with a row for the new token, double-buffered.
    const int64_t slots = h2o_slots(r.h2o_budget, tokens);
    plan.host_kv_pool = saturating_product({2, L, B, H, slots, d, kv_size});
    plan.device_kv = saturating_product({2, 2, B, H, slots + 1, d, kv_size});
  } else {
    plan.device_kv = saturating_product({2, 2, B, H, tokens, d, kv_size});
    KvPoolShape pool;
    pool.num_layers = c.num_layers;
    pool.batch = r.batch;
    pool.num_heads = c.num_heads;
    pool.head_dim = c.head_dim();
    pool.max_tokens = r.kv_pool_tokens > 0 ? std::min(r.kv_pool_tokens, tokens) : tokens;
    pool.block_tokens = r.kv_block_tokens;
    pool.dtype = r.kv_dtype;
    plan.host_kv_pool = KvPool::capacity_bytes(pool);
    if (r.policy == KvPolicy::Int4) {
      // Packed 4-bit codes plus an fp16 min and scale per group of 64, on the host and in the
      // device's code staging (two layers); dequantised into the fp16 staging counted above.
      const auto row = static_cast<int64_t>(int4_row_bytes(c.head_dim()));
      plan.host_kv_pool = saturating_product({2, L, B, H, tokens, row});
      plan.device_kv =
          saturating_sum({plan.device_kv, saturating_product({2, 2, B, H, tokens, row})});
    }
    if (r.policy == KvPolicy::Infinigen) {
      // Per layer: the partial key cache (B, H, tokens, rp) and the partial query weights and
      // bias (H, rp, D + 1) in fp32.
      const int64_t rp = partial_columns(r.partial_ratio, d);
      const auto partial_size = static_cast<int64_t>(dtype_size(r.partial_key_dtype));
      plan.device_kv =
          saturating_sum({plan.device_kv, saturating_product({L, B, H, tokens, rp, partial_size}),
                          saturating_product({L, H, rp, D + 1, 4})});
    }
  }

  // Activations: the prefill peak (n = prompt_len), all fp32:
  //   hidden, normed, q, k, v, attention output   6 * B * n * D * 4
  //   FFN intermediate                            B * n * F * 4
  //   logits of the last position                 B * V * 4
  //   attention scores, one 64-row query block per worker (16 workers)   64 * n * 4 * 16
  const int64_t n = r.prompt_len, F = c.ffn_dim, V = c.vocab_size;
  plan.device_activations = saturating_sum(
      {saturating_product({6, B, n, D, 4}), saturating_product({B, n, F, 4}),
       saturating_product({B, V, 4}), saturating_product({kScoreBlockRows, n, 4, kScoreThreads})});
  return plan;
}

MemoryPlan plan_memory(const MemoryRequest& request) {
  const MemoryPlan plan = compute_memory_plan(request);
  const bool device_ok = device_fits(plan, request);
  const bool host_ok = host_fits(plan, request);
  if (device_ok && host_ok) return plan;

  std::vector<std::string> parts;
  if (!device_ok) {
    const int digits = digits_to_tell_apart(plan.device_total(), request.device_capacity);
    std::string weights = cat("weights ", gib(plan.device_weights, digits));
    if (plan.device_weight_staging > 0) {
      weights += cat(", weight staging ", gib(plan.device_weight_staging, digits));
    }
    parts.push_back(cat("the device needs ", gib(plan.device_total(), digits), " GiB (", weights,
                        ", KV ", gib(plan.device_kv, digits), ", activations ",
                        gib(plan.device_activations, digits), ") but has ",
                        gib(request.device_capacity, digits), " GiB"));
  }
  if (!pinned_fits(plan, request)) {
    parts.push_back(cat("the plan pins ", human(plan.host_total()), " of host memory (weights ",
                        human(plan.host_weights), ", KV pool ", human(plan.host_kv_pool),
                        ") but only ", human(request.pinned_capacity), " could be pinned"));
  } else if (!host_ok) {
    const size_t need = host_need(plan, request);
    const int digits = digits_to_tell_apart(need, request.host_capacity);
    const std::string what =
        request.shared_memory
            ? cat(" GiB (the device's part ", gib(plan.device_total(), digits), ", pinned weights ")
            : std::string(" GiB of pinned memory (weights ");
    parts.push_back(cat("the host needs ", gib(need, digits), what, gib(plan.host_weights, digits),
                        ", KV pool ", gib(plan.host_kv_pool, digits), ") but has ",
                        gib(request.host_capacity, digits), " GiB available"));
  }
  if (const std::optional<Candidate> fitting = suggest_fitting(request)) {
    parts.push_back("try " + flags_for(request, *fitting));
  } else {
    parts.push_back(why_nothing_fits(request));
  }
  std::string message = "plan does not fit: ";
  for (size_t i = 0; i < parts.size(); ++i) message += (i ? "; " : "") + parts[i];
  throw Error(message);
}

}  // namespace infinigen
