// offload: the KV pool, every layer's keys and values of a batch in pinned host memory.
//
// Layout, per layer and per K/V: fixed-size blocks of `block_tokens` tokens, block i holding
// tokens [i * bt, (i + 1) * bt) of every sequence and head as (B, H, bt, d) in `dtype` (fp16 by
// default). A block table maps logical block i to a physical block, allocated from the pool's
// pinned arena as the sequences grow (vLLM style; the sequences of a batch advance together, so
// one table serves the batch). A (sequence, head) run of up to bt tokens is contiguous, so a
// gather of selected tokens reads d-element rows and a gather of a token range reads runs of up
// to bt * d elements.
//
// A prompt prefix the whole batch shares (KvStore::share_prefix) lives in shared blocks, one
// (1, H, bt, d) block per logical block instead of (B, H, bt, d): every sequence of the batch
// refers to it (the batch advances together, so one table still serves it), its rows are those
// of sequence 0 wherever an address is asked for, and a gather copies them once, into sequence
// 0's rows. A write of the batch's rows into a shared block first copies it into a private block
// for every sequence (copy on write), so no sequence's write changes another's prefix.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/dtype.h"
#include "offload/transfer_engine.h"

namespace infinigen {

enum class KvKind { Key = 0, Value = 1 };

struct KvPoolShape {
  int64_t num_layers = 0;
  int64_t batch = 0;       // B
  int64_t num_heads = 0;   // H
  int64_t head_dim = 0;    // d
  int64_t max_tokens = 0;  // per sequence, padding included (prompt + generation)
  int64_t block_tokens = 128;
  DType dtype = DType::F16;
};

class KvPool {
 public:
  explicit KvPool(const KvPoolShape& shape);  // allocates nothing yet
  ~KvPool();
  KvPool(const KvPool&) = delete;
  KvPool& operator=(const KvPool&) = delete;

  const KvPoolShape& shape() const { return shape_; }
  int64_t num_blocks() const;  // logical blocks allocated so far (the same for every layer)
  // Bytes when all max_tokens are stored: 2 * L * B * H * max_tokens * d * size, rounded up
  // to whole blocks.
  static size_t capacity_bytes(const KvPoolShape& shape);
  size_t allocated_bytes() const;

  // Makes tokens [0, tokens) addressable in every layer (allocating blocks). Throws Error past
  // max_tokens.
  void reserve(int64_t tokens);
  // On an empty pool: tokens [0, tokens) (whole blocks) become shared blocks in every layer.
  void reserve_shared(int64_t tokens);
  // Leading tokens held in shared blocks in every table (0 once any of them was copied on write).
  int64_t shared_tokens() const;
  // Chunks copying src, laid out (1, H, src_capacity, d), rows [src_row0, src_row0 + n) into the
  // shared blocks holding tokens [t0, t0 + n) of `layer`.
  void scatter_shared_chunks(int64_t layer, KvKind kind, const void* src, int64_t src_capacity,
                             int64_t src_row0, int64_t t0, int64_t n,
                             std::vector<CopyChunk>* out);

  // Chunks copying src, laid out (B, H, src_capacity, d) in the pool's dtype, rows
  // [src_row0, src_row0 + n) into the pool at tokens [t0, t0 + n) of `layer`. Reserves blocks;
  // copies the shared blocks it writes into (no transfer may be reading them).
  void scatter_chunks(int64_t layer, KvKind kind, const void* src, int64_t src_capacity,
                      int64_t src_row0, int64_t t0, int64_t n, std::vector<CopyChunk>* out);
  // Chunks copying tokens [t0, t1) of `layer` into dst laid out (B, H, dst_capacity, d) at rows
  // [dst_row0, dst_row0 + t1 - t0). One chunk per (sequence, head, block) run; a shared block's
  // runs go to sequence 0's rows only.
  void gather_chunks(int64_t layer, KvKind kind, int64_t t0, int64_t t1, void* dst,
                     int64_t dst_capacity, int64_t dst_row0, std::vector<CopyChunk>* out) const;
  // Address of token t of (layer, kind, sequence b, head h): d contiguous elements (sequence
  // 0's in a shared block).
  const void* row(int64_t layer, KvKind kind, int64_t b, int64_t h, int64_t t) const;
  void* row(int64_t layer, KvKind kind, int64_t b, int64_t h, int64_t t);

 private:
  const std::vector<int64_t>& table(int64_t layer, KvKind kind) const {
    return block_table_[static_cast<size_t>(2 * layer + static_cast<int64_t>(kind))];
  }
  bool is_shared(int64_t layer, KvKind kind, int64_t logical) const {
    return shared_[static_cast<size_t>(table(layer, kind)[static_cast<size_t>(logical)])];
  }
  // Copies a shared block into a private one for every sequence.
  void make_private(int64_t layer, KvKind kind, int64_t logical);

  KvPoolShape shape_;
  size_t block_bytes_ = 0;         // a private block: (B, H, bt, d)
  size_t shared_block_bytes_ = 0;  // a shared block: (1, H, bt, d)
  // Physical blocks; block_table_[layer][kind][logical] indexes blocks_ and shared_.
  std::vector<void*> blocks_;
  std::vector<bool> shared_;
  size_t allocated_bytes_ = 0;
  std::vector<std::vector<int64_t>> block_table_;  // (L * 2) tables
};

}  // namespace infinigen
