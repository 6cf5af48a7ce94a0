// speculate: victim choice for a KV pool with a memory limit (counter, LRU and FIFO policies).
//
// With a cap on the pool, each (layer, sequence, head) pool holds `capacity` token slots. Once
// one is full, the new token overwrites a victim slot (and the runtime overwrites the same slot
// of the partial key cache). An EvictionTable keeps the bookkeeping of many such pools, one
// "row" each (the caller picks the numbering, e.g. (layer * B + b) * H + h), as a struct of
// arrays indexed row * capacity + slot. Nothing allocates after construction.
//
// Rules (exact; the tests check them against a naive model):
//  * Age. An entry's age key is (insertion step, slot): smaller is older. Steps are caller
//    values in [0, 2^31 - 1] (decode step or token position); they need not be increasing.
//  * Candidates. In a full row, the entries ranked by age, the oldest floor(capacity / 2) are
//    the candidates and the newest ceil(capacity / 2) are protected, so a token just added is
//    not evicted before speculation had a chance to select it. A one-slot row has its only
//    entry as the candidate.
//  * Counter (default). Each fetch adds 1 to the slot's counter. When that would exceed
//    counter_max() = 2^counter_bits - 1, every counter of the row is first halved (>> 1), then
//    the 1 is added; so counters never saturate and keep their relative order. A newly inserted
//    entry starts at 0. Victim: the candidate with the smallest counter.
//  * Lru. An entry's recency is the latest of its insertion step and the steps it was fetched
//    at (a never-fetched entry counts as fetched when inserted). Victim: the candidate with the
//    smallest recency.
//  * Fifo. Victim: the oldest candidate (the oldest entry of the row); fetches are ignored.
//  * Ties go to the oldest entry (smallest insertion step, then smallest slot).
//
// What the paper and the reference code do, and where this differs: the paper increments a
// counter per prefetched entry, evicts the smallest count and halves all counters when any
// saturates; it says nothing about protecting recent entries. The reference code's counter is
// an unbounded fetch count, its candidates are the token positions below floor(i / 2) at
// position i (evicted positions included), and its LRU treats a never-fetched entry as fetched
// at step 0. Here candidates are counted over the entries the row holds, and a never-fetched
// entry is as recent as its insertion.
//
// Complexity per row of capacity c: on_fetch O(1), except O(c) when the row's counters are
// halved (at most once every 2^(counter_bits - 1) fetches of one slot); victim O(c);
// on_insert O(1) into an empty slot with an age key newer than every entry of the row (filling
// a row in order), O(c) otherwise (it re-ranks the row by age). Memory per slot: 8 bytes plus
// 2 (Counter) or 4 (Lru).
//
// Thread safety: calls on different rows may run concurrently; calls on one row may not.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

namespace infinigen {

enum class EvictionPolicy { Counter, Lru, Fifo };
inline constexpr EvictionPolicy kEvictionPolicies[] = {EvictionPolicy::Counter, EvictionPolicy::Lru,
                                                       EvictionPolicy::Fifo};
std::string_view eviction_policy_name(EvictionPolicy policy);  // "counter" | "lru" | "fifo"

class EvictionTable {
 public:
  // Every row starts empty. Errors: rows < 1, capacity < 1 or > 2^31 - 1, counter_bits outside
  // [1, 16] (checked for every policy, used by Counter only).
  EvictionTable(EvictionPolicy policy, int64_t rows, int64_t capacity, int counter_bits = 8);

  // Slot `slot` of row `row` now holds a token inserted at step `step` (its age); whatever the
  // slot held before is gone. The counter restarts at 0 and the recency at `step`.
  void on_insert(int64_t row, int64_t slot, int64_t step);
  // The occupied slot was fetched (selected by speculation) at `step`.
  void on_fetch(int64_t row, int64_t slot, int64_t step);
  // Seeds the history of a row's occupied slots, e.g. from a prompt's attention (the pool was
  // filled without decode steps): slot j was fetched fetches[j] times, the latest at step
  // last_fetch[j] (-1: never); fetches.size() <= capacity. Counter: the counters become
  // fetches[j] >> s, s the smallest shift that fits the row's largest count, as if the whole row
  // had been halved s times; Lru: recency max(insertion, last_fetch[j]); Fifo: nothing.
  void seed_row(int64_t row, const std::vector<int64_t>& fetches,
                const std::vector<int64_t>& last_fetch);
  // Empties row `row` (O(capacity)): e.g. before refilling it in age order, each on_insert O(1).
  void clear_row(int64_t row);
  // The slot to overwrite in the full row `row` at step `step` (the rules above rank by stored
  // steps only, so `step` is only range-checked). Error when the row is not full.
  int64_t victim(int64_t row, int64_t step) const;

  EvictionPolicy policy() const { return policy_; }
  // Keeps the rows of sequences `keep` (old indices, ascending) of `rows_per_sequence` rows each,
  // renumbered in that order (a batch that dropped its other sequences).
  void keep_sequences(const std::vector<int64_t>& keep, int64_t rows_per_sequence);

  int64_t rows() const { return rows_; }
  int64_t capacity() const { return capacity_; }
  int counter_bits() const { return counter_bits_; }
  int64_t counter_max() const { return counter_max_; }
  // Entries a full row offers as candidates: max(1, floor(capacity / 2)).
  int64_t num_candidates() const { return num_candidates_; }

  // Occupied slots of the row; full when it equals capacity().
  int64_t size(int64_t row) const;
  bool full(int64_t row) const { return size(row) == capacity_; }
  // Insertion step of the slot, -1 when empty.
  int64_t inserted_step(int64_t row, int64_t slot) const;
  // The slot's counter (Counter policy only, Error otherwise; 0 when empty).
  int64_t counter(int64_t row, int64_t slot) const;
  // The slot's recency (Lru policy only, Error otherwise; -1 when empty).
  int64_t last_use(int64_t row, int64_t slot) const;

 private:
  void check_row(int64_t row, const char* what) const;
  // The index of (row, slot) in the per-slot arrays, both checked; `what` names the caller.
  size_t slot_index(int64_t row, int64_t slot, const char* what) const;
  // An accessor of one policy's state (`what`) called on a table of another policy: an Error.
  void check_policy(EvictionPolicy needed, const char* what) const;
  void check_step(int64_t step, const char* what) const;
  // Removes the entry of an occupied slot: the row's younger entries move one rank down.
  void remove(int64_t row, int64_t slot);

  EvictionPolicy policy_;
  int64_t rows_ = 0;
  int64_t capacity_ = 0;
  int counter_bits_ = 8;
  int64_t counter_max_ = 0;
  int64_t num_candidates_ = 0;

  // Per slot (row * capacity + slot). Invariants for every row: step_ is -1 exactly for the
  // empty slots; the occupied slots' rank_ values are 0 .. size - 1, rank_ being the number of
  // occupied slots of the row with a smaller (step, slot) key; counter_ (Counter only) is
  // <= counter_max_ and 0 on empty slots; last_use_ (Lru only) is >= step_.
  std::vector<int32_t> step_;
  std::vector<int32_t> rank_;
  std::vector<uint16_t> counter_;
  std::vector<int32_t> last_use_;
  // Per row: occupied slots, and the slot with the largest age key (-1 when empty), which makes
  // inserting in age order O(1).
  std::vector<int32_t> size_;
  std::vector<int32_t> newest_;
};

}  // namespace infinigen
