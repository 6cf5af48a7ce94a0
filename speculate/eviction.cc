// speculate: victim choice for a KV pool with a memory limit; the rules are in eviction.h.
#include "speculate/eviction.h"

#include <algorithm>
#include <limits>
#include <string>

#include "core/compact_batch.h"
#include "core/error.h"

namespace infinigen {
namespace {

constexpr int64_t kMaxStep = std::numeric_limits<int32_t>::max();

// True when the entry (step_a, slot_a) is older than (step_b, slot_b).
bool older(int32_t step_a, int64_t slot_a, int32_t step_b, int64_t slot_b) {
  return step_a < step_b || (step_a == step_b && slot_a < slot_b);
}

}  // namespace

std::string_view eviction_policy_name(EvictionPolicy policy) {
  switch (policy) {
    case EvictionPolicy::Counter:
      return "counter";
    case EvictionPolicy::Lru:
      return "lru";
    case EvictionPolicy::Fifo:
      return "fifo";
  }
  return "unknown";
}

EvictionTable::EvictionTable(EvictionPolicy policy, int64_t rows, int64_t capacity,
                             int counter_bits)
    : policy_(policy), rows_(rows), capacity_(capacity), counter_bits_(counter_bits) {
  INFINIGEN_CHECK(rows >= 1, "eviction table: rows must be at least 1, got ", rows);
  INFINIGEN_CHECK(capacity >= 1 && capacity <= kMaxStep, "eviction table: capacity must be in [1, ",
                  kMaxStep, "], got ", capacity);
  INFINIGEN_CHECK(rows <= std::numeric_limits<int64_t>::max() / capacity,
                  "eviction table: rows x capacity overflows (", rows, " x ", capacity, ")");
  INFINIGEN_CHECK(counter_bits >= 1 && counter_bits <= 16,
                  "eviction table: counter_bits must be in [1, 16], got ", counter_bits);
  counter_max_ = (int64_t{1} << counter_bits) - 1;
  num_candidates_ = std::max<int64_t>(1, capacity / 2);

  const auto slots = static_cast<size_t>(rows * capacity);
  step_.assign(slots, -1);
  rank_.assign(slots, 0);
  if (policy == EvictionPolicy::Counter) counter_.assign(slots, 0);
  if (policy == EvictionPolicy::Lru) last_use_.assign(slots, -1);
  size_.assign(static_cast<size_t>(rows), 0);
  newest_.assign(static_cast<size_t>(rows), -1);
}

void EvictionTable::check_row(int64_t row, const char* what) const {
  INFINIGEN_CHECK(row >= 0 && row < rows_, "eviction table: ", what, ": row ", row,
                  " out of range [0, ", rows_, ")");
}

size_t EvictionTable::slot_index(int64_t row, int64_t slot, const char* what) const {
  check_row(row, what);
  INFINIGEN_CHECK(slot >= 0 && slot < capacity_, "eviction table: ", what, ": slot ", slot,
                  " out of range [0, ", capacity_, ")");
  return static_cast<size_t>(row * capacity_ + slot);
}

void EvictionTable::check_policy(EvictionPolicy needed, const char* what) const {
  INFINIGEN_CHECK(policy_ == needed, "eviction table: ", what, "() needs the ",
                  eviction_policy_name(needed), " policy, this table is ",
                  eviction_policy_name(policy_));
}

void EvictionTable::check_step(int64_t step, const char* what) const {
  INFINIGEN_CHECK(step >= 0 && step <= kMaxStep, "eviction table: ", what, ": step ", step,
                  " out of range [0, ", kMaxStep, "]");
}

int64_t EvictionTable::size(int64_t row) const {
  check_row(row, "size");
  return size_[static_cast<size_t>(row)];
}

int64_t EvictionTable::inserted_step(int64_t row, int64_t slot) const {
  return step_[slot_index(row, slot, "inserted_step")];
}

int64_t EvictionTable::counter(int64_t row, int64_t slot) const {
  check_policy(EvictionPolicy::Counter, "counter");
  return counter_[slot_index(row, slot, "counter")];
}

int64_t EvictionTable::last_use(int64_t row, int64_t slot) const {
  check_policy(EvictionPolicy::Lru, "last_use");
  return last_use_[slot_index(row, slot, "last_use")];
}

void EvictionTable::remove(int64_t row, int64_t slot) {
  const int64_t base = row * capacity_;
  int32_t* step = step_.data() + base;
  int32_t* rank = rank_.data() + base;
  const int32_t removed_rank = rank[slot];
  step[slot] = -1;
  const int32_t size = --size_[static_cast<size_t>(row)];
  const bool was_newest = newest_[static_cast<size_t>(row)] == slot;
  int32_t newest = -1;
  for (int64_t j = 0; j < capacity_; ++j) {
    if (step[j] < 0) continue;
    if (rank[j] > removed_rank) --rank[j];
    if (rank[j] == size - 1) newest = static_cast<int32_t>(j);
  }
  if (was_newest) newest_[static_cast<size_t>(row)] = newest;
}

void EvictionTable::on_insert(int64_t row, int64_t slot, int64_t step) {
  const size_t index = slot_index(row, slot, "on_insert");
  check_step(step, "on_insert");
  const int64_t base = row * capacity_;
  if (step_[index] >= 0) remove(row, slot);

  int32_t* steps = step_.data() + base;
  int32_t* rank = rank_.data() + base;
  const auto new_step = static_cast<int32_t>(step);
  const auto r = static_cast<size_t>(row);
  const int32_t newest = newest_[r];
  if (newest < 0 || older(steps[newest], newest, new_step, slot)) {
    // Newer than every entry: nobody's rank changes (the in-order fill and decode path).
    rank[slot] = size_[r];
    newest_[r] = static_cast<int32_t>(slot);
  } else {
    // Out of age order: the entries newer than this one move one rank up.
    int32_t new_rank = 0;
    for (int64_t j = 0; j < capacity_; ++j) {
      if (steps[j] < 0) continue;
      if (older(steps[j], j, new_step, slot)) {
        ++new_rank;
      } else {
        ++rank[j];
      }
    }
    rank[slot] = new_rank;
  }
  steps[slot] = new_step;
  ++size_[r];
  if (policy_ == EvictionPolicy::Counter) counter_[index] = 0;
  if (policy_ == EvictionPolicy::Lru) last_use_[index] = new_step;
}

void EvictionTable::on_fetch(int64_t row, int64_t slot, int64_t step) {
  const size_t index = slot_index(row, slot, "on_fetch");
  check_step(step, "on_fetch");
  const int64_t base = row * capacity_;
  INFINIGEN_CHECK(step_[index] >= 0, "eviction table: on_fetch: slot ", slot, " of row ", row,
                  " is empty");
  switch (policy_) {
    case EvictionPolicy::Counter:
      if (counter_[index] == counter_max_) {
        // Halving the whole row keeps the counters' order (up to ties) while making room.
        uint16_t* counters = counter_.data() + base;
        for (int64_t j = 0; j < capacity_; ++j)
          counters[j] = static_cast<uint16_t>(counters[j] >> 1);
      }
      ++counter_[index];
      break;
    case EvictionPolicy::Lru:
      last_use_[index] = std::max(last_use_[index], static_cast<int32_t>(step));
      break;
    case EvictionPolicy::Fifo:
      break;
  }
}

void EvictionTable::seed_row(int64_t row, const std::vector<int64_t>& fetches,
                             const std::vector<int64_t>& last_fetch) {
  check_row(row, "seed_row");
  INFINIGEN_CHECK(
      fetches.size() == last_fetch.size() && static_cast<int64_t>(fetches.size()) <= capacity_,
      "eviction table: seed_row: ", fetches.size(), " counts and ", last_fetch.size(),
      " steps for ", capacity_, " slots");
  const int64_t base = row * capacity_;
  int shift = 0;
  const int64_t most = fetches.empty() ? 0 : *std::max_element(fetches.begin(), fetches.end());
  while ((most >> shift) > counter_max_) ++shift;
  for (size_t slot = 0; slot < fetches.size(); ++slot) {
    const auto index = static_cast<size_t>(base + static_cast<int64_t>(slot));
    INFINIGEN_CHECK(step_[index] >= 0 && fetches[slot] >= 0, "eviction table: seed_row: slot ",
                    slot, " of row ", row, " is empty or has a negative count");
    if (policy_ == EvictionPolicy::Counter) {
      counter_[index] = static_cast<uint16_t>(fetches[slot] >> shift);
    } else if (policy_ == EvictionPolicy::Lru && last_fetch[slot] >= 0) {
      check_step(last_fetch[slot], "seed_row");
      last_use_[index] = std::max(last_use_[index], static_cast<int32_t>(last_fetch[slot]));
    }
  }
}

void EvictionTable::clear_row(int64_t row) {
  check_row(row, "clear_row");
  const auto base = static_cast<ptrdiff_t>(row * capacity_);
  std::fill_n(step_.begin() + base, capacity_, -1);
  std::fill_n(rank_.begin() + base, capacity_, 0);
  if (!counter_.empty()) std::fill_n(counter_.begin() + base, capacity_, 0);
  if (!last_use_.empty()) std::fill_n(last_use_.begin() + base, capacity_, -1);
  size_[static_cast<size_t>(row)] = 0;
  newest_[static_cast<size_t>(row)] = -1;
}

int64_t EvictionTable::victim(int64_t row, int64_t step) const {
  check_row(row, "victim");
  check_step(step, "victim");
  const int32_t size = size_[static_cast<size_t>(row)];
  INFINIGEN_CHECK(size == capacity_, "eviction table: victim: row ", row, " holds ", size, " of ",
                  capacity_, " slots (only a full row evicts)");
  const int64_t base = row * capacity_;
  const int32_t* rank = rank_.data() + base;
  const auto candidates = static_cast<int32_t>(num_candidates_);

  // The smallest (key, rank) among candidates; rank breaks ties to the oldest.
  int64_t best = -1;
  int64_t best_key = 0;
  int32_t best_rank = 0;
  auto consider = [&](int64_t j, int64_t key) {
    if (best < 0 || key < best_key || (key == best_key && rank[j] < best_rank)) {
      best = j;
      best_key = key;
      best_rank = rank[j];
    }
  };
  switch (policy_) {
    case EvictionPolicy::Counter: {
      const uint16_t* counters = counter_.data() + base;
      for (int64_t j = 0; j < capacity_; ++j) {
        if (rank[j] < candidates) consider(j, counters[j]);
      }
      break;
    }
    case EvictionPolicy::Lru: {
      const int32_t* last = last_use_.data() + base;
      for (int64_t j = 0; j < capacity_; ++j) {
        if (rank[j] < candidates) consider(j, last[j]);
      }
      break;
    }
    case EvictionPolicy::Fifo:
      for (int64_t j = 0; j < capacity_; ++j) {
        if (rank[j] == 0) return j;
      }
      break;
  }
  return best;
}

void EvictionTable::keep_sequences(const std::vector<int64_t>& keep, int64_t rows_per_sequence) {
  const size_t rows = static_cast<size_t>(rows_per_sequence);
  const size_t slots = rows * static_cast<size_t>(capacity_);
  compact_batch(step_, keep, slots);
  compact_batch(rank_, keep, slots);
  compact_batch(counter_, keep, slots);
  compact_batch(last_use_, keep, slots);
  compact_batch(size_, keep, rows);
  compact_batch(newest_, keep, rows);
  rows_ = std::ssize(keep) * rows_per_sequence;
}

}  // namespace infinigen
