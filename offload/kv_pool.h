// offload: the KV pool, every layer's keys and values of a batch in pinned host memory.
//
// Layout, per layer and per K/V: fixed-size blocks of `block_tokens` tokens, each holding one
// sequence's tokens [i * bt, (i + 1) * bt) of every head as (H, bt, d) in `dtype` (fp16 by
// default), and a block table per (layer, K/V, sequence) mapping logical block i to a physical
// block (vLLM style). A (sequence, head) run of up to bt tokens is contiguous, so a gather of
// selected tokens reads d-element rows and a gather of a token range reads runs of up to bt * d
// elements. The sequences of a batch advance together: a new logical block gets one private
// block per sequence, all B of them in one pinned allocation.
//
// Prompt prefixes that groups of the batch share (core/shared_prefixes.h) are kept once: each of
// a group's prefix blocks is one physical block that every member's table refers to, carrying
// the count of those references. Its rows are found through any member (row()), and a gather
// copies them once, into the rows of its owner (the group's leader, its lowest member), whose
// rows every member's attention then reads. The shared region's other blocks hold padding only
// and are never allocated. A write of a sequence's rows into a block others refer to too first
// copies it into a private block of that sequence (copy on write), so no sequence's write
// changes another's prefix; a block no table refers to any more is freed.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "core/dtype.h"
#include "core/shared_prefixes.h"
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

// The block of a pool capped at `positions` per (layer, sequence, head) (--kv-pool-limit):
// `block_tokens`, or the positions when the cap is smaller, so that a cap below a block pins only
// the positions it holds instead of a whole block it never fills.
inline int64_t capped_block_tokens(int64_t block_tokens, int64_t positions) {
  return std::min(block_tokens, positions);
}

class KvPool {
 public:
  explicit KvPool(const KvPoolShape& shape);  // allocates nothing yet
  ~KvPool();
  KvPool(const KvPool&) = delete;
  KvPool& operator=(const KvPool&) = delete;

  const KvPoolShape& shape() const { return shape_; }
  int64_t num_blocks() const;  // logical blocks per table so far (the same for every table)
  // Bytes when all max_tokens are stored: 2 * L * B * H * max_tokens * d * size, rounded up
  // to whole blocks.
  static size_t capacity_bytes(const KvPoolShape& shape);
  // The pool pins its memory in allocations of one block of every sequence, (B, H, bt, d), one per
  // (logical block, layer, K or V): their size, and how many hold all max_tokens.
  static size_t allocation_bytes(const KvPoolShape& shape);
  static size_t allocation_count(const KvPoolShape& shape);
  size_t allocated_bytes() const;  // what the pool holds now

  // Makes tokens [0, tokens) addressable in every table (allocating private blocks for new
  // logical blocks). Throws Error past max_tokens.
  void reserve(int64_t tokens);
  // On an empty pool: logical blocks [0, shared.rows() / bt) of every table, group g's prefix
  // blocks (tokens [shared.rows() - shared.length(g), shared.rows())) one block per group that
  // each member refers to, the rest padding (nothing allocated). One-line Error unless every
  // length is whole blocks.
  void share(const SharedPrefixes& shared);
  // Keeps the tables of sequences `keep` (old indices, ascending), renumbered 0.. in that order
  // (KvStore::drop_sequences): the dropped sequences' references go, a block of its own
  // allocation that no table refers to any more is freed (a shared block, a private copy), and a
  // shared block's owner becomes its lowest remaining referrer. A dropped sequence's blocks of a
  // batch's allocation stay pinned until the pool goes (the other sequences' blocks share it).
  void keep_sequences(const std::vector<int64_t>& keep);
  // Tables referring to the block that holds token t of (layer, kind, sequence b): 1 for a
  // private block, the members still sharing it for a shared one, 0 where nothing is stored
  // (padding in the shared region).
  int32_t references(int64_t layer, KvKind kind, int64_t b, int64_t t) const;
  // Chunks writing the rows of tokens [t0, t1) of `layer` once per block, from its owner's rows
  // of src, laid out (B, H, src_capacity, d), at the same token rows: how the sharing pass
  // stores the groups' prefixes, each computed in its leader's rows. Padding is skipped.
  void scatter_shared_chunks(int64_t layer, KvKind kind, const void* src, int64_t src_capacity,
                             int64_t t0, int64_t t1, std::vector<CopyChunk>* out);

  // Chunks copying src, laid out (B, H, src_capacity, d) in the pool's dtype, rows
  // [src_row0, src_row0 + n) into the pool at tokens [t0, t0 + n) of `layer`. Reserves blocks;
  // copies the shared blocks it writes into, and allocates the padding blocks it writes into, for
  // each writing sequence (no transfer may be reading them).
  void scatter_chunks(int64_t layer, KvKind kind, const void* src, int64_t src_capacity,
                      int64_t src_row0, int64_t t0, int64_t n, std::vector<CopyChunk>* out);
  // Chunks copying tokens [t0, t1) of `layer` into dst laid out (B, H, dst_capacity, d) at rows
  // [dst_row0, dst_row0 + t1 - t0). One chunk per (sequence, head, block) run; a shared block's
  // runs go to its owner's rows only, padding blocks' nowhere.
  void gather_chunks(int64_t layer, KvKind kind, int64_t t0, int64_t t1, void* dst,
                     int64_t dst_capacity, int64_t dst_row0, std::vector<CopyChunk>* out) const;
  // Address of token t of (layer, kind, sequence b, head h): d contiguous elements (the shared
  // block's, the same for every member). One-line Error where nothing is stored (padding).
  const void* row(int64_t layer, KvKind kind, int64_t b, int64_t h, int64_t t) const;
  void* row(int64_t layer, KvKind kind, int64_t b, int64_t h, int64_t t);
  // The block table of (layer, kind) as addresses: out[b * num_blocks() + i] is sequence b's
  // logical block i, (H, bt, d), null where nothing is stored; for a gather on the device
  // (kernels/cuda/gather.h's SelectedRowGather). `out` holds B * num_blocks() entries.
  void block_addresses(int64_t layer, KvKind kind, const void** out) const;

 private:
  struct Block {
    char* data = nullptr;     // (H, bt, d)
    int32_t references = 0;   // tables referring to it
    int32_t owner = 0;        // the sequence whose rows a gather fills: its lowest referrer
    int64_t allocation = -1;  // its own entry of allocations_; -1: part of a batch's allocation
  };
  static constexpr int32_t kPadding = -1;  // a table entry with nothing stored

  std::vector<int32_t>& table(int64_t layer, KvKind kind, int64_t b) {
    return tables_[static_cast<size_t>((2 * layer + static_cast<int64_t>(kind)) * shape_.batch +
                                       b)];
  }
  const std::vector<int32_t>& table(int64_t layer, KvKind kind, int64_t b) const {
    return tables_[static_cast<size_t>((2 * layer + static_cast<int64_t>(kind)) * shape_.batch +
                                       b)];
  }
  void check_layer(int64_t layer) const;
  // A block of its own allocation for `owner`, referred to by `references` tables.
  int32_t allocate_block(int32_t owner, int32_t references, const char* purpose);
  void release_allocation(int64_t allocation);
  // Gives sequence b's table a private block for logical block `logical` of (layer, kind): a
  // copy of the shared block it referred to (the others keep it), or a new one for padding.
  void make_private(int64_t layer, KvKind kind, int64_t b, int64_t logical);

  KvPoolShape shape_;
  size_t block_bytes_ = 0;  // one block: (H, bt, d)
  struct Allocation {
    void* data = nullptr;
    size_t bytes = 0;
  };
  std::vector<Allocation> allocations_;  // pinned; data null once released
  size_t allocated_bytes_ = 0;
  std::vector<Block> blocks_;
  // (L * 2 * B) tables, [(layer * 2 + kind) * B + b][logical]: an index of blocks_, or kPadding.
  std::vector<std::vector<int32_t>> tables_;
};

}  // namespace infinigen
