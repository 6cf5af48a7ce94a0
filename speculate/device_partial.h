// speculate: a speculated layer's state on the CUDA device and its decode-time speculation there,
// the twin of PartialLayer (speculate/speculation.h) on the host.
//
// The prompt's passes build a layer's PartialLayer (the columns are chosen on the host from the
// whole prompt's column sums, which with the prompt on the device are added up there, and the
// partial query weights gathered on the device); adopt() then takes its state to the device and
// write_prompt_keys() writes the prompt's partial keys there from its keys (or upload() copies a
// partial key cache built on the host: a capped pool), and from that step on the layer speculates,
// selects and appends on the device through the ops of core/ops.h (kernels/cuda/speculation.h): the
// partial query rows x W~^T + b~ (cuBLAS), the estimated logits, the alpha counts, n' and the
// top-n' positions. The positions never leave the device; the host reads back only each sequence's
// take and the mean count (the selection's summary), which the view of the staged rows and the
// statistics need.
#pragma once

#include <cstdint>
#include <vector>

#include "core/kv_cache.h"
#include "core/ops.h"
#include "core/shared_prefixes.h"
#include "core/tensor.h"
#include "speculate/speculation.h"

namespace infinigen {

class DevicePartialLayer {
 public:
  // Copies `layer`'s state (columns, partial weights, skew, rotary frequencies, shared prefixes)
  // and its partial key cache (B, H_kv, capacity, r) to the CUDA device; with `keys_on_host` the
  // cache goes to mapped pinned host memory instead, which the kernels read over the link.
  void upload(const PartialLayer& layer, bool keys_on_host = false);
  // upload() without the partial key cache: `layer`'s state on the device (its partial weights
  // stay where choose_columns gathered them when that is the device), and a partial key cache
  // (B, H_kv, capacity, r) for write_prompt_keys to fill: unlike the host's, not zeroed (a
  // position that holds no token is never read as a key; a later token's append writes it).
  void adopt(const PartialLayer& layer, bool keys_on_host = false);
  // The prompt's partial keys (ops::prompt_partial_keys): tokens [0, past) read from the pool's
  // key blocks, [past, past + n) from the last pass's keys (B * n, H_kv * d) fp32 on the device,
  // of the sequences' tokens (first_valid and the layer's shared prefixes).
  void write_prompt_keys(const Tensor& fresh, int64_t past, const ops::PoolKeyBlocks& pool,
                         const std::vector<int32_t>& first_valid);

  // Speculates the layer from x (B, D) on the device, the previous layer's attention input, with
  // the new token of sequence b at rotary position rope_positions[b], over positions [0, used):
  // the estimated logits into `logits` (scratch of at least B * H_kv * used floats) and the
  // selection into `out` (PartialLayer::speculate's, with options.max_num_kv resolved).
  // position_tokens (B, H_kv, capacity) I32 on the device, or undefined: as PartialLayer's.
  void speculate(const Tensor& x, const std::vector<int32_t>& rope_positions, int64_t used,
                 const std::vector<int32_t>& first_valid, const Tensor& position_tokens,
                 const SpeculationOptions& options, Tensor& logits,
                 ops::SelectionTensors& out) const;
  // The partial keys of one new token per sequence, keys (B, H_kv * d) fp32 on the device, at
  // `position`, or at positions[b * H_kv + g] (B, H_kv) I32 on the device when defined.
  void append(const Tensor& keys, int64_t position, const Tensor& positions = {});

  // Keeps the sequences `keep` (old indices, ascending), renumbered in that order
  // (KvStore::drop_sequences), with `shared`, the kept sequences' prefixes: the partial key cache
  // compacted (each move's prefix positions copied to the group's new leader first). The compute
  // stream must have finished what it enqueued on the cache.
  void keep_sequences(const std::vector<int64_t>& keep,
                      const std::vector<KvStore::LeaderMove>& moves, const SharedPrefixes& shared);

  // The partial key cache (B, H_kv, capacity, r) in the key dtype: on the device, or in mapped
  // pinned host memory when keys_on_host().
  const Tensor& keys() const { return tensors_.keys; }
  bool keys_on_host() const { return keys_on_host_; }
  int64_t batch() const { return tensors_.keys.defined() ? tensors_.keys.dim(0) : 0; }
  int64_t kv_heads() const { return tensors_.keys.defined() ? tensors_.keys.dim(1) : 0; }

 private:
  const SharedPrefixes* shared() const { return shared_.empty() ? nullptr : &shared_; }

  ops::PartialTensors tensors_;
  Tensor weight_;               // (M, D): the needed rows of W_q, head by head
  Tensor bias_;                 // (M) fp32
  mutable Tensor query_rows_;   // (B, M) fp32: scratch of speculate()
  SharedPrefixes shared_;
  bool keys_on_host_ = false;  // the partial key cache in mapped pinned host memory
};

// The device tensors of a selection of B sequences over H_kv KV heads with at most fetch_cap
// tokens per (sequence, head).
ops::SelectionTensors device_selection(int64_t batch, int64_t kv_heads, int64_t fetch_cap);

}  // namespace infinigen
