// offload: the layer pipeline every offloading KV store composes (FlexGen's schedule).
//
// A decode pass starts loading layer 0's KV before the embedding; while layer l computes, layer
// l + 1's load fills the other staging buffer; attention waits for its own layer's load (on the
// compute stream: on CUDA the host runs on), and the wait is counted in the step's statistics.
// Which layer's load starts when is the store's to say (its start_pass and start_layer); the
// pipeline keeps what every store shares:
// - the device staging, double-buffered by layer parity: layer l's attention reads
//   staging(l % 2) while layer l + 1's load fills the other;
// - the load and store of a layer as transfers with their events: a load of layer l follows the
//   latest store of layer l (the pool must hold the previous step's token before it is read), and
//   compute that writes a device buffer of parity p first waits for the latest store that read
//   one (await_store_reads);
// - the step statistics: a step opens with the pass that starts it and closes with the pass that
//   ends it (the prompt is one step however many passes it takes: a shared prefix's, chunks),
//   bytes are counted per transfer, and the prefill ends with the store stream drained, because its stores
//   read staging buffers the first decode loads overwrite.
// Every transfer follows the compute enqueued before it (offload/transfer_engine.h), so a load
// never overwrites staging that attention still reads.
//
// Declare the pipeline after every buffer its transfers read or write (the host pool, device
// buffers of the store's own): members are destroyed in reverse order, and its destructor waits
// for the transfers still in flight.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "core/copy_chunk.h"
#include "core/kv_cache.h"
#include "core/tensor.h"
#include "offload/offload_stats.h"
#include "offload/transfer_engine.h"

namespace infinigen {

// Opens and closes the steps of a run's statistics as a store's passes go: the prompt is one step
// however many passes it takes (a shared prefix's, chunks).
class StepClock {
 public:
  StepClock(int64_t num_layers, TransferEngine& engine, OffloadStats& stats)
      : num_layers_(num_layers), engine_(engine), stats_(stats) {}
  // At the start of a pass of `store` (its start_pass); before the step's statistics move, the
  // stalls of the previous one are settled into it.
  void start_pass(const KvStore& store);
  // At the end of a pass (its end_pass, before KvStore::end_pass).
  void end_pass(const KvStore& store);

 private:
  int64_t num_layers_;
  TransferEngine& engine_;
  OffloadStats& stats_;
};

class LayerPipeline {
 public:
  // `staging`: the shape of one layer's staged keys (and values), (B, H_kv, rows, d).
  LayerPipeline(int64_t num_layers, TransferEngine& engine, OffloadStats& stats,
                const Shape& staging, DType dtype, Device device);
  ~LayerPipeline();  // waits for the transfers in flight
  LayerPipeline(const LayerPipeline&) = delete;
  LayerPipeline& operator=(const LayerPipeline&) = delete;

  void start_pass(const KvStore& store);
  // Drains the stores of a prompt's pass or an extension (they read the staging that the next
  // pass's loads overwrite), then closes the step when the pass closes one.
  void end_pass(const KvStore& store);

  // Layer `layer`'s staged keys and values, (B, H_kv, rows, d): the buffers of its parity.
  Tensor& keys(int64_t layer) { return keys_[parity(layer)]; }
  // Rows per (sequence, head) of the staging now.
  int64_t staging_rows() const { return keys_[0].dim(2); }
  // Re-allocates the staging with `rows` rows per (sequence, head), the rest of its shape kept,
  // once every transfer in flight has landed: after the prompt's passes, where the decode steps
  // load fewer rows than a pass of the prompt reads (offload/paged_kv.h). The old buffers are
  // freed first, so the device never holds both.
  void resize_staging(int64_t rows);
  Tensor& values(int64_t layer) { return values_[parity(layer)]; }
  // After the store dropped sequences (KvStore::drop_sequences): waits for every transfer in
  // flight, then the staging of its first `batch` sequences, (batch, H_kv, rows, d), in the same
  // memory (a step loads its staging afresh; what a store keeps staged across steps it compacts
  // itself, compact_batch).
  void keep_batch(int64_t batch);
  // Fills layer `layer`'s staging with NaN when debug_poison() is on: rows a load does not bring
  // must never be read.
  void poison(int64_t layer);

  // Enqueues the load of `chunks` (pool -> device) as layer `layer`'s load of this step, after
  // the latest store of the layer, counting its bytes.
  void load(int64_t layer, std::vector<CopyChunk> chunks,
            TransferContent content = TransferContent::KvRange);
  // The same load made by a kernel of the caller's on the load stream
  // (TransferEngine::load_by_kernel): `bytes` in `rows` rows, which the device chose.
  void load_by_kernel(int64_t layer, const TransferEngine::KernelLaunch& launch, uint64_t bytes,
                      int64_t rows, TransferContent content = TransferContent::KvRows);
  // Enqueues the store of `chunks` (device -> pool) as layer `layer`'s latest, after `after`
  // (if any), counting its bytes. Its sources are device buffers of the layer's parity.
  void store(int64_t layer, std::vector<CopyChunk> chunks, EventPtr after = nullptr,
             TransferContent content = TransferContent::KvRange);
  // The same store made by a kernel of the caller's on the store stream
  // (TransferEngine::store_by_kernel): `bytes` in `rows` rows, which the device chose.
  void store_by_kernel(int64_t layer, const TransferEngine::KernelLaunch& launch, uint64_t bytes,
                       int64_t rows, EventPtr after = nullptr,
                       TransferContent content = TransferContent::KvRange);
  // Orders the compute stream after the latest store that read a device buffer of layer
  // `layer`'s parity: call it before compute writes one.
  void await_store_reads(int64_t layer);
  // Orders attention after this step's load of `layer`, adding the stall to the statistics.
  void wait_for_load(int64_t layer);
  const EventPtr& loaded(int64_t layer) const { return loaded_[static_cast<size_t>(layer)]; }
  const EventPtr& stored(int64_t layer) const { return stored_[static_cast<size_t>(layer)]; }
  // Waits until every store enqueued so far has landed in the pool.
  void drain_stores() { engine_.synchronize_stores(); }

  // This step's statistics, and its traffic of one layer.
  StepStats& step() { return stats_.current(); }
  LayerTraffic& traffic(int64_t layer) { return step().layers[static_cast<size_t>(layer)]; }
  TransferEngine& engine() const { return engine_; }
  int64_t num_layers() const { return num_layers_; }

 private:
  static size_t parity(int64_t layer) { return static_cast<size_t>(layer % 2); }

  int64_t num_layers_;
  TransferEngine& engine_;
  OffloadStats& stats_;
  StepClock clock_;
  std::array<Tensor, 2> keys_, values_;  // staging by layer parity
  std::vector<EventPtr> loaded_;         // per layer: this step's load
  std::vector<EventPtr> stored_;         // per layer: latest store into the pool
  // Per parity: the latest store that read a device buffer of that parity.
  std::array<EventPtr, 2> store_read_ = {completed_event(), completed_event()};
};

}  // namespace infinigen
