// offload: the layer pipeline shared by the offloading KV policies.
#include "offload/pipelined_kv.h"

namespace infinigen {

PipelinedKv::PipelinedKv(int64_t batch, int64_t capacity, int64_t num_layers,
                         TransferEngine& engine, OffloadStats& stats)
    : KvStore(batch, capacity),
      num_layers_(num_layers),
      engine_(engine),
      stats_(stats),
      loaded_(static_cast<size_t>(num_layers), completed_event()),
      stored_(static_cast<size_t>(num_layers), completed_event()) {}

void PipelinedKv::start_pass(int64_t n_new) {
  KvStore::start_pass(n_new);
  if (pass_opens_step()) {
    engine_.settle_stalls();  // into the previous step's statistics, before they move
    stats_.begin_step(num_layers_, engine_.counters());
  }
  if (length() > 0) issue_load(0);  // decode: layer 0's KV starts moving before the embedding
}

void PipelinedKv::start_layer(int64_t layer) {
  // While this layer computes, the next layer's KV moves into the other staging buffer (which
  // layer - 1 has finished reading: compute runs in order).
  if (length() > 0 && layer + 1 < num_layers_) issue_load(layer + 1);
}

void PipelinedKv::end_pass(int64_t n_new) {
  if (length() == 0) {
    // The prefill's stores read the staging buffers that the first decode loads overwrite.
    engine_.synchronize_stores();
  }
  const bool closes_step = pass_closes_step();
  KvStore::end_pass(n_new);
  if (closes_step) stats_.end_step(engine_.counters());
}

void PipelinedKv::wait_for_load(int64_t layer) {
  StepStats& step = stats_.current();
  engine_.compute_waits(
      loaded_[static_cast<size_t>(layer)],
      {&step.layers[static_cast<size_t>(layer)].load_wait_seconds, &step.load_wait_seconds});
}

}  // namespace infinigen
