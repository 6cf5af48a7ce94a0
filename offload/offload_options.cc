// offload: the options of an offloaded run: their table and their rules.
#include "offload/offload_options.h"

#include <algorithm>
#include <cmath>

#include "offload/kv_policy.h"

namespace infinigen {
namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

std::vector<std::pair<std::string, EvictionPolicy>> eviction_choices() {
  std::vector<std::pair<std::string, EvictionPolicy>> choices;
  for (EvictionPolicy policy : kEvictionPolicies) {
    choices.emplace_back(std::string(eviction_policy_name(policy)), policy);
  }
  return choices;
}

// The keys every run reads, whatever its policy.
const std::vector<std::string> kCommonOptions = {
    "policy", "weights_gpu_percent", "emulate_link_gbps", "emulate_link_latency_us",
    "gather", "device_memory"};

OptionTable<OffloadOptions> make_table() {
  using O = OffloadOptions;
  std::vector<std::pair<std::string, std::string>> policies;
  std::string policy_help = "KV policy:";
  for (const KvPolicy* policy : kv_policies()) {
    policies.emplace_back(policy->name, policy->name);
    policy_help += " " + policy->name + " (" + policy->help + ")";
  }
  OptionTable<O> table = {
      choice_option<O, std::string>(
          "policy", policy_help, [](auto& o) -> auto& { return o.policy; }, policies),
      number_option<O>(
          "weights_gpu_percent",
          "Share of each layer's weights kept on the device; the rest is streamed",
          [](auto& o) -> auto& { return o.weights_gpu_percent; }),
      number_option<O>(
          "emulate_link_gbps",
          "Make host<->device copies take the time of a link of this many GB/s (0: off)",
          [](auto& o) -> auto& { return o.link.gbps; }),
      number_option<O>(
          "emulate_link_latency_us", "Per-transfer latency of the emulated link",
          [](auto& o) -> auto& { return o.link.latency_us; }),
      choice_option<O, GatherMode>(
          "gather",
          "CUDA: how KV rows cross the link: device (a kernel reads them from the pinned pool) or "
          "host (host threads pack them, then one copy)",
          [](auto& o) -> auto& { return o.gather; },
          {{"device", GatherMode::Device}, {"host", GatherMode::Host}}),
      integer_option<O>(
          "kv_block_tokens", "Tokens per block of the host KV pool",
          [](auto& o) -> auto& { return o.kv_block_tokens; }),
      integer_option<O>(
          "prefill_chunk",
          "full, gpu, int4, infinigen: tokens per sequence in each pass of the prompt, so that "
          "its activations are bounded by the chunk (0: the whole prompt in one pass)",
          [](auto& o) -> auto& { return o.prefill_chunk; }),
      choice_option<O, bool>(
          "share_prefix",
          "full, gpu, infinigen: compute and keep once per group the whole KV blocks of the "
          "prompt prefixes that groups of the batch's sequences share (infinigen: without "
          "kv_pool_limit)",
          [](auto& o) -> auto& { return o.share_prefix; }, {{"on", true}, {"off", false}}),
      number_option<O>(
          "alpha", "infinigen: fetch tokens whose speculated logit is within alpha of the top",
          [](auto& o) -> auto& { return o.speculation.alpha; }),
      number_option<O>(
          "partial_ratio", "infinigen: share of each head's query/key columns used to speculate",
          [](auto& o) -> auto& { return o.speculation.partial_ratio; }),
      choice_option<O, PartialIndexRule>(
          "partial_index_rule", "infinigen: choose partial columns by |Q|+|K| (qk) or |Q| (q)",
          [](auto& o) -> auto& { return o.speculation.index_rule; },
          {{"qk", PartialIndexRule::QK}, {"q", PartialIndexRule::Q}}),
      choice_option<O, DType>("partial_key_dtype",
                              "infinigen: element type of the partial key cache",
                              [](auto& o) -> auto& { return o.speculation.partial_key_dtype; },
                              {{"f32", DType::F32}, {"f16", DType::F16}}),
      choice_option<O, FetchRule>(
          "fetch_rule",
          "infinigen: tokens fetched per head are the mean alpha count of the sequence's heads "
          "(sequence) or of the whole batch's (batch, the paper's rule)",
          [](auto& o) -> auto& { return o.speculation.fetch_rule; },
          {{"sequence", FetchRule::Sequence}, {"batch", FetchRule::Batch}}),
      integer_option<O>(
          "max_num_kv",
          "infinigen: most tokens fetched per head and layer (0: max_fetch_share of prompt + "
          "generation)",
          [](auto& o) -> auto& { return o.speculation.max_num_kv; }),
      number_option<O>(
          "max_fetch_share",
          "infinigen: with max_num_kv 0, the cap on tokens fetched per head and layer as a share "
          "of prompt + generation",
          [](auto& o) -> auto& { return o.speculation.max_fetch_share; }),
      integer_option<O>(
          "dense_layers", "infinigen: first layers that always fetch their whole KV",
          [](auto& o) -> auto& { return o.speculation.dense_layers; }),
      number_option<O>(
          "kv_pool_limit",
          "infinigen: cap on the host KV pool, a fraction (<= 1) of the full KV or "
          "bytes (> 1); 0 = none",
          [](auto& o) -> auto& { return o.kv_pool_limit; }),
      choice_option<O, KvPlacement>(
          "dense_kv",
          "infinigen: where the dense layers' KV lives: device (kept there, no step loads it), "
          "host (loaded whole every step) or auto (the device when the plan fits there)",
          [](auto& o) -> auto& { return o.dense_kv; },
          {{"auto", KvPlacement::Auto},
           {"device", KvPlacement::Device},
           {"host", KvPlacement::Host}}),
      integer_option<O>(
          "partial_key_host_layers",
          "infinigen: speculated layers (the last ones) whose partial key cache stays in pinned "
          "host memory, read over the link by each step's speculation (-1: as few as the plan "
          "needs to fit)",
          [](auto& o) -> auto& { return o.partial_key_host_layers; }),
      choice_option<O, RowCacheUse>(
          "row_cache",
          "infinigen: keep on the device the rows each speculated layer fetched at the step "
          "before, so a step loads only the others: on, off or auto (on when the plan fits it)",
          [](auto& o) -> auto& { return o.row_cache; },
          {{"auto", RowCacheUse::Auto}, {"on", RowCacheUse::On}, {"off", RowCacheUse::Off}}),
      choice_option<O, EvictionPolicy>(
          "eviction", "infinigen: victim when the capped pool is full",
          [](auto& o) -> auto& { return o.eviction; }, eviction_choices()),
      switch_option<O>(
          "check_recall",
          "infinigen: measure the share of full attention weight the fetched tokens carry",
          [](auto& o) -> auto& { return o.check_recall; }),
      number_option<O>(
          "h2o_budget", "h2o: share of the tokens kept per layer, sequence and head",
          [](auto& o) -> auto& { return o.h2o_budget; }),
  };
  // Device memory is given in GiB and kept in bytes.
  OptionSpec<O> device_memory{
      "device_memory", "Device memory to plan for, GiB (0: what the device has)",
      "GIB",           false,
      nullptr,         nullptr,
      nullptr};
  device_memory.parse = [](O& o, const std::string& text) {
    const double gib = parse_number("device_memory", text);
    INFINIGEN_CHECK(gib >= 0 && gib * kGiB < 1e19, option("device_memory"),
                    " must be >= 0 GiB and below 2^63 bytes, got ", text);
    o.device_memory = static_cast<size_t>(gib * kGiB);
  };
  device_memory.format = [](const O& o) {
    return format_number(static_cast<double>(o.device_memory) / kGiB);
  };
  table.insert(table.begin() + 5, device_memory);
  for (OptionSpec<O>& spec : table) {
    if (spec.key == "eviction") spec.in_effect = [](const O& o) { return o.kv_pool_limit > 0; };
    if (spec.key == "dense_kv") spec.in_effect = [](const O& o) { return o.kv_pool_limit == 0; };
    if (spec.key == "row_cache") spec.in_effect = [](const O& o) { return o.kv_pool_limit == 0; };
  }
  return table;
}

// Why `policy` takes no --kv-pool-limit: what it keeps, and which policies evict from a capped
// pool instead.
std::string kv_pool_limit_refusal(const std::string& policy) {
  std::string capped;
  for (const KvPolicy* p : kv_policies()) {
    if (policy_reads_option(p->name, "kv_pool_limit")) {
      capped += (capped.empty() ? "" : ", ") + p->name;
    }
  }
  const std::string evicting = cat("; only ", capped, " chooses which tokens a capped pool evicts");
  if (policy_reads_option(policy, "h2o_budget")) {
    return cat("sizes its pool with ", option("h2o_budget"), evicting);
  }
  return cat("attends to every stored token at every step, so a capped pool would drop tokens and ",
             "change what it computes", evicting);
}

}  // namespace

const OptionTable<OffloadOptions>& offload_option_table() {
  static const OptionTable<OffloadOptions> table = make_table();
  return table;
}

bool policy_reads_option(const std::string& policy, std::string_view key) {
  if (std::find(kCommonOptions.begin(), kCommonOptions.end(), key) != kCommonOptions.end()) {
    return true;
  }
  const std::vector<std::string>& reads = kv_policy(policy).options;
  return std::find(reads.begin(), reads.end(), key) != reads.end();
}

int64_t resident_dense_layers(const OffloadOptions& options, int64_t num_layers, bool capped) {
  if (capped || options.dense_kv == KvPlacement::Host) return 0;
  return std::clamp<int64_t>(options.speculation.dense_layers, 0, num_layers);
}

int64_t speculated_layers(const OffloadOptions& options, int64_t num_layers) {
  return num_layers - std::clamp<int64_t>(options.speculation.dense_layers, 0, num_layers);
}

int64_t partial_key_host_layers(const OffloadOptions& options, int64_t num_layers) {
  return std::clamp<int64_t>(options.partial_key_host_layers, 0,
                             speculated_layers(options, num_layers));
}

void OffloadOptions::validate() const {
  kv_policy(policy);  // names the option when unknown
  INFINIGEN_CHECK(weights_gpu_percent >= 0.0 && weights_gpu_percent <= 100.0,
                  option("weights_gpu_percent"), " must be in [0, 100], got ", weights_gpu_percent);
  // Slower links than these would make a step take days (and their times overflow a clock).
  INFINIGEN_CHECK(link.gbps == 0 || (link.gbps >= kMinEmulatedGbps && std::isfinite(link.gbps)),
                  option("emulate_link_gbps"), " must be 0 (off) or at least ", kMinEmulatedGbps,
                  " (1 MB/s), got ", link.gbps);
  INFINIGEN_CHECK(link.latency_us >= 0 && link.latency_us <= kMaxEmulatedLatencyUs,
                  option("emulate_link_latency_us"), " must be in [0, ",
                  static_cast<int64_t>(kMaxEmulatedLatencyUs), "] (a second), got ",
                  link.latency_us);
  INFINIGEN_CHECK(prefill_chunk >= 0, option("prefill_chunk"),
                  " must be >= 0 (0: the whole prompt in one pass), got ", prefill_chunk);
  INFINIGEN_CHECK(prefill_chunk == 0 || policy_reads_option(policy, "prefill_chunk"),
                  option("prefill_chunk"), ": ", option("policy"), " ", policy,
                  " scores the whole prompt in one pass");
  INFINIGEN_CHECK(prefill_chunk == 0 || kv_pool_limit == 0, option("prefill_chunk"), " with ",
                  option("kv_pool_limit"),
                  ": the capped pool chooses the prompt tokens it keeps from the whole prompt's "
                  "attention, in one pass");
  INFINIGEN_CHECK(kv_block_tokens >= 1, option("kv_block_tokens"), " must be at least 1, got ",
                  kv_block_tokens);
  speculation.validate();
  INFINIGEN_CHECK(kv_pool_limit >= 0 && std::isfinite(kv_pool_limit), option("kv_pool_limit"),
                  " must be >= 0, got ", kv_pool_limit);
  if (kv_pool_limit != 0 && !policy_reads_option(policy, "kv_pool_limit")) {
    fail(option("kv_pool_limit"), ": ", option("policy"), " ", policy, " ",
         kv_pool_limit_refusal(policy));
  }
  INFINIGEN_CHECK(dense_kv != KvPlacement::Device || kv_pool_limit == 0, option("dense_kv"),
                  " device with ", option("kv_pool_limit"),
                  ": a capped pool keeps positions, not a layer's whole KV (use auto or host)");
  INFINIGEN_CHECK(row_cache != RowCacheUse::On || kv_pool_limit == 0, option("row_cache"),
                  " on with ", option("kv_pool_limit"),
                  ": a capped pool stores new tokens over evicted ones' positions, so a cached "
                  "row could be stale (use auto or off)");
  INFINIGEN_CHECK(partial_key_host_layers >= -1, option("partial_key_host_layers"),
                  " must be >= 0, or -1 (as few as the plan needs), got ", partial_key_host_layers);
  INFINIGEN_CHECK(h2o_budget > 0 && h2o_budget <= 1, option("h2o_budget"),
                  " must be in (0, 1], got ", h2o_budget);
}

}  // namespace infinigen
