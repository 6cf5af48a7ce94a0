// offload: the options of an offloaded run, each declared once: its default here, its key, help
// text and text form in offload_option_table(), its rule in validate(). `run`, `eval`, `bench`,
// YAML configs and experiment files all read them through the table.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "core/option_table.h"
#include "offload/transfer_engine.h"
#include "speculate/eviction.h"
#include "speculate/speculation.h"

namespace infinigen {

// Where a part of the KV lives: on the device for the whole run (a step loads none of it), in
// the host pool (loaded when a step needs it), or where the memory plan fits (the device when it
// does: MemoryPlan says which).
enum class KvPlacement { Auto, Device, Host };

// Whether InfiniGen's speculated layers keep the rows they fetched at the step before on the
// device (offload/row_cache.h): on, off, or on when the memory plan fits it (MemoryPlan says).
enum class RowCacheUse { Auto, On, Off };

struct OffloadOptions {
  std::string policy = "infinigen";    // a KV policy's name (offload/kv_policy.h)
  double weights_gpu_percent = 100.0;  // share of each layer's weights kept on the device
  LinkEmulation link;                  // emulate_link_gbps, emulate_link_latency_us
  // CUDA: how a transfer of many small chunks crosses the link (offload/transfer_engine.h).
  // Device until a GPU measures both: a kernel reading 256-byte rows straight from the mapped pool
  // makes one pass over them, where the host gather reads and writes them once more in host
  // memory before the DMA reads them again.
  GatherMode gather = GatherMode::Device;
  int64_t kv_block_tokens = 128;       // tokens per block of the host KV pool
  // Tokens per sequence in each pass of the prompt (Model::prefill): the activations of a pass
  // grow with it, not with the prompt; 0 = the whole prompt in one pass.
  int64_t prefill_chunk = 0;
  // Policies full, gpu and infinigen (uncapped): the whole KV blocks of the prompt prefixes that
  // groups of the batch's sequences share are computed and kept once per group
  // (find_shared_prefixes, KvStore::share_prefixes).
  bool share_prefix = true;
  size_t device_memory = 0;        // bytes usable on the device; 0 = what the device has free
  SpeculationOptions speculation;  // policy infinigen
  bool check_recall = false;       // policy infinigen: measure the recall of attention weight
  // Policy infinigen: cap on the host KV pool, as a fraction (<= 1) of the full KV of the
  // request or as bytes (> 1); 0 = no cap.
  double kv_pool_limit = 0.0;
  // Policy infinigen (uncapped): where the dense layers' KV lives. On the device its rows are
  // written there as they are computed (and stored to the pool as well, which sessions read), so
  // a decode step moves none of it; in the host pool it is loaded whole every step, as `full`
  // loads every layer.
  KvPlacement dense_kv = KvPlacement::Auto;
  // Policy infinigen: how many speculated layers (the last ones) keep their partial key cache in
  // pinned host memory rather than on the device. On CUDA their speculation kernels read it there
  // over the link, every step; on the CPU backend both are the same memory. -1: as few as the
  // memory plan needs to fit (0 when everything fits on the device).
  int64_t partial_key_host_layers = -1;
  // Policy infinigen (uncapped pool): a device cache of the rows each speculated (layer,
  // sequence, KV head) fetched at the step before (offload/row_cache.h); a step loads only the
  // rows it does not hold. Its K and V rows of the fetch cap per (layer, sequence, KV head) are
  // device memory. Exact. Auto: on when the plan fits it beside the other placements, which come
  // first; off under a pool limit, where on is refused.
  RowCacheUse row_cache = RowCacheUse::Auto;
  EvictionPolicy eviction = EvictionPolicy::Counter;  // victims of a capped pool
  double h2o_budget = 0.2;  // policy h2o: share of the tokens kept per (layer, sequence, head)

  // One-line Error naming the first option out of range (or a pool limit for a policy without a
  // pool to limit).
  void validate() const;
};

// Policy infinigen: the layers whose KV stays on the device for the whole run: the dense ones unless `options`
// place them in the host pool (auto counts as the device: the planner decides it before a run),
// none under a pool limit (`capped`), whose positions are not a layer's whole KV.
int64_t resident_dense_layers(const OffloadOptions& options, int64_t num_layers, bool capped);
// The layers that speculate (those past the dense ones), and how many of them, the last ones,
// keep their partial key cache in pinned host memory (-1, left to the planner, counts as none).
int64_t speculated_layers(const OffloadOptions& options, int64_t num_layers);
int64_t partial_key_host_layers(const OffloadOptions& options, int64_t num_layers);

// Every option of OffloadOptions, in the order `--help` lists them.
const OptionTable<OffloadOptions>& offload_option_table();

// Whether `policy` reads option `key` (the options every run reads, such as weights_gpu_percent,
// count for every policy).
bool policy_reads_option(const std::string& policy, std::string_view key);

}  // namespace infinigen
