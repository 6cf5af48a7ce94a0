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
  // One block: (H, bt, d) elements.
  block_bytes_ = static_cast<size_t>(shape.num_heads * shape.block_tokens * shape.head_dim) *
                 dtype_size(shape.dtype);
  tables_.resize(static_cast<size_t>(2 * shape.num_layers * shape.batch));
}

KvPool::~KvPool() {
  for (const Allocation& allocation : allocations_) pinned_free(allocation.data);
}

int64_t KvPool::num_blocks() const {
  return static_cast<int64_t>(tables_.front().size());
}

size_t KvPool::capacity_bytes(const KvPoolShape& s) {
  INFINIGEN_CHECK(s.block_tokens > 0, "KV pool: block_tokens must be positive, got ",
                  s.block_tokens);
  return saturating_product({2, s.num_layers, s.batch, s.num_heads,
                             ceil_div(s.max_tokens, s.block_tokens), s.block_tokens, s.head_dim,
                             static_cast<int64_t>(dtype_size(s.dtype))});
}

size_t KvPool::allocation_bytes(const KvPoolShape& s) {
  return saturating_product({s.batch, s.num_heads, s.block_tokens, s.head_dim,
                             static_cast<int64_t>(dtype_size(s.dtype))});
}

size_t KvPool::allocation_count(const KvPoolShape& s) {
  INFINIGEN_CHECK(s.block_tokens > 0, "KV pool: block_tokens must be positive, got ",
                  s.block_tokens);
  return saturating_product({ceil_div(s.max_tokens, s.block_tokens), 2, s.num_layers});
}

size_t KvPool::allocated_bytes() const {
  return allocated_bytes_;
}

void KvPool::check_layer(int64_t layer) const {
  INFINIGEN_CHECK(layer >= 0 && layer < shape_.num_layers, "KV pool: layer ", layer,
                  " out of range [0, ", shape_.num_layers, ")");
}

void KvPool::reserve(int64_t tokens) {
  INFINIGEN_CHECK(tokens >= 0 && tokens <= shape_.max_tokens, "KV pool: cannot hold ", tokens,
                  " tokens per sequence (max_tokens ", shape_.max_tokens, ")");
  const int64_t needed = ceil_div(tokens, shape_.block_tokens);
  const int64_t have = num_blocks();
  if (needed <= have) return;
  // Every table grows by the same count, so the tables stay equally long even if an allocation
  // throws half way: blocks are added to the tables only once all of them exist.
  const int64_t B = shape_.batch;
  const size_t added = static_cast<size_t>((needed - have) * 2 * shape_.num_layers);
  const size_t first = allocations_.size();
  const size_t batch_bytes = allocation_bytes(shape_);
  allocations_.reserve(first + added);
  try {
    for (size_t i = 0; i < added; ++i) {
      allocations_.push_back({pinned_alloc(batch_bytes, "a KV pool block"), batch_bytes});
    }
  } catch (...) {
    for (size_t i = first; i < allocations_.size(); ++i) pinned_free(allocations_[i].data);
    allocations_.resize(first);
    throw;
  }
  allocated_bytes_ += added * batch_bytes;
  blocks_.reserve(blocks_.size() + added * static_cast<size_t>(B));
  size_t next = first;
  for (int64_t logical = have; logical < needed; ++logical) {
    for (int64_t lk = 0; lk < 2 * shape_.num_layers; ++lk) {
      // One allocation (B, H, bt, d): sequence b's block is its b-th (H, bt, d).
      char* data = static_cast<char*>(allocations_[next++].data);
      for (int64_t b = 0; b < B; ++b) {
        tables_[static_cast<size_t>(lk * B + b)].push_back(static_cast<int32_t>(blocks_.size()));
        blocks_.push_back(
            {data + static_cast<size_t>(b) * block_bytes_, 1, static_cast<int32_t>(b), -1});
      }
    }
  }
}

int32_t KvPool::allocate_block(int32_t owner, int32_t references, const char* purpose) {
  void* data = pinned_alloc(block_bytes_, purpose);
  allocations_.push_back({data, block_bytes_});
  allocated_bytes_ += block_bytes_;
  blocks_.push_back(
      {static_cast<char*>(data), references, owner, static_cast<int64_t>(allocations_.size()) - 1});
  return static_cast<int32_t>(blocks_.size()) - 1;
}

void KvPool::release_allocation(int64_t allocation) {
  Allocation& a = allocations_[static_cast<size_t>(allocation)];
  pinned_free(a.data);
  allocated_bytes_ -= a.bytes;
  a = {};
}

void KvPool::share(const SharedPrefixes& shared) {
  const int64_t bt = shape_.block_tokens, B = shape_.batch;
  INFINIGEN_CHECK(num_blocks() == 0, "KV pool: shared prefixes go into an empty pool");
  INFINIGEN_CHECK(shared.batch() == B, "KV pool: shared prefixes of ", shared.batch(),
                  " sequences for a batch of ", B);
  INFINIGEN_CHECK(shared.rows() <= shape_.max_tokens, "KV pool: shared prefixes of ", shared.rows(),
                  " rows beyond max_tokens ", shape_.max_tokens);
  for (int64_t g = 0; g < shared.num_groups(); ++g) {
    INFINIGEN_CHECK(shared.length(g) % bt == 0 && shared.rows() % bt == 0,
                    "KV pool: a shared prefix of ", shared.length(g),
                    " tokens is not whole blocks of ", bt);
  }
  const int64_t blocks = shared.rows() / bt;
  std::vector<int32_t> members(static_cast<size_t>(shared.num_groups()), 0);
  for (int32_t g : shared.groups()) {
    if (g >= 0) ++members[static_cast<size_t>(g)];
  }
  for (auto& table : tables_) table.assign(static_cast<size_t>(blocks), kPadding);
  try {
    for (int64_t lk = 0; lk < 2 * shape_.num_layers; ++lk) {
      for (int64_t g = 0; g < shared.num_groups(); ++g) {
        const int32_t leader = shared.leaders()[static_cast<size_t>(g)];
        for (int64_t logical = (shared.rows() - shared.length(g)) / bt; logical < blocks;
             ++logical) {
          const int32_t block =
              allocate_block(leader, members[static_cast<size_t>(g)], "a shared KV pool block");
          for (int64_t b = 0; b < B; ++b) {
            if (shared.group(b) == g) {
              tables_[static_cast<size_t>(lk * B + b)][static_cast<size_t>(logical)] = block;
            }
          }
        }
      }
    }
  } catch (...) {
    for (auto& table : tables_) table.clear();
    for (size_t a = 0; a < allocations_.size(); ++a) {
      if (allocations_[a].data != nullptr) release_allocation(static_cast<int64_t>(a));
    }
    allocations_.clear();
    blocks_.clear();
    throw;
  }
}

void KvPool::keep_sequences(const std::vector<int64_t>& keep) {
  const int64_t B = shape_.batch, K = std::ssize(keep);
  std::vector<bool> kept(static_cast<size_t>(B), false);
  for (int64_t b : keep) kept[static_cast<size_t>(b)] = true;
  std::vector<std::vector<int32_t>> tables;
  tables.reserve(static_cast<size_t>(2 * shape_.num_layers * K));
  for (int64_t lk = 0; lk < 2 * shape_.num_layers; ++lk) {
    for (int64_t b = 0; b < B; ++b) {
      if (kept[static_cast<size_t>(b)]) continue;
      for (int32_t entry : tables_[static_cast<size_t>(lk * B + b)]) {
        if (entry == kPadding) continue;
        Block& block = blocks_[static_cast<size_t>(entry)];
        if (--block.references == 0 && block.allocation >= 0) {
          release_allocation(block.allocation);
          block.data = nullptr;
        }
      }
    }
    for (int64_t b : keep) tables.push_back(std::move(tables_[static_cast<size_t>(lk * B + b)]));
  }
  tables_ = std::move(tables);
  shape_.batch = K;
  // Owners: the lowest referrer, in the new numbering.
  std::vector<bool> owned(blocks_.size(), false);
  for (int64_t lk = 0; lk < 2 * shape_.num_layers; ++lk) {
    for (int64_t i = 0; i < K; ++i) {
      for (int32_t entry : tables_[static_cast<size_t>(lk * K + i)]) {
        if (entry == kPadding || owned[static_cast<size_t>(entry)]) continue;
        owned[static_cast<size_t>(entry)] = true;
        blocks_[static_cast<size_t>(entry)].owner = static_cast<int32_t>(i);
      }
    }
  }
}

int32_t KvPool::references(int64_t layer, KvKind kind, int64_t b, int64_t t) const {
  check_layer(layer);
  INFINIGEN_CHECK(b >= 0 && b < shape_.batch && t >= 0 && t < num_blocks() * shape_.block_tokens,
                  "KV pool: token ", t, " of sequence ", b, " is not reserved");
  const int32_t block = table(layer, kind, b)[static_cast<size_t>(t / shape_.block_tokens)];
  return block == kPadding ? 0 : blocks_[static_cast<size_t>(block)].references;
}

void KvPool::make_private(int64_t layer, KvKind kind, int64_t b, int64_t logical) {
  int32_t& entry = table(layer, kind, b)[static_cast<size_t>(logical)];
  const int32_t copy =
      allocate_block(static_cast<int32_t>(b), 1, "a private copy of a KV pool block");
  if (entry != kPadding) {
    Block& shared = blocks_[static_cast<size_t>(entry)];
    if (!dry_run()) std::memcpy(blocks_[static_cast<size_t>(copy)].data, shared.data, block_bytes_);
    if (--shared.references == 0) {
      if (shared.allocation >= 0) release_allocation(shared.allocation);
      shared.data = nullptr;
    } else if (shared.owner == b) {  // the next member fills it now
      for (int64_t other = 0; other < shape_.batch; ++other) {
        if (table(layer, kind, other)[static_cast<size_t>(logical)] == entry && other != b) {
          shared.owner = static_cast<int32_t>(other);
          break;
        }
      }
    }
  }
  entry = copy;
}

const void* KvPool::row(int64_t layer, KvKind kind, int64_t b, int64_t h, int64_t t) const {
  check_layer(layer);
  INFINIGEN_CHECK(b >= 0 && b < shape_.batch && h >= 0 && h < shape_.num_heads,
                  "KV pool: sequence ", b, " head ", h, " out of range (batch ", shape_.batch,
                  ", heads ", shape_.num_heads, ")");
  const int64_t bt = shape_.block_tokens;
  INFINIGEN_CHECK(t >= 0 && t < num_blocks() * bt, "KV pool: token ", t, " is not reserved (",
                  num_blocks() * bt, " tokens reserved)");
  const int32_t block = table(layer, kind, b)[static_cast<size_t>(t / bt)];
  INFINIGEN_CHECK(block != kPadding, "KV pool: token ", t, " of sequence ", b,
                  " is padding; nothing is stored there");
  // Inside the block (H, bt, d): row (h, t % bt).
  const int64_t element = (h * bt + t % bt) * shape_.head_dim;
  return blocks_[static_cast<size_t>(block)].data +
         static_cast<size_t>(element) * dtype_size(shape_.dtype);
}

void* KvPool::row(int64_t layer, KvKind kind, int64_t b, int64_t h, int64_t t) {
  return const_cast<void*>(std::as_const(*this).row(layer, kind, b, h, t));
}

void KvPool::block_addresses(int64_t layer, KvKind kind, const void** out) const {
  check_layer(layer);
  for (int64_t b = 0; b < shape_.batch; ++b) {
    for (const int32_t block : table(layer, kind, b)) {
      *out++ = block == kPadding ? nullptr : blocks_[static_cast<size_t>(block)].data;
    }
  }
}

void KvPool::scatter_chunks(int64_t layer, KvKind kind, const void* src, int64_t src_capacity,
                            int64_t src_row0, int64_t t0, int64_t n, std::vector<CopyChunk>* out) {
  check_layer(layer);
  INFINIGEN_CHECK(t0 >= 0 && n >= 0, "KV pool: invalid ", kind_name(kind), " store of ", n,
                  " tokens at token ", t0);
  INFINIGEN_CHECK(t0 + n <= shape_.max_tokens, "KV pool: storing ", kind_name(kind), " tokens [",
                  t0, ", ", t0 + n, ") goes beyond max_tokens ", shape_.max_tokens);
  INFINIGEN_CHECK(src_row0 >= 0 && src_row0 + n <= src_capacity, "KV pool: source rows [", src_row0,
                  ", ", src_row0 + n, ") exceed the source capacity ", src_capacity);
  if (n == 0) return;
  reserve(t0 + n);
  const int64_t bt = shape_.block_tokens;
  for (int64_t b = 0; b < shape_.batch; ++b) {
    for (int64_t logical = t0 / bt; logical <= (t0 + n - 1) / bt; ++logical) {
      const int32_t block = table(layer, kind, b)[static_cast<size_t>(logical)];
      if (block == kPadding || blocks_[static_cast<size_t>(block)].references > 1) {
        make_private(layer, kind, b, logical);
      }
    }
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
  check_layer(layer);
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
    const std::vector<int32_t>& blocks = table(layer, kind, b);
    for (int64_t h = 0; h < shape_.num_heads; ++h) {
      // dst (B, H, dst_capacity, d): rows of (b, h) start at this row.
      const int64_t dst_row = (b * shape_.num_heads + h) * dst_capacity + dst_row0;
      for (int64_t t = t0; t < t1;) {
        const int64_t run = std::min(t1, (t / bt + 1) * bt) - t;
        const int32_t block = blocks[static_cast<size_t>(t / bt)];
        if (block != kPadding && blocks_[static_cast<size_t>(block)].owner == b) {
          out->push_back({base + static_cast<size_t>(dst_row + t - t0) * row_bytes,
                          row(layer, kind, b, h, t), static_cast<size_t>(run) * row_bytes});
        }
        t += run;
      }
    }
  }
}

void KvPool::scatter_shared_chunks(int64_t layer, KvKind kind, const void* src,
                                   int64_t src_capacity, int64_t t0, int64_t t1,
                                   std::vector<CopyChunk>* out) {
  check_layer(layer);
  const int64_t bt = shape_.block_tokens;
  INFINIGEN_CHECK(t0 >= 0 && t0 <= t1 && t1 <= num_blocks() * bt && t1 <= src_capacity,
                  "KV pool: shared ", kind_name(kind), " tokens [", t0, ", ", t1, ") of layer ",
                  layer, " are not reserved, or beyond the source");
  const size_t row_bytes = static_cast<size_t>(shape_.head_dim) * dtype_size(shape_.dtype);
  const auto* base = static_cast<const char*>(src);
  for (int64_t b = 0; b < shape_.batch; ++b) {
    const std::vector<int32_t>& blocks = table(layer, kind, b);
    for (int64_t h = 0; h < shape_.num_heads; ++h) {
      const int64_t src_row = (b * shape_.num_heads + h) * src_capacity;  // src (B, H, cap, d)
      for (int64_t t = t0; t < t1;) {
        const int64_t run = std::min(t1, (t / bt + 1) * bt) - t;
        const int32_t block = blocks[static_cast<size_t>(t / bt)];
        if (block != kPadding && blocks_[static_cast<size_t>(block)].owner == b) {
          out->push_back({row(layer, kind, b, h, t),
                          base + static_cast<size_t>(src_row + t) * row_bytes,
                          static_cast<size_t>(run) * row_bytes});
        }
        t += run;
      }
    }
  }
}

}  // namespace infinigen
