// offload: the paged KV pool in pinned host memory and the copy lists into and out of it.
#include "offload/kv_pool.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "core/device.h"
#include "core/error.h"
#include "core/saturating.h"
#include "core/trace.h"

namespace infinigen {
namespace {

int64_t ceil_div(int64_t a, int64_t b) {
  return a / b + (a % b != 0 ? 1 : 0);  // no a + b - 1: a may be near the int64 limit
}

const char* kind_name(KvKind kind) {
  return kind == KvKind::Key ? "K" : "V";
}

}  // namespace

KvPool::KvPool(const KvPoolShape& shape) : shape_(shape) {
  INFINIGEN_CHECK(shape.num_layers > 0 && shape.batch > 0 && shape.num_heads > 0 &&
                      shape.head_dim > 0 && shape.block_tokens > 0 && shape.max_tokens >= 0,
                  "KV pool: invalid shape (layers ", shape.num_layers, ", batch ", shape.batch,
                  ", heads ", shape.num_heads, ", head_dim ", shape.head_dim, ", max_tokens ",
                  shape.max_tokens, ", block_tokens ", shape.block_tokens, ")");
  // One block: (B, H, bt, d) elements.
  shared_block_bytes_ = static_cast<size_t>(shape.num_heads * shape.block_tokens *
                                            shape.head_dim) *
                        dtype_size(shape.dtype);
  block_bytes_ = static_cast<size_t>(shape.batch) * shared_block_bytes_;
  block_table_.resize(static_cast<size_t>(2 * shape.num_layers));
}

KvPool::~KvPool() {
  for (void* block : blocks_) pinned_free(block);
}

int64_t KvPool::num_blocks() const {
  return static_cast<int64_t>(block_table_.front().size());
}

size_t KvPool::capacity_bytes(const KvPoolShape& s) {
  INFINIGEN_CHECK(s.block_tokens > 0, "KV pool: block_tokens must be positive, got ",
                  s.block_tokens);
  return saturating_product({2, s.num_layers, s.batch, s.num_heads,
                             ceil_div(s.max_tokens, s.block_tokens), s.block_tokens, s.head_dim,
                             static_cast<int64_t>(dtype_size(s.dtype))});
}

size_t KvPool::allocated_bytes() const {
  return allocated_bytes_;
}

void KvPool::reserve(int64_t tokens) {
  INFINIGEN_CHECK(tokens >= 0 && tokens <= shape_.max_tokens, "KV pool: cannot hold ", tokens,
                  " tokens per sequence (max_tokens ", shape_.max_tokens, ")");
  const int64_t needed = ceil_div(tokens, shape_.block_tokens);
  const int64_t have = num_blocks();
  if (needed <= have) return;
  // Every table grows by the same count, so the tables stay equally long even if an allocation
  // throws half way: blocks are added to the tables only once all of them exist.
  const size_t added = static_cast<size_t>((needed - have) * 2 * shape_.num_layers);
  blocks_.reserve(blocks_.size() + added);
  for (auto& table : block_table_) table.reserve(static_cast<size_t>(needed));
  const size_t first = blocks_.size();
  try {
    for (size_t i = 0; i < added; ++i) blocks_.push_back(pinned_alloc(block_bytes_, "a KV pool block"));
  } catch (...) {
    for (size_t i = first; i < blocks_.size(); ++i) pinned_free(blocks_[i]);
    blocks_.resize(first);
    throw;
  }
  shared_.resize(blocks_.size(), false);
  allocated_bytes_ += added * block_bytes_;
  size_t next = first;
  for (int64_t logical = have; logical < needed; ++logical) {
    for (auto& table : block_table_) table.push_back(static_cast<int64_t>(next++));
  }
}

void KvPool::reserve_shared(int64_t tokens) {
  const int64_t bt = shape_.block_tokens;
  INFINIGEN_CHECK(num_blocks() == 0, "KV pool: a shared prefix goes into an empty pool");
  INFINIGEN_CHECK(tokens > 0 && tokens % bt == 0 && tokens <= shape_.max_tokens,
                  "KV pool: a shared prefix of ", tokens, " tokens is not whole blocks of ", bt,
                  " within max_tokens ", shape_.max_tokens);
  const size_t added = static_cast<size_t>(tokens / bt * 2 * shape_.num_layers);
  blocks_.reserve(added);
  try {
    for (size_t i = 0; i < added; ++i) {
      blocks_.push_back(pinned_alloc(shared_block_bytes_, "a shared KV pool block"));
    }
  } catch (...) {
    for (void* block : blocks_) pinned_free(block);
    blocks_.clear();
    throw;
  }
  shared_.assign(blocks_.size(), true);
  allocated_bytes_ += added * shared_block_bytes_;
  size_t next = 0;
  for (int64_t logical = 0; logical < tokens / bt; ++logical) {
    for (auto& table : block_table_) table.push_back(static_cast<int64_t>(next++));
  }
}

int64_t KvPool::shared_tokens() const {
  int64_t blocks = num_blocks();
  for (int64_t l = 0; l < shape_.num_layers; ++l) {
    for (KvKind kind : {KvKind::Key, KvKind::Value}) {
      int64_t shared = 0;
      while (shared < blocks && is_shared(l, kind, shared)) ++shared;
      blocks = shared;
    }
  }
  return blocks * shape_.block_tokens;
}

void KvPool::make_private(int64_t layer, KvKind kind, int64_t logical) {
  const size_t physical = static_cast<size_t>(table(layer, kind)[static_cast<size_t>(logical)]);
  void* copy = pinned_alloc(block_bytes_, "a KV pool block copied from a shared one");
  // (1, H, bt, d) -> (B, H, bt, d): the same rows for every sequence.
  for (int64_t b = 0; b < shape_.batch && !dry_run(); ++b) {
    std::memcpy(static_cast<char*>(copy) + static_cast<size_t>(b) * shared_block_bytes_,
                blocks_[physical], shared_block_bytes_);
  }
  pinned_free(blocks_[physical]);
  blocks_[physical] = copy;
  shared_[physical] = false;
  allocated_bytes_ += block_bytes_ - shared_block_bytes_;
}

const void* KvPool::row(int64_t layer, KvKind kind, int64_t b, int64_t h, int64_t t) const {
  INFINIGEN_CHECK(layer >= 0 && layer < shape_.num_layers, "KV pool: layer ", layer,
                  " out of range [0, ", shape_.num_layers, ")");
  INFINIGEN_CHECK(b >= 0 && b < shape_.batch && h >= 0 && h < shape_.num_heads,
                  "KV pool: sequence ", b, " head ", h, " out of range (batch ", shape_.batch,
                  ", heads ", shape_.num_heads, ")");
  const int64_t bt = shape_.block_tokens;
  INFINIGEN_CHECK(t >= 0 && t < num_blocks() * bt, "KV pool: token ", t, " is not reserved (",
                  num_blocks() * bt, " tokens reserved)");
  const size_t physical = static_cast<size_t>(table(layer, kind)[static_cast<size_t>(t / bt)]);
  const auto* block = static_cast<const char*>(blocks_[physical]);
  // Inside the block (B, H, bt, d), or (1, H, bt, d) when shared: row (b, h, t % bt).
  const int64_t sequence = shared_[physical] ? 0 : b;
  const int64_t element = ((sequence * shape_.num_heads + h) * bt + t % bt) * shape_.head_dim;
  return block + static_cast<size_t>(element) * dtype_size(shape_.dtype);
}

void* KvPool::row(int64_t layer, KvKind kind, int64_t b, int64_t h, int64_t t) {
  return const_cast<void*>(std::as_const(*this).row(layer, kind, b, h, t));
}

void KvPool::scatter_chunks(int64_t layer, KvKind kind, const void* src, int64_t src_capacity,
                            int64_t src_row0, int64_t t0, int64_t n, std::vector<CopyChunk>* out) {
  INFINIGEN_CHECK(layer >= 0 && layer < shape_.num_layers, "KV pool: layer ", layer,
                  " out of range [0, ", shape_.num_layers, ")");
  INFINIGEN_CHECK(t0 >= 0 && n >= 0, "KV pool: invalid ", kind_name(kind), " store of ", n,
                  " tokens at token ", t0);
  INFINIGEN_CHECK(t0 + n <= shape_.max_tokens, "KV pool: storing ", kind_name(kind), " tokens [",
                  t0, ", ", t0 + n, ") goes beyond max_tokens ", shape_.max_tokens);
  INFINIGEN_CHECK(src_row0 >= 0 && src_row0 + n <= src_capacity, "KV pool: source rows [", src_row0,
                  ", ", src_row0 + n, ") exceed the source capacity ", src_capacity);
  if (n == 0) return;
  reserve(t0 + n);
  const int64_t bt = shape_.block_tokens;
  for (int64_t logical = t0 / bt; logical <= (t0 + n - 1) / bt; ++logical) {
    if (is_shared(layer, kind, logical)) make_private(layer, kind, logical);
  }
  const size_t row_bytes = static_cast<size_t>(shape_.head_dim) * dtype_size(shape_.dtype);
  const auto* base = static_cast<const char*>(src);
  for (int64_t b = 0; b < shape_.batch; ++b) {
    for (int64_t h = 0; h < shape_.num_heads; ++h) {
      // src (B, H, src_capacity, d): rows of (b, h) start at this row.
      const int64_t src_row = (b * shape_.num_heads + h) * src_capacity + src_row0;
      for (int64_t t = t0; t < t0 + n;) {
        const int64_t run = std::min(t0 + n, (t / bt + 1) * bt) - t;
        out->push_back({row(layer, kind, b, h, t),
                        base + static_cast<size_t>(src_row + t - t0) * row_bytes,
                        static_cast<size_t>(run) * row_bytes});
        t += run;
      }
    }
  }
}

void KvPool::gather_chunks(int64_t layer, KvKind kind, int64_t t0, int64_t t1, void* dst,
                           int64_t dst_capacity, int64_t dst_row0,
                           std::vector<CopyChunk>* out) const {
  INFINIGEN_CHECK(layer >= 0 && layer < shape_.num_layers, "KV pool: layer ", layer,
                  " out of range [0, ", shape_.num_layers, ")");
  INFINIGEN_CHECK(t0 >= 0 && t0 <= t1, "KV pool: invalid ", kind_name(kind), " token range [", t0,
                  ", ", t1, ")");
  INFINIGEN_CHECK(t1 <= shape_.max_tokens, "KV pool: loading ", kind_name(kind), " tokens [", t0,
                  ", ", t1, ") goes beyond max_tokens ", shape_.max_tokens);
  const int64_t bt = shape_.block_tokens;
  INFINIGEN_CHECK(t1 <= num_blocks() * bt, "KV pool: loading ", kind_name(kind), " tokens [", t0,
                  ", ", t1, ") beyond the ", num_blocks() * bt, " reserved tokens");
  const int64_t n = t1 - t0;
  INFINIGEN_CHECK(dst_row0 >= 0 && dst_row0 + n <= dst_capacity, "KV pool: destination rows [",
                  dst_row0, ", ", dst_row0 + n, ") exceed the destination capacity ", dst_capacity);
  if (n == 0) return;
  const size_t row_bytes = static_cast<size_t>(shape_.head_dim) * dtype_size(shape_.dtype);
  auto* base = static_cast<char*>(dst);
  for (int64_t b = 0; b < shape_.batch; ++b) {
    for (int64_t h = 0; h < shape_.num_heads; ++h) {
      // dst (B, H, dst_capacity, d): rows of (b, h) start at this row.
      const int64_t dst_row = (b * shape_.num_heads + h) * dst_capacity + dst_row0;
      for (int64_t t = t0; t < t1;) {
        const int64_t run = std::min(t1, (t / bt + 1) * bt) - t;
        if (b == 0 || !is_shared(layer, kind, t / bt)) {
          out->push_back({base + static_cast<size_t>(dst_row + t - t0) * row_bytes,
                          row(layer, kind, b, h, t), static_cast<size_t>(run) * row_bytes});
        }
        t += run;
      }
    }
  }
}

void KvPool::scatter_shared_chunks(int64_t layer, KvKind kind, const void* src,
                                   int64_t src_capacity, int64_t src_row0, int64_t t0, int64_t n,
                                   std::vector<CopyChunk>* out) {
  const int64_t bt = shape_.block_tokens;
  INFINIGEN_CHECK(layer >= 0 && layer < shape_.num_layers && t0 >= 0 && n >= 0 &&
                      t0 + n <= num_blocks() * bt,
                  "KV pool: shared ", kind_name(kind), " tokens [", t0, ", ", t0 + n,
                  ") of layer ", layer, " are not reserved");
  INFINIGEN_CHECK(src_row0 >= 0 && src_row0 + n <= src_capacity, "KV pool: source rows [", src_row0,
                  ", ", src_row0 + n, ") exceed the source capacity ", src_capacity);
  const size_t row_bytes = static_cast<size_t>(shape_.head_dim) * dtype_size(shape_.dtype);
  const auto* base = static_cast<const char*>(src);
  for (int64_t h = 0; h < shape_.num_heads; ++h) {
    const int64_t src_row = h * src_capacity + src_row0;  // src (1, H, src_capacity, d)
    for (int64_t t = t0; t < t0 + n;) {
      INFINIGEN_CHECK(is_shared(layer, kind, t / bt), "KV pool: token ", t,
                      " is not in a shared block");
      const int64_t run = std::min(t0 + n, (t / bt + 1) * bt) - t;
      out->push_back({row(layer, kind, 0, h, t),
                      base + static_cast<size_t>(src_row + t - t0) * row_bytes,
                      static_cast<size_t>(run) * row_bytes});
      t += run;
    }
  }
}

}  // namespace infinigen
