// offload: the layer pipeline shared by the offloading KV stores.
#include "offload/layer_pipeline.h"

#include <utility>

namespace infinigen {

void StepClock::start_pass(const KvStore& store) {
  if (!store.pass_opens_step()) return;
  engine_.settle_stalls();  // into the previous step's statistics, before they move
  stats_.begin_step(num_layers_, engine_.counters());
}

void StepClock::end_pass(const KvStore& store) {
  if (store.pass_closes_step()) stats_.end_step(engine_.counters());
}

LayerPipeline::LayerPipeline(int64_t num_layers, TransferEngine& engine, OffloadStats& stats,
                             const Shape& staging, DType dtype, Device device)
    : num_layers_(num_layers),
      engine_(engine),
      stats_(stats),
      clock_(num_layers, engine, stats),
      loaded_(static_cast<size_t>(num_layers), completed_event()),
      stored_(static_cast<size_t>(num_layers), completed_event()) {
  for (size_t p = 0; p < 2; ++p) {
    keys_[p] = Tensor::empty(staging, dtype, device);
    values_[p] = Tensor::empty(staging, dtype, device);
  }
}

LayerPipeline::~LayerPipeline() {
  try {
    engine_.synchronize();  // transfers still read and write the store's buffers
  } catch (...) {
    // The failure was already reported to the pass that caused it.
  }
}

void LayerPipeline::keep_batch(int64_t batch) {
  engine_.synchronize();
  for (size_t p = 0; p < 2; ++p) {
    keys_[p] = keys_[p].slice_rows(0, batch);
    values_[p] = values_[p].slice_rows(0, batch);
  }
}

void LayerPipeline::resize_staging(int64_t rows) {
  if (rows == staging_rows()) return;
  engine_.synchronize();  // loads write the staging, stores read it
  Shape shape = keys_[0].shape();
  shape[2] = rows;
  const DType dtype = keys_[0].dtype();
  const Device device = keys_[0].device();
  for (size_t p = 0; p < 2; ++p) {
    keys_[p] = Tensor();
    values_[p] = Tensor();
  }
  for (size_t p = 0; p < 2; ++p) {
    keys_[p] = Tensor::empty(shape, dtype, device);
    values_[p] = Tensor::empty(shape, dtype, device);
  }
}

void LayerPipeline::start_pass(const KvStore& store) { clock_.start_pass(store); }

void LayerPipeline::end_pass(const KvStore& store) {
  // The stores of a prompt's pass or an extension read the staging (its rows of the pass), which
  // the next pass's loads overwrite: a load waits for its own layer's last store only, and the
  // store of a later layer of the same parity may still be reading. (A decode step's stores read
  // the token buffers.)
  if (store.length() == 0 || store.pass_tokens() > 1) drain_stores();
  clock_.end_pass(store);
}

void LayerPipeline::poison(int64_t layer) {
  if (!debug_poison()) return;
  await_store_reads(layer);  // a store may still read rows of the staging (an extension's)
  fill_nan(keys(layer));
  fill_nan(values(layer));
}

void LayerPipeline::load(int64_t layer, std::vector<CopyChunk> chunks, TransferContent content) {
  const uint64_t bytes = total_bytes(chunks);
  traffic(layer).kv_h2d_bytes += bytes;
  step().h2d_bytes += bytes;
  const size_t l = static_cast<size_t>(layer);
  loaded_[l] = engine_.load(std::move(chunks), stored_[l], {"kv_load", layer, content});
}

void LayerPipeline::load_by_kernel(int64_t layer, const TransferEngine::KernelLaunch& launch,
                                   uint64_t bytes, int64_t rows, TransferContent content) {
  traffic(layer).kv_h2d_bytes += bytes;
  step().h2d_bytes += bytes;
  const size_t l = static_cast<size_t>(layer);
  loaded_[l] = engine_.load_by_kernel(launch, bytes, rows, stored_[l], {"kv_load", layer, content});
}

void LayerPipeline::store(int64_t layer, std::vector<CopyChunk> chunks, EventPtr after,
                          TransferContent content) {
  const uint64_t bytes = total_bytes(chunks);
  traffic(layer).kv_d2h_bytes += bytes;
  step().d2h_bytes += bytes;
  const size_t l = static_cast<size_t>(layer);
  stored_[l] = engine_.store(std::move(chunks), std::move(after), {"kv_store", layer, content});
  store_read_[parity(layer)] = stored_[l];
}

void LayerPipeline::store_by_kernel(int64_t layer, const TransferEngine::KernelLaunch& launch,
                                    uint64_t bytes, int64_t rows, EventPtr after,
                                    TransferContent content) {
  traffic(layer).kv_d2h_bytes += bytes;
  step().d2h_bytes += bytes;
  const size_t l = static_cast<size_t>(layer);
  stored_[l] =
      engine_.store_by_kernel(launch, bytes, rows, std::move(after), {"kv_store", layer, content});
  store_read_[parity(layer)] = stored_[l];
}

void LayerPipeline::await_store_reads(int64_t layer) {
  engine_.compute_stream().wait(store_read_[parity(layer)]);
}

void LayerPipeline::wait_for_load(int64_t layer) {
  StepStats& current = step();
  engine_.compute_waits(
      loaded(layer),
      {&current.layers[static_cast<size_t>(layer)].load_wait_seconds, &current.load_wait_seconds});
}

}  // namespace infinigen
