// offload: the paged KV pool in pinned host memory and the copy lists into and out of it.
#include "offload/kv_pool.h"

#include <algorithm>
#include <utility>

#include "core/device.h"
#include "core/error.h"
#include "core/saturating.h"

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
  block_bytes_ =
      static_cast<size_t>(shape.batch * shape.num_heads * shape.block_tokens * shape.head_dim) *
      dtype_size(shape.dtype);
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
  return blocks_.size() * block_bytes_;
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
  size_t next = first;
  for (int64_t logical = have; logical < needed; ++logical) {
    for (auto& table : block_table_) table.push_back(static_cast<int64_t>(next++));
  }
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
  const auto& table = block_table_[static_cast<size_t>(2 * layer + static_cast<int64_t>(kind))];
  const auto* block = static_cast<const char*>(blocks_[static_cast<size_t>(table[t / bt])]);
  // Inside the block (B, H, bt, d): row (b, h, t % bt).
  const int64_t element = ((b * shape_.num_heads + h) * bt + t % bt) * shape_.head_dim;
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
        out->push_back({base + static_cast<size_t>(dst_row + t - t0) * row_bytes,
                        row(layer, kind, b, h, t), static_cast<size_t>(run) * row_bytes});
        t += run;
      }
    }
  }
}

}  // namespace infinigen
