// offload: the device half of the `infinigen` store on CUDA (offload/infinigen_kv.h).
//
// Once the prompt's passes are done, every speculated layer's partial state moves to the device
// (speculate/device_partial.h) and a decode step of layer l does there what PartialLayer and the
// host chunk lists do on the CPU backend:
// - select(): layer l + 1's partial query rows (cuBLAS), estimated logits, alpha counts, n' and
//   top-n' positions, on the compute stream; then the layer's one host wait, for the selection's
//   summary (each sequence's take and the mean count, B + 2 ints): the view of the staged rows
//   and the bytes of the gather need it. The positions themselves stay on the device, unless a
//   capped pool's fetch counters need them on the host (they are copied back with the summary);
// - gather(): the selected rows, read by a kernel on the load stream straight from the pool's
//   blocks (the block tables as addresses in mapped pinned memory) into the compact staging;
//   with the row cache (offload/row_cache.h), select() also matches the selection against the
//   rows the layer fetched at the step before (a kernel; how many each (sequence, head) holds
//   comes back with the summary), gather() copies those from the cache on the device and reads
//   only the others over the link, then a kernel stores the staged selection into the cache;
// - append() / place(): the new token's partial keys, at its position, or in a capped pool at
//   the positions the eviction chose, whose token table on the device follows the host's.
// Buffers the host writes for the device (block tables, placed positions) and reads back
// (summaries) come in two, by layer parity: the layer of the same parity two layers back is
// done with them, since the compute stream has been synchronised in between (select()).
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "core/cuda_stream.h"
#include "core/stream.h"
#include "core/tensor.h"
#include "offload/kv_pool.h"
#include "offload/layer_pipeline.h"
#include "offload/row_cache.h"
#include "speculate/device_partial.h"
#include "speculate/speculation.h"

namespace infinigen {

class DeviceSpeculation {
 public:
  // For `num_layers` layers of `batch` sequences and `kv_heads` KV heads with `positions` pool
  // positions each, at most `fetch_cap` tokens fetched per (sequence, head), over `pool`.
  // `capped`: a pool under a limit (position tokens on the device, selections copied back, and
  // host copies of a staging of `staging` shape and `kv_dtype` and of `query_width`-wide queries).
  // `row_cache`: the buffers select() and gather() need for a row cache.
  DeviceSpeculation(int64_t num_layers, int64_t batch, int64_t kv_heads, int64_t positions,
                    int64_t fetch_cap, const KvPoolShape& pool, bool capped, const Shape& staging,
                    DType kv_dtype, int64_t query_width, bool row_cache = false);

  // Layer `layer`'s partial state, and in a capped pool its token per position (B, H_kv,
  // positions), to the device (the partial key cache to mapped pinned host memory when
  // `keys_on_host`); the host's partial key cache is released.
  void upload(int64_t layer, PartialLayer& partial, const std::vector<int32_t>* position_tokens,
              bool keys_on_host = false);
  // The prompt's last pass of an uncapped pool, on the device: layer `layer`'s state taken from
  // `partial` (its columns just chosen; DevicePartialLayer::adopt), and every prompt token's
  // partial key written there, tokens [0, past) read from `pool` (mapped pinned memory; their
  // stores must have landed), the pass's from `keys` (B * n, H_kv * d) fp32 on the device.
  void build_from_prompt(int64_t layer, const PartialLayer& partial, const Tensor& keys,
                         int64_t past, const KvPool& pool, const std::vector<int32_t>& first_valid,
                         bool keys_on_host);
  // Whether layer `layer`'s state is on the device already (upload or build_from_prompt).
  bool holds(int64_t layer) const { return layers_[static_cast<size_t>(layer)].batch() > 0; }

  // Speculates layer `layer` from the previous layer's attention input x (B, D) on the device,
  // with the new tokens at rotary positions `rope_positions`, over positions [0, used): the
  // selection as the host sees it (take, fetch, mean count; the tokens too in a capped pool).
  // Waits for the device to finish it.
  // With `cache` (allocated on the device), also which selected rows it holds:
  // cached_rows() tells how many.
  PartialLayer::Selection select(int64_t layer, const Tensor& x,
                                 const std::vector<int32_t>& rope_positions, int64_t used,
                                 const std::vector<int32_t>& first_valid,
                                 const SpeculationOptions& options, Stream& compute,
                                 RowCache* cache = nullptr);
  // (sequence, head, token) rows of the last select()'s selection its row cache holds.
  int64_t cached_rows() const { return cached_rows_; }
  // Enqueues, as layer `layer`'s load, the gather of the rows its last select() chose from
  // `pool` into its staging, compact (offload/infinigen_kv.h); with `cache` (the same as
  // select()'s), the rows it holds copied from it, then the staged selection stored into it.
  void gather(int64_t layer, const PartialLayer::Selection& selection, const KvPool& pool,
              LayerPipeline& pipeline, RowCache* cache = nullptr);

  // The new token's partial keys, keys (B, H_kv * d) on the device, at `position`.
  void append(int64_t layer, const Tensor& keys, int64_t position);
  // A capped pool's new token `token`: its partial keys at positions at[b * H_kv + g], which now
  // hold it in the device's token table too.
  void place(int64_t layer, const Tensor& keys, const std::vector<int32_t>& at, int32_t token,
             Stream& compute);

  // Layer `layer`'s partial key cache (B, H_kv, positions, r) copied into `out` (a session's save
  // reads it there): positions [from, positions) of each (sequence, head), or all of them when
  // `out` does not hold the cache yet; what `out` holds before `from` is not written (another
  // thread may read it). The compute stream must have finished what it enqueued.
  void copy_keys_to_host(int64_t layer, std::vector<char>& out, int64_t from) const;

  // Keeps the sequences `keep` (old indices, ascending), renumbered in that order
  // (KvStore::drop_sequences), with `shared`, the kept sequences' prefixes: every layer's partial
  // key cache and a capped pool's token table compacted on the device, the per-batch buffers
  // narrowed. The compute stream must have finished what it enqueued.
  void keep_sequences(const std::vector<int64_t>& keep,
                      const std::vector<KvStore::LeaderMove>& moves, const SharedPrefixes& shared);

  // Host copies of a dense layer's staged keys and its queries, for a capped pool's dense fetch
  // counts (CappedPool::count_dense_fetches). Waits for them.
  struct HostCopies {
    Tensor staged_keys;  // (B, H_kv, rows, d) in the KV dtype
    Tensor queries;      // (B, H * d) fp32
  };
  HostCopies to_host(const Tensor& staged_keys, const Tensor& queries, Stream& compute);

 private:
  int64_t batch_, kv_heads_, positions_;
  std::vector<DevicePartialLayer> layers_;
  std::vector<Tensor> position_tokens_;  // per layer, a capped pool's (B, H_kv, positions) I32
  Tensor logits_;                        // (B, H_kv, positions) fp32 scratch
  // Per layer parity: the selection on the device; its summary (and, capped, its tokens) read
  // back into pinned memory; the pool's block tables (keys, then values); a capped pool's placed
  // positions and the pieces that write its new token into the token table.
  std::array<ops::SelectionTensors, 2> selected_;
  std::array<Tensor, 2> summary_, tokens_, block_tables_, placed_, token_pieces_, token_value_;
  Tensor host_keys_, host_queries_;  // to_host()'s pinned copies (capped)
  // Per layer parity, with a row cache: each selected row's cache row or -1 (B, H_kv, fetch cap)
  // I32 and the rows each (sequence, head) found there (B, H_kv) I32, on the device, and the
  // latter read back into pinned memory with the summary.
  std::array<Tensor, 2> sources_, hits_, host_hits_;
  // A multi-pass prompt's key block tables (layers, B, blocks) I64 in mapped pinned memory, one
  // part per layer so that no layer's table is rewritten while a kernel may read it; made at the
  // first build_from_prompt with earlier tokens.
  Tensor prompt_tables_;
  int64_t cached_rows_ = 0;
  // The row cache's buffers of layer `layer` and the selection of parity `parity`, for its
  // kernels.
  // The selection of layer parity `parity`, as the kernels read it.
  cuda_stream::DeviceSelection selection_args(size_t parity) const;
  cuda_stream::CachedRows cache_kernel_args(RowCache& cache, int64_t layer, size_t parity);
};

}  // namespace infinigen
