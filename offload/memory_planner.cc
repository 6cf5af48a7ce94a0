// offload: the memory plan of a request, and what to change when it does not fit.
#include "offload/memory_planner.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <vector>

#include "core/error.h"
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
constexpr size_t kScoreBlockRows = 64;
constexpr size_t kScoreThreads = 16;

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

bool device_fits(const MemoryPlan& plan, const MemoryRequest& request) {
  return plan.device_total() <= request.device_capacity;
}
bool host_fits(const MemoryPlan& plan, const MemoryRequest& request) {
  return plan.host_total() <= request.host_capacity;
}
bool fits(const MemoryRequest& request) {
  const MemoryPlan plan = compute_memory_plan(request);
  return device_fits(plan, request) && host_fits(plan, request);
}

// The largest batch in [1, max_batch] with which `request` fits on both sides, 0 if none. Every
// term of the plan grows with the batch, so a binary search finds it.
int64_t largest_fitting_batch(MemoryRequest request, int64_t max_batch) {
  request.batch = 1;
  if (max_batch < 1 || !fits(request)) return 0;
  int64_t lo = 1, hi = max_batch;  // fits at lo
  while (lo < hi) {
    request.batch = lo + (hi - lo + 1) / 2;
    if (fits(request)) {
      lo = request.batch;
    } else {
      hi = request.batch - 1;
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

// The flags that turn `from` into `to`, e.g. "--policy full --weights-gpu-percent 60".
std::string flags_for(const MemoryRequest& from, const MemoryRequest& to) {
  std::string flags;
  auto add = [&flags](const std::string& flag) { flags += (flags.empty() ? "" : " ") + flag; };
  if (to.policy != from.policy) add(cat("--policy ", kv_policy_name(to.policy)));
  if (to.weights_gpu_percent != from.weights_gpu_percent) {
    add(cat("--weights-gpu-percent ", to.weights_gpu_percent));
  }
  if (to.batch != from.batch) add(cat("--batch ", to.batch));
  return flags;
}

// A configuration close to `request` that fits, as flags; empty when nothing fits.
// Preference: a smaller batch alone; then, per policy (offloading first, as it needs the least
// device memory), the largest share of weights on the device (steps of 5) with the batch kept,
// then with the largest batch that fits at that share.
std::string suggest_fitting(const MemoryRequest& request) {
  if (const int64_t batch = largest_fitting_batch(request, request.batch - 1); batch > 0) {
    MemoryRequest smaller = request;
    smaller.batch = batch;
    return flags_for(request, smaller);
  }
  // h2o keeps its own policy first: its staging is smaller than `full`'s, and switching would
  // change what the run measures.
  std::vector<KvPolicy> policies = {KvPolicy::Full, KvPolicy::Gpu};
  if (request.policy == KvPolicy::H2o) policies.insert(policies.begin(), KvPolicy::H2o);
  for (KvPolicy policy : policies) {
    MemoryRequest candidate = request;
    candidate.policy = policy;
    for (int percent = 100; percent >= 0; percent -= 5) {
      candidate.weights_gpu_percent = percent;
      if (fits(candidate)) return flags_for(request, candidate);
    }
    for (int percent = 100; percent >= 0; percent -= 5) {
      candidate.weights_gpu_percent = percent;
      if (const int64_t batch = largest_fitting_batch(candidate, request.batch); batch > 0) {
        candidate.batch = batch;
        return flags_for(request, candidate);
      }
    }
  }
  return "";
}

}  // namespace

size_t MemoryPlan::device_total() const {
  return device_weights + device_weight_staging + device_kv + device_activations;
}

size_t MemoryPlan::host_total() const {
  return host_weights + host_kv_pool;
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
  // one layer's K and V, double-buffered, 2 * 2 * B * H * (prompt + gen) * d.
  const size_t B = static_cast<size_t>(r.batch);
  const size_t tokens = static_cast<size_t>(r.prompt_len + r.gen_len);
  const size_t kv_size = dtype_size(r.kv_dtype);
  const size_t L = static_cast<size_t>(c.num_layers), H = static_cast<size_t>(c.num_heads);
  const size_t D = static_cast<size_t>(c.hidden_size), d = static_cast<size_t>(c.head_dim());
  if (r.policy == KvPolicy::Gpu) {
    plan.device_kv = 2 * L * B * tokens * D * kv_size;
  } else if (r.policy == KvPolicy::H2o) {
    // The kept entries (`slots` per layer, sequence and head) in the host pool; on the device only
    // their staging, K and V of one layer with a row for the new token, double-buffered.
    const auto slots = static_cast<size_t>(h2o_slots(r.h2o_budget, static_cast<int64_t>(tokens)));
    plan.host_kv_pool = 2 * L * B * H * slots * d * kv_size;
    plan.device_kv = 2 * 2 * B * H * (slots + 1) * d * kv_size;
  } else {
    plan.device_kv = 2 * 2 * B * H * tokens * d * kv_size;
    KvPoolShape pool;
    pool.num_layers = c.num_layers;
    pool.batch = r.batch;
    pool.num_heads = c.num_heads;
    pool.head_dim = c.head_dim();
    pool.max_tokens = r.kv_pool_tokens > 0
                          ? std::min<int64_t>(r.kv_pool_tokens, static_cast<int64_t>(tokens))
                          : static_cast<int64_t>(tokens);
    pool.block_tokens = r.kv_block_tokens;
    pool.dtype = r.kv_dtype;
    plan.host_kv_pool = KvPool::capacity_bytes(pool);
    if (r.policy == KvPolicy::Int4) {
      // Packed 4-bit codes plus an fp16 min and scale per group of 64, on the host and in the
      // device's code staging (two layers); dequantised into the fp16 staging counted above.
      const size_t row = int4_row_bytes(c.head_dim());
      plan.host_kv_pool = 2 * L * B * H * tokens * row;
      plan.device_kv += 2 * 2 * B * H * tokens * row;
    }
    if (r.policy == KvPolicy::Infinigen) {
      const size_t rp =
          static_cast<size_t>(partial_columns(r.partial_ratio, static_cast<int64_t>(d)));
      plan.device_kv +=
          L * (B * H * tokens * rp * dtype_size(r.partial_key_dtype) + (H * rp * D + H * rp) * 4);
    }
  }

  // Activations: the prefill peak (n = prompt_len), all fp32:
  //   hidden, normed, q, k, v, attention output   6 * B * n * D * 4
  //   FFN intermediate                            B * n * F * 4
  //   logits of the last position                 B * V * 4
  //   attention scores, one 64-row query block per worker (16 workers)   64 * n * 4 * 16
  const size_t n = static_cast<size_t>(r.prompt_len);
  const size_t F = static_cast<size_t>(c.ffn_dim), V = static_cast<size_t>(c.vocab_size);
  plan.device_activations =
      6 * B * n * D * 4 + B * n * F * 4 + B * V * 4 + kScoreBlockRows * n * 4 * kScoreThreads;
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
  if (!host_ok) {
    const int digits = digits_to_tell_apart(plan.host_total(), request.host_capacity);
    parts.push_back(cat("the host needs ", gib(plan.host_total(), digits),
                        " GiB of pinned memory (weights ", gib(plan.host_weights, digits),
                        ", KV pool ", gib(plan.host_kv_pool, digits), ") but has ",
                        gib(request.host_capacity, digits), " GiB available"));
  }
  const std::string flags = suggest_fitting(request);
  if (flags.empty()) {
    parts.push_back("no smaller batch, --weights-gpu-percent or --policy fits on this machine");
  } else {
    parts.push_back("try " + flags);
  }
  std::string message = "plan does not fit: ";
  for (size_t i = 0; i < parts.size(); ++i) message += (i ? "; " : "") + parts[i];
  throw Error(message);
}

}  // namespace infinigen
