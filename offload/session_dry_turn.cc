// offload: a resumed session's turn in a dry run: its reads priced by the cost model.
#include "offload/session.h"

#include "core/error.h"
#include "core/trace.h"

namespace infinigen {

DrySessionTurn::DrySessionTurn(int64_t batch, int64_t history_len, int64_t num_layers,
                               int64_t kv_heads)
    : history_(static_cast<size_t>(batch),
               std::vector<int32_t>(static_cast<size_t>(history_len), 0)),
      num_layers_(num_layers),
      kv_heads_(kv_heads) {}

void DrySessionTurn::restore_layer(int64_t layer, KvStore& store) {
  Trace* trace = active_trace();
  INFINIGEN_CHECK(trace != nullptr, "a dry session turn runs inside a trace");
  if (reads_.empty()) {
    // The read-ahead starts with the turn: every layer's files, one after another. A layer's
    // files hold each token stream's rows (B, H_kv, history, width), and the layer's state.
    const int64_t rows = store.batch() * kv_heads_ * std::ssize(history_.front());
    for (int64_t l = 0; l < num_layers_; ++l) {
      store.restore_layer_state(l, {});  // shapes only in a dry run
      uint64_t bytes = 0;
      for (const KvStore::TokenStream& stream : store.token_streams(l)) {
        bytes += static_cast<uint64_t>(rows * stream.width) * dtype_size(stream.dtype);
      }
      for (const auto& [name, tensor] : store.layer_state(l)) bytes += tensor.nbytes();
      bytes_.push_back(bytes);
      reads_.push_back(trace->transfer(TracedKind::Read, "session_read", l, bytes, 1,
                                       TransferContent::KvRange, -1));
    }
  }
  trace->host_waits(reads_[static_cast<size_t>(layer)]);
  traced("session_restore", {static_cast<int64_t>(bytes_[static_cast<size_t>(layer)])});
}

}  // namespace infinigen
