// offload: the memory plan of a request, and what to change when it does not fit.
#include "offload/memory_planner.h"

#include <algorithm>
#include <bit>
#include <cstdio>
#include <limits>
#include <map>
#include <optional>
#include <vector>

#include "core/activations.h"
#include "core/error.h"
#include "core/model.h"
#include "core/saturating.h"
#include "core/weights.h"
#include "offload/kv_policy.h"
#include "offload/kv_pool.h"
#include "offload/weight_placement.h"

namespace infinigen {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
constexpr double kMiB = 1024.0 * 1024.0;

// Beyond the model's activation buffers: the CPU attention kernel's prefill scores, one block of
// 64 query rows by the prompt's keys per worker thread (kernels/cpu/attention.cc's kQueryBlock),
// fp32, counted for up to 16 workers. They live only while the kernel runs.
constexpr int64_t kScoreBlockRows = 64;
constexpr int64_t kScoreThreads = 16;
// cuBLAS's default workspace on Hopper (32 MiB; 4 MiB before): the larger, for any GPU.
constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;

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

namespace {

// Shares of the full KV that a capped InfiniGen pool is offered at (--kv-pool-limit).
constexpr double kPoolLimits[] = {0.5, 0.25, 0.1};
// The smallest prompt chunk offered (--prefill-chunk): below it a pass's GEMMs are too thin to
// keep a GPU busy, and each chunk reloads the KV before it.
constexpr int64_t kSmallestChunk = 256;

// A configuration that fits, the flags that make it, and the pool limit those flags name.
struct Candidate {
  MemoryRequest request;
  double pool_limit = 0.0;  // --kv-pool-limit, 0 = unchanged
};

// The options that turn `from` into `to`, e.g. "--policy full --weights-gpu-percent 60" as the
// CLI spells them.
std::string flags_for(const MemoryRequest& from, const Candidate& to) {
  std::string flags;
  auto add = [&flags](const std::string& flag) { flags += (flags.empty() ? "" : " ") + flag; };
  const MemoryRequest& r = to.request;
  const OffloadOptions &was = from.options, &now = r.options;
  if (now.policy != was.policy) add(cat(option("policy"), " ", now.policy));
  if (now.weights_gpu_percent != was.weights_gpu_percent) {
    add(cat(option("weights_gpu_percent"), " ", now.weights_gpu_percent));
  }
  if (now.kv_block_tokens != was.kv_block_tokens) {
    add(cat(option("kv_block_tokens"), " ", now.kv_block_tokens));
  }
  if (now.prefill_chunk != was.prefill_chunk) {
    add(cat(option("prefill_chunk"), " ", now.prefill_chunk));
  }
  if (now.dense_kv != was.dense_kv) {
    add(cat(option("dense_kv"), " ", find_option(offload_option_table(), "dense_kv")->format(now)));
  }
  if (now.partial_key_host_layers != was.partial_key_host_layers) {
    add(cat(option("partial_key_host_layers"), " ", now.partial_key_host_layers));
  }
  if (to.pool_limit > 0) add(cat(option("kv_pool_limit"), " ", to.pool_limit));
  if (r.batch != from.batch) add(cat(option("batch"), " ", r.batch));
  if (r.gen_len != from.gen_len) add(cat(option("gen_len"), " ", r.gen_len));
  return flags;
}

// A capacity less the suggestion margin of `request` (unlimited stays unlimited).
size_t kept_capacity(size_t capacity, const MemoryRequest& request) {
  if (request.suggestion_margin <= 0 || capacity == std::numeric_limits<size_t>::max()) {
    return capacity;
  }
  return static_cast<size_t>(static_cast<double>(capacity) * (1.0 - request.suggestion_margin));
}

// `request` planned against its capacities less its suggestion margin.
MemoryRequest less_margin(MemoryRequest request) {
  request.device_capacity = kept_capacity(request.device_capacity, request);
  request.host_capacity = kept_capacity(request.host_capacity, request);
  request.pinned_capacity = kept_capacity(request.pinned_capacity, request);
  return request;
}

// The first of `bases` on which a smaller `member` (at most `most`) fits, with the largest such.
std::optional<Candidate> first_fitting(const std::vector<MemoryRequest>& bases,
                                       int64_t MemoryRequest::*member, int64_t most) {
  for (const MemoryRequest& base : bases) {
    if (const int64_t value = largest_fitting(base, member, most); value > 0) {
      Candidate candidate{base};
      candidate.request.*member = value;
      return candidate;
    }
  }
  return std::nullopt;
}

// A configuration close to `request` that fits; none when nothing does. Every candidate is
// planned here, so what is suggested is what the planner accepts. Preference, from the change
// that alters the experiment least: pool blocks no longer than the default; the prompt in the
// largest chunk that fits (powers of two down to kSmallestChunk) for a policy that computes it in
// chunks; then, each on the request as asked and else with the smallest chunk: a smaller batch;
// a capped host pool for a policy that reads one (as asked only: no chunk with it); per policy
// (the asked one first unless it is exact, then the exact ones in registration order, offloading
// before resident as it needs the least device memory) the largest share of weights on the device
// (steps of 5) with the batch kept, then with the largest batch that fits at that share; last,
// fewer generated tokens.
std::optional<Candidate> suggest_fitting(const MemoryRequest& asked) {
  // Candidates are planned against the capacities less the margin, and flags are relative to
  // what was asked.
  const MemoryRequest request = less_margin(asked);
  // Pool blocks longer than a sequence only add padding: blocks of the default size first.
  const int64_t default_block = OffloadOptions{}.kv_block_tokens;
  if (request.options.kv_block_tokens > std::max(default_block, request_positions(request))) {
    Candidate shorter_blocks{request};
    shorter_blocks.request.options.kv_block_tokens = default_block;
    if (fits(shorter_blocks.request)) return shorter_blocks;
  }
  // Partial keys of a number of layers asked in host memory: as many as the plan needs, the dense
  // layers' KV kept where it was asked.
  if (request.options.partial_key_host_layers >= 0 &&
      policy_reads_option(request.options.policy, "partial_key_host_layers")) {
    Candidate more{request};
    more.request.options.partial_key_host_layers = -1;
    more.request = with_placements(more.request);
    more.request.options.dense_kv = request.options.dense_kv;
    if (fits(more.request)) return more;
  }
  // The dense layers' KV asked on the device: in the host pool, loaded every step. After partial
  // keys: while the staging shrinks after the prompt, a dense layer's KV on the device costs little
  // device memory in the decode steps, and loading it moves more bytes per step than a few layers'
  // partial keys (offload/infinigen_kv.h).
  if (request.options.dense_kv == KvPlacement::Device) {
    Candidate loaded{request};
    loaded.request.options.dense_kv = KvPlacement::Host;
    if (fits(loaded.request)) return loaded;
  }
  const bool chunkable =
      policy_reads_option(request.options.policy, "prefill_chunk") && request.kv_pool_tokens == 0;
  if (chunkable) {
    const int64_t rows = largest_prompt_pass(request.prompt_len, request.options.prefill_chunk);
    for (int64_t chunk = static_cast<int64_t>(std::bit_floor(static_cast<uint64_t>(rows - 1)));
         rows > kSmallestChunk && chunk >= kSmallestChunk; chunk /= 2) {
      Candidate chunked{request};
      chunked.request.options.prefill_chunk = chunk;
      if (fits(chunked.request)) return chunked;
    }
  }
  // The changes below are tried on the request as asked, then (when no chunk alone fits) with
  // its prompt in the smallest chunk offered, so that a suggestion names a chunk only when it
  // needs one.
  std::vector<MemoryRequest> bases = {request};
  if (chunkable && request.prompt_len > kSmallestChunk &&
      (request.options.prefill_chunk == 0 || request.options.prefill_chunk > kSmallestChunk)) {
    bases.push_back(request);
    bases.back().options.prefill_chunk = kSmallestChunk;
  }
  if (auto smaller = first_fitting(bases, &MemoryRequest::batch, request.batch - 1)) return smaller;
  if (request.kv_pool_tokens == 0 && request.options.prefill_chunk == 0 &&
      policy_reads_option(request.options.policy, "kv_pool_limit")) {
    const int64_t tokens = request_positions(request);
    for (double limit : kPoolLimits) {
      Candidate capped{request, limit};
      capped.request.kv_pool_tokens = static_cast<int64_t>(limit * static_cast<double>(tokens));
      if (capped.request.kv_pool_tokens >= 2 && fits(capped.request)) return capped;
    }
  }
  // A policy that is not exact keeps itself first: switching would change what the run measures.
  std::vector<const KvPolicy*> policies;
  if (!kv_policy(request.options.policy).exact)
    policies.push_back(&kv_policy(request.options.policy));
  for (const KvPolicy* policy : kv_policies()) {
    if (policy->exact) policies.push_back(policy);
  }
  for (const MemoryRequest& base : bases) {
    for (const KvPolicy* policy : policies) {
      Candidate candidate{base};
      candidate.request.options.policy = policy->name;
      if (!policy_reads_option(policy->name, "kv_pool_limit")) candidate.request.kv_pool_tokens = 0;
      if (!policy_reads_option(policy->name, "prefill_chunk")) {
        candidate.request.options.prefill_chunk = 0;
      }
      for (int percent = 100; percent >= 0; percent -= 5) {
        candidate.request.options.weights_gpu_percent = percent;
        if (fits(candidate.request)) return candidate;
      }
      for (int percent = 100; percent >= 0; percent -= 5) {
        candidate.request.options.weights_gpu_percent = percent;
        if (const int64_t batch =
                largest_fitting(candidate.request, &MemoryRequest::batch, request.batch);
            batch > 0) {
          candidate.request.batch = batch;
          return candidate;
        }
      }
    }
  }
  return first_fitting(bases, &MemoryRequest::gen_len, request.gen_len - 1);
}

// Why nothing fits, in terms of the resource that is short: the weights alone when the host
// cannot hold them (device and host sharing one RAM), else the leanest plan there is (batch 1,
// one generated token, all weights streamed, the prompt in the smallest chunk offered, the exact
// policy that needs the least device memory) and what it lacks.
std::string why_nothing_fits(const MemoryRequest& request) {
  MemoryRequest lean = request;
  lean.batch = 1;
  lean.gen_len = 1;
  lean.options.weights_gpu_percent = 0;
  lean.kv_pool_tokens = 0;
  // The exact policies take chunks: the smallest offered, or the asked one when smaller.
  const int64_t lean_chunk = request.options.prefill_chunk > 0
                                 ? std::min(request.options.prefill_chunk, kSmallestChunk)
                                 : kSmallestChunk;
  const bool chunked = request.prompt_len > lean_chunk;
  if (chunked) lean.options.prefill_chunk = lean_chunk;
  std::optional<MemoryPlan> leanest;
  std::string lean_policy;
  for (const KvPolicy* policy : kv_policies()) {
    if (!policy->exact) continue;
    lean.options.policy = policy->name;
    const MemoryPlan plan = compute_memory_plan(lean);
    if (!leanest || plan.device_total() < leanest->device_total()) {
      leanest = plan;
      lean_policy = policy->name;
    }
  }
  lean.options.policy = lean_policy;
  const MemoryPlan plan = *leanest;
  const size_t weights = saturating_sum({plan.device_weights, plan.host_weights});
  if (request.shared_memory && weights > request.host_capacity) {
    const int digits = digits_to_tell_apart(weights, request.host_capacity);
    return cat("the host cannot hold the weights: ", request.config.name, "'s weights are ",
               gib(weights, digits), " GiB and the host has ", gib(request.host_capacity, digits),
               " GiB available");
  }
  const std::string lean_setting =
      cat("even batch 1 with the ", request.prompt_len, "-token prompt",
          chunked ? cat(" in chunks of ", lean_chunk) : std::string(), ", ", option("gen_len"),
          " 1, ", option("policy"), " ", lean_policy, " ", option("weights_gpu_percent"), " 0");
  // Suggestions keep a margin of every capacity free: a plan within it is short of the margin.
  const std::string margin =
      request.suggestion_margin > 0
          ? cat(" (less the ", format_number(100 * request.suggestion_margin),
                "% a suggestion keeps free)")
          : std::string();
  lean = less_margin(lean);
  const auto beyond = [&](size_t need, size_t capacity, const char* what) {
    return cat(gib(need - std::min(need, kept_capacity(capacity, request)), 2), " GiB more than ",
               what, need <= capacity ? margin : std::string());
  };
  if (!device_fits(plan, lean)) {
    return cat("no configuration fits: ", lean_setting, " needs ", gib(plan.device_total(), 2),
               " GiB of device memory, ",
               beyond(plan.device_total(), request.device_capacity, "the device has"));
  }
  if (!pinned_fits(plan, lean)) {
    return cat("no configuration fits: ", lean_setting, " pins ", gib(plan.host_total(), 2),
               " GiB of host memory, ",
               beyond(plan.host_total(), request.pinned_capacity, "could be pinned"));
  }
  const size_t need = host_need(plan, lean);
  return cat("no configuration fits: ", lean_setting, " needs ", gib(need, 2),
             " GiB of host memory, ", beyond(need, request.host_capacity, "is available"));
}

// The plan's table; with `checked`, its capacities below the total and a line for each one the
// plan does not fit in (the device, what can be pinned, the host), so that a refused plan shows
// where it is short.
std::string describe_plan(const MemoryPlan& plan, const MemoryRequest* checked) {
  char line[160];
  std::string text;
  auto row = [&](const char* what, const std::string& device, const std::string& host) {
    std::snprintf(line, sizeof(line), "  %-16s %12s %14s\n", what, device.c_str(), host.c_str());
    text += line;
  };
  row("memory plan", "device", "host (pinned)");
  row("weights", human(plan.device_weights), human(plan.host_weights));
  row("weight staging", human(plan.device_weight_staging), "-");
  row("KV cache", human(plan.device_kv), human(plan.host_kv_pool));
  row("activations", human(plan.device_activations), "-");
  if (plan.device_scratch > 0) row("GEMM scratch", human(plan.device_scratch), "-");
  if (plan.device_gather > 0) {
    row("host gather", human(plan.device_gather), human(plan.host_gather));
  }
  row("total", human(plan.device_total()), human(plan.host_total()));
  if (checked) {
    const MemoryRequest& r = *checked;
    row("available", human(r.device_capacity), human(r.host_capacity));
    const auto short_by = [](size_t need, size_t have) { return human(need - have); };
    if (!device_fits(plan, r)) {
      text += cat("  does not fit: the device is ",
                  short_by(plan.device_total(), r.device_capacity), " short\n");
    }
    if (!pinned_fits(plan, r)) {
      text += cat("  does not fit: the host part pins ", human(plan.host_total()), ", ",
                  short_by(plan.host_total(), r.pinned_capacity), " more than could be pinned\n");
    } else if (!host_fits(plan, r)) {
      const size_t need = host_need(plan, r);
      text += cat("  does not fit: the host is ", short_by(need, r.host_capacity), " short",
                  r.shared_memory ? cat(" (it holds the device's part too: ", human(need), ")")
                                  : std::string(),
                  "\n");
    }
  }
  if (plan.partial_key_host_layers.value_or(0) > 0) {
    text += cat("  ", *plan.partial_key_host_layers,
                " speculated layers keep their partial keys in host memory: every step reads "
                "them over the link\n");
  }
  if (plan.decode_staging_rows) {
    text += cat("  the KV staging shrinks to ", *plan.decode_staging_rows,
                " rows per sequence and head once the prompt is done\n");
  }
  if (plan.row_cache == true) {
    text +=
        "  each speculated layer keeps the rows it fetched at the step before on the device: "
        "a step loads only the others\n";
  }
  if (plan.dense_kv == KvPlacement::Device) {
    text += "  the dense layers' KV is kept on the device: no step loads it\n";
  } else if (plan.dense_kv == KvPlacement::Host) {
    text += "  the dense layers' KV is in the host pool: every step loads it whole\n";
  }
  return text;
}

}  // namespace

int64_t request_positions(const MemoryRequest& r) {
  return r.prompt_len > std::numeric_limits<int64_t>::max() - r.gen_len
             ? std::numeric_limits<int64_t>::max()
             : r.prompt_len + r.gen_len;
}

size_t kv_staging_bytes(const MemoryRequest& r, int64_t rows) {
  const auto kv_size = static_cast<int64_t>(dtype_size(r.kv_dtype));
  return saturating_product(
      {2, 2, r.batch, r.config.kv_heads(), rows, r.config.head_dim(), kv_size});
}

KvPoolShape kv_pool_shape(const MemoryRequest& r, int64_t positions) {
  KvPoolShape pool;
  pool.num_layers = r.config.num_layers;
  pool.batch = r.batch;
  pool.num_heads = r.config.kv_heads();
  pool.head_dim = r.config.head_dim();
  pool.max_tokens = positions;
  // Fewer positions than the request's tokens: a capped pool (as PagedKv lays it out).
  pool.block_tokens = positions < request_positions(r)
                          ? capped_block_tokens(r.options.kv_block_tokens, positions)
                          : r.options.kv_block_tokens;
  pool.dtype = r.kv_dtype;
  return pool;
}

size_t kv_pool_bytes(const MemoryRequest& r, int64_t positions) {
  return KvPool::capacity_bytes(kv_pool_shape(r, positions));
}

size_t MemoryPlan::device_total() const {
  return saturating_sum({device_weights, device_weight_staging, device_kv, device_activations,
                         device_scratch, device_gather});
}

size_t MemoryPlan::host_total() const {
  return saturating_sum({host_weights, host_kv_pool, host_gather});
}

std::string MemoryPlan::describe() const {
  return describe_plan(*this, nullptr);
}

std::string MemoryPlan::describe(const MemoryRequest& checked) const {
  return describe_plan(*this, &checked);
}

namespace {

MemoryPlan plan_sizes(const MemoryRequest& r);

// The plan of `request` with the placements it leaves to the planner decided (with_placements'
// order), each candidate planned once; the row cache as asked.
MemoryPlan placed_kv_plan(const MemoryRequest& request) {
  MemoryRequest placed = request;
  OffloadOptions& options = placed.options;
  // Under a pool limit the dense layers load what the pool keeps: no placement to choose.
  if (!policy_reads_option(options.policy, "dense_kv") || request.kv_pool_tokens > 0) {
    if (options.dense_kv == KvPlacement::Auto) options.dense_kv = KvPlacement::Host;
  }
  if (!policy_reads_option(options.policy, "partial_key_host_layers")) {
    options.partial_key_host_layers = 0;
  }
  const bool choose_keys = options.partial_key_host_layers < 0;
  if (options.dense_kv != KvPlacement::Auto && !choose_keys) return plan_sizes(placed);
  const std::vector<KvPlacement> dense =
      options.dense_kv == KvPlacement::Auto
          ? std::vector<KvPlacement>{KvPlacement::Device, KvPlacement::Host}
          : std::vector<KvPlacement>{options.dense_kv};
  const int64_t most = speculated_layers(options, request.config.num_layers);
  // The leanest placement's device part first: when even it does not fit, no placement does (the
  // device part only shrinks as more goes to the host), and one plan says so, not a search.
  options.dense_kv = dense.back();
  if (choose_keys) options.partial_key_host_layers = most;
  MemoryPlan plan = plan_sizes(placed);
  if (!device_fits(plan, placed)) return plan;
  if (!choose_keys) {
    // As many partial keys on the device as asked, with the dense layers' KV there when it fits.
    for (KvPlacement where : dense) {
      options.dense_kv = where;
      plan = plan_sizes(placed);
      if (device_fits(plan, placed) && host_fits(plan, placed)) return plan;
    }
    return plan;
  }
  // For each place of the dense layers' KV, the fewest layers' partial keys in host memory with
  // which the device part fits (it shrinks as they grow; the host part grows). Of those, the one
  // whose decode steps read the fewest bytes from host memory (MemoryPlan::placement_reads), and
  // on a tie the one with fewer partial keys there, which speculation waits for. A dense layer's
  // KV on the device takes less device memory during the decode steps than its bytes: the staging
  // then shrinks (offload/infinigen_kv.h).
  std::optional<MemoryPlan> best;
  const auto better = [&](const MemoryPlan& candidate) {
    if (!best) return true;
    const bool fits = host_fits(candidate, placed), best_fits = host_fits(*best, placed);
    if (fits != best_fits) return fits;
    if (candidate.placement_reads != best->placement_reads) {
      return candidate.placement_reads < best->placement_reads;
    }
    return *candidate.partial_key_host_layers < *best->partial_key_host_layers;
  };
  for (KvPlacement where : dense) {
    options.dense_kv = where;
    // The device fits with every layer's partial keys in host memory (known for the leanest).
    options.partial_key_host_layers = most;
    if (where != dense.back() && !device_fits(plan_sizes(placed), placed)) continue;
    int64_t lo = 0, hi = most;
    while (lo < hi) {  // the device fits at hi
      options.partial_key_host_layers = lo + (hi - lo) / 2;
      if (device_fits(plan_sizes(placed), placed)) {
        hi = options.partial_key_host_layers;
      } else {
        lo = options.partial_key_host_layers + 1;
      }
    }
    options.partial_key_host_layers = hi;
    MemoryPlan candidate = plan_sizes(placed);
    if (better(candidate)) best = std::move(candidate);
  }
  return *best;
}

// placed_kv_plan with the row cache decided last: for auto, on when the plan with every other
// placement decided fits it (off under a pool limit, whose positions change tokens).
MemoryPlan placed_plan(const MemoryRequest& request) {
  MemoryRequest placed = request;
  RowCacheUse& row_cache = placed.options.row_cache;
  const bool reads = policy_reads_option(placed.options.policy, "row_cache");
  if (!reads || request.kv_pool_tokens > 0) row_cache = RowCacheUse::Off;
  if (row_cache != RowCacheUse::Auto) return placed_kv_plan(placed);
  row_cache = RowCacheUse::Off;
  MemoryPlan without = placed_kv_plan(placed);
  if (!device_fits(without, placed) || !host_fits(without, placed)) return without;
  if (without.dense_kv) placed.options.dense_kv = *without.dense_kv;
  if (without.partial_key_host_layers) {
    placed.options.partial_key_host_layers = *without.partial_key_host_layers;
  }
  row_cache = RowCacheUse::On;
  MemoryPlan with = plan_sizes(placed);
  return device_fits(with, placed) && host_fits(with, placed) ? with : without;
}

}  // namespace

MemoryRequest with_placements(const MemoryRequest& request) {
  MemoryRequest placed = request;
  const MemoryPlan plan = placed_plan(request);
  if (plan.dense_kv) placed.options.dense_kv = *plan.dense_kv;
  if (plan.partial_key_host_layers) {
    placed.options.partial_key_host_layers = *plan.partial_key_host_layers;
  }
  if (plan.row_cache)
    placed.options.row_cache = *plan.row_cache ? RowCacheUse::On : RowCacheUse::Off;
  return placed;
}

MemoryPlan compute_memory_plan(const MemoryRequest& request) {
  return placed_plan(request);
}

namespace {

// The sizes of a request whose placements are decided.
MemoryPlan plan_sizes(const MemoryRequest& r) {
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
  const std::string layers = weight_layout(c).layer_prefix;
  for (const WeightHome& home : place_weights(c, r.options.weights_gpu_percent)) {
    if (home.on_device) {
      plan.device_weights += home.bytes;
    } else {
      plan.host_weights += home.bytes;
      // Group key: the layer's prefix ("model.decoder.layers.N."), "" for the globals.
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

  // KV: what the policy keeps on the device and in the host pool.
  const KvMemory kv = kv_policy(r.options.policy).memory(r);
  plan.device_kv = kv.device;
  plan.host_kv_pool = kv.host;
  plan.placement_reads = kv.placement_reads;
  plan.decode_staging_rows = kv.decode_staging_rows;
  if (policy_reads_option(r.options.policy, "dense_kv")) plan.dense_kv = r.options.dense_kv;
  if (policy_reads_option(r.options.policy, "partial_key_host_layers")) {
    plan.partial_key_host_layers = partial_key_host_layers(r.options, c.num_layers);
  }
  if (policy_reads_option(r.options.policy, "row_cache")) {
    plan.row_cache = r.kv_pool_tokens == 0 && r.options.row_cache != RowCacheUse::Off;
  }

  // Activations: the model's buffers (core/activations.h, the list the forward pass computes
  // in), sized for the largest pass, the prompt's of B sequences of `rows` rows (the prompt, or
  // its chunk: OffloadOptions::prefill_chunk), as the run allocates them before its first pass;
  // then the attention kernel's score blocks, which are not the model's, over the n =
  // prompt_len keys the prompt's last rows see.
  const int64_t B = r.batch, n = r.prompt_len;
  const int64_t rows = largest_prompt_pass(n, r.options.prefill_chunk);
  const size_t model_buffers = activation_bytes(c, B, rows);
  const size_t score_blocks = saturating_product({kScoreBlockRows, n, 4, kScoreThreads});
  plan.device_activations = saturating_sum({model_buffers, score_blocks});
  // GEMM scratch: the widest input of the prompt's passes (B * rows rows of the FFN's or the
  // attention's width) as 16 bits, when the weights are 16-bit, and the cuBLAS workspace.
  if (r.gemm_scratch) {
    const int64_t widest = std::max({c.hidden_size, c.q_dim(), c.ffn_dim});
    plan.device_scratch = saturating_sum(
        {c.dtype == DType::F32 ? size_t{0} : saturating_product({B, rows, widest, 2}),
         kCublasWorkspaceBytes});
    // The host gather lands each way's largest transfer, a layer's K and V at every position (a
    // pool's store reserves it: PagedKv), on the device and in pinned staging: two layers'
    // staging in all.
    if (r.options.gather == GatherMode::Host && kv.host > 0) {
      plan.device_gather = kv_staging_bytes(r, request_positions(r));
      plan.host_gather = plan.device_gather;
    }
  }
  return plan;
}

}  // namespace

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
  throw PlanRefused(message, plan.describe(request));
}

}  // namespace infinigen
