// tests: victim choice of the KV pool memory limit (counter, LRU, FIFO): hand-worked examples,
// counter halving, protected newest half, ties, independent rows, a randomized comparison with a
// naive model, and argument errors.
#include "speculate/eviction.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "core/error.h"
#include "tests/test_util.h"

namespace infinigen {
namespace {

void expect_error(const std::function<void()>& call, const std::string& needle) {
  testing_util::expect_error(call, {needle});
}

// Fills every slot of `row`, slot s inserted at steps[s].
void fill(EvictionTable& table, int64_t row, const std::vector<int64_t>& steps) {
  ASSERT_EQ(static_cast<int64_t>(steps.size()), table.capacity());
  for (size_t s = 0; s < steps.size(); ++s) table.on_insert(row, static_cast<int64_t>(s), steps[s]);
}

void fetch_times(EvictionTable& table, int64_t row, int64_t slot, int times, int64_t step) {
  for (int i = 0; i < times; ++i) table.on_fetch(row, slot, step);
}

TEST(EvictionTableTest, CandidatesAreTheOlderHalf) {
  EXPECT_EQ(EvictionTable(EvictionPolicy::Counter, 1, 1).num_candidates(), 1);
  EXPECT_EQ(EvictionTable(EvictionPolicy::Counter, 1, 2).num_candidates(), 1);
  EXPECT_EQ(EvictionTable(EvictionPolicy::Counter, 1, 3).num_candidates(), 1);
  EXPECT_EQ(EvictionTable(EvictionPolicy::Counter, 1, 4).num_candidates(), 2);
  EXPECT_EQ(EvictionTable(EvictionPolicy::Counter, 1, 5).num_candidates(), 2);
  EXPECT_EQ(EvictionTable(EvictionPolicy::Counter, 1, 8).num_candidates(), 4);
}

// Capacity 4, slot s inserted at step 10 + s: candidates are slots 0 and 1.
TEST(EvictionTableTest, CounterCapacity4) {
  EvictionTable table(EvictionPolicy::Counter, 1, 4);
  fill(table, 0, {10, 11, 12, 13});
  EXPECT_EQ(table.victim(0, 14), 0);  // all zero: the oldest
  fetch_times(table, 0, 0, 2, 14);
  fetch_times(table, 0, 1, 1, 14);
  // Slots 2 and 3 have counter 0 but are the protected newest half.
  EXPECT_EQ(table.victim(0, 14), 1);
  fetch_times(table, 0, 1, 2, 14);  // slot 1 at 3, slot 0 at 2
  EXPECT_EQ(table.victim(0, 14), 0);
  // Overwrite slot 0: ages are now 1 (11), 2 (12), 3 (13), 0 (14); candidates slots 1 and 2.
  table.on_insert(0, 0, 14);
  EXPECT_EQ(table.counter(0, 0), 0);
  EXPECT_EQ(table.counter(0, 1), 3);
  EXPECT_EQ(table.victim(0, 15), 2);
  fetch_times(table, 0, 2, 3, 15);  // tie 3 / 3: the older, slot 1
  EXPECT_EQ(table.victim(0, 15), 1);
}

// Capacity 5, inserted out of slot order: ages are slot 3 (0), 1 (1), 4 (2), 0 (3), 2 (4);
// candidates are the two oldest, slots 3 and 1.
TEST(EvictionTableTest, CounterCapacity5) {
  EvictionTable table(EvictionPolicy::Counter, 1, 5);
  table.on_insert(0, 3, 0);
  table.on_insert(0, 1, 1);
  table.on_insert(0, 4, 2);
  table.on_insert(0, 0, 3);
  table.on_insert(0, 2, 4);
  EXPECT_TRUE(table.full(0));
  EXPECT_EQ(table.victim(0, 5), 3);
  table.on_fetch(0, 3, 5);
  EXPECT_EQ(table.victim(0, 5), 1);
  fetch_times(table, 0, 1, 2, 5);
  EXPECT_EQ(table.victim(0, 5), 3);
  // Slots 4, 0 and 2 stay at 0 and are never chosen.
  EXPECT_EQ(table.counter(0, 4), 0);
  EXPECT_EQ(table.counter(0, 0), 0);
}

// Capacity 8, slot s inserted at step s: candidates are slots 0..3.
TEST(EvictionTableTest, LruCapacity8PrefersNeverFetchedOldEntries) {
  EvictionTable table(EvictionPolicy::Lru, 1, 8);
  fill(table, 0, {0, 1, 2, 3, 4, 5, 6, 7});
  EXPECT_EQ(table.victim(0, 8), 0);
  table.on_fetch(0, 0, 8);
  table.on_fetch(0, 2, 9);
  table.on_fetch(0, 1, 10);
  // Slot 3 was never fetched: its recency is its insertion step 3, older than 8, 9 and 10.
  EXPECT_EQ(table.last_use(0, 3), 3);
  EXPECT_EQ(table.victim(0, 11), 3);
  table.on_fetch(0, 3, 11);
  EXPECT_EQ(table.victim(0, 11), 0);
  table.on_fetch(0, 0, 12);
  EXPECT_EQ(table.victim(0, 12), 2);
  // An older fetch step does not make an entry less recent.
  table.on_fetch(0, 2, 1);
  EXPECT_EQ(table.last_use(0, 2), 9);
  EXPECT_EQ(table.victim(0, 12), 2);
  // Overwrite slot 2 at step 12: candidates are now slots 0, 1, 3 and 4 (ages 0, 1, 3, 4);
  // slot 4 was never fetched and is as recent as step 4.
  table.on_insert(0, 2, 12);
  EXPECT_EQ(table.last_use(0, 2), 12);
  EXPECT_EQ(table.victim(0, 13), 4);
}

TEST(EvictionTableTest, LruTiesGoToTheOldest) {
  EvictionTable table(EvictionPolicy::Lru, 1, 4);
  fill(table, 0, {5, 5, 5, 5});  // equal steps: age by slot
  EXPECT_EQ(table.victim(0, 6), 0);
  table.on_fetch(0, 0, 7);
  table.on_fetch(0, 1, 7);
  EXPECT_EQ(table.victim(0, 8), 0);  // both fetched at 7: slot 0 is older
}

TEST(EvictionTableTest, FifoIgnoresFetches) {
  EvictionTable table(EvictionPolicy::Fifo, 1, 4);
  fill(table, 0, {3, 1, 2, 0});  // ages: slot 3, 1, 2, 0
  fetch_times(table, 0, 3, 10, 4);
  // Each victim is overwritten by the newest entry, so the victims go round in age order.
  int64_t step = 4;
  for (int64_t oldest : {3, 1, 2, 0, 3}) {
    EXPECT_EQ(table.victim(0, step), oldest) << "step " << step;
    table.on_insert(0, oldest, step++);
  }
}

TEST(EvictionTableTest, NewestHalfIsNeverChosen) {
  for (EvictionPolicy policy :
       {EvictionPolicy::Counter, EvictionPolicy::Lru, EvictionPolicy::Fifo}) {
    EvictionTable table(policy, 1, 8);
    fill(table, 0, {0, 1, 2, 3, 4, 5, 6, 7});
    // Make the older half as attractive to keep as possible.
    for (int64_t slot = 0; slot < 4; ++slot) fetch_times(table, 0, slot, 200, 100 + slot);
    int64_t step = 200;
    for (int round = 0; round < 20; ++round, ++step) {
      const int64_t v = table.victim(0, step);
      // The newest 4 entries by insertion step are protected.
      std::vector<int64_t> ages;
      for (int64_t s = 0; s < 8; ++s) ages.push_back(table.inserted_step(0, s));
      std::vector<int64_t> sorted = ages;
      std::sort(sorted.begin(), sorted.end());
      EXPECT_LT(table.inserted_step(0, v), sorted[4]) << eviction_policy_name(policy);
      table.on_insert(0, v, step);
    }
  }
}

// counter_bits 2: the maximum is 3, and the 4th fetch of a slot halves the whole row first.
TEST(EvictionTableTest, CounterSaturationHalvesTheRow) {
  EvictionTable table(EvictionPolicy::Counter, 1, 4, 2);
  EXPECT_EQ(table.counter_max(), 3);
  fill(table, 0, {0, 1, 2, 3});
  table.on_fetch(0, 0, 4);  // slot 0 at 1, slot 1 at 0
  EXPECT_EQ(table.victim(0, 4), 1);
  fetch_times(table, 0, 2, 3, 4);  // the protected slot 2 reaches the maximum
  EXPECT_EQ(table.counter(0, 2), 3);
  EXPECT_EQ(table.counter(0, 0), 1);
  EXPECT_EQ(table.victim(0, 4), 1);
  table.on_fetch(0, 2, 5);  // 4th fetch: halve (3 -> 1, 1 -> 0), then + 1
  EXPECT_EQ(table.counter(0, 2), 2);
  EXPECT_EQ(table.counter(0, 0), 0);
  EXPECT_EQ(table.counter(0, 1), 0);
  // Slots 0 and 1 now tie at 0: the older, slot 0, where without halving it would be slot 1.
  EXPECT_EQ(table.victim(0, 5), 0);

  EvictionTable wide(EvictionPolicy::Counter, 1, 4, 8);
  fill(wide, 0, {0, 1, 2, 3});
  wide.on_fetch(0, 0, 4);
  fetch_times(wide, 0, 2, 4, 4);
  EXPECT_EQ(wide.counter(0, 2), 4);
  EXPECT_EQ(wide.victim(0, 5), 1);
}

TEST(EvictionTableTest, CounterRepeatedSaturationStaysBounded) {
  EvictionTable table(EvictionPolicy::Counter, 1, 2, 1);  // maximum 1
  fill(table, 0, {0, 1});
  table.on_fetch(0, 0, 2);
  EXPECT_EQ(table.counter(0, 0), 1);
  table.on_fetch(0, 0, 2);  // 1 -> 0, + 1
  EXPECT_EQ(table.counter(0, 0), 1);
  EvictionTable big(EvictionPolicy::Counter, 1, 2, 16);
  fill(big, 0, {0, 1});
  fetch_times(big, 0, 1, 65535, 2);
  EXPECT_EQ(big.counter(0, 1), 65535);
  big.on_fetch(0, 1, 3);
  EXPECT_EQ(big.counter(0, 1), 32768);
}

TEST(EvictionTableTest, InsertResetsCounter) {
  EvictionTable table(EvictionPolicy::Counter, 1, 2);
  fill(table, 0, {0, 1});
  fetch_times(table, 0, 0, 9, 2);
  EXPECT_EQ(table.victim(0, 2), 0);  // the only candidate of capacity 2
  table.on_insert(0, 0, 2);
  EXPECT_EQ(table.counter(0, 0), 0);
  EXPECT_EQ(table.inserted_step(0, 0), 2);
  EXPECT_EQ(table.victim(0, 3), 1);
}

TEST(EvictionTableTest, CapacityOneEvictsItsOnlyEntry) {
  for (EvictionPolicy policy :
       {EvictionPolicy::Counter, EvictionPolicy::Lru, EvictionPolicy::Fifo}) {
    EvictionTable table(policy, 2, 1);
    table.on_insert(1, 0, 0);
    table.on_fetch(1, 0, 1);
    EXPECT_EQ(table.victim(1, 1), 0);
    table.on_insert(1, 0, 1);
    EXPECT_EQ(table.size(1), 1);
    EXPECT_EQ(table.size(0), 0);
  }
}

TEST(EvictionTableTest, RowsAreIndependent) {
  EvictionTable table(EvictionPolicy::Counter, 3, 4, 2);
  for (int64_t row = 0; row < 3; ++row) fill(table, row, {0, 1, 2, 3});
  table.on_fetch(0, 0, 4);
  table.on_fetch(1, 1, 4);
  table.on_fetch(2, 0, 4);
  table.on_fetch(2, 1, 4);
  table.on_fetch(2, 1, 4);
  EXPECT_EQ(table.victim(0, 4), 1);
  EXPECT_EQ(table.victim(1, 4), 0);
  EXPECT_EQ(table.victim(2, 4), 0);
  // Halving row 2 leaves rows 0 and 1 alone.
  fetch_times(table, 2, 3, 4, 5);
  EXPECT_EQ(table.counter(2, 1), 1);
  EXPECT_EQ(table.counter(0, 0), 1);
  EXPECT_EQ(table.counter(1, 1), 1);
  // Overwriting in row 1 does not age row 0.
  table.on_insert(1, 0, 5);
  EXPECT_EQ(table.victim(1, 6), 2);
  EXPECT_EQ(table.victim(0, 6), 1);
  EXPECT_EQ(table.inserted_step(0, 0), 0);
  EXPECT_EQ(table.size(1), 4);
}

TEST(EvictionTableTest, RejectsBadArguments) {
  expect_error([] { EvictionTable(EvictionPolicy::Counter, 0, 4); }, "rows");
  expect_error([] { EvictionTable(EvictionPolicy::Counter, 1, 0); }, "capacity");
  expect_error([] { EvictionTable(EvictionPolicy::Lru, 1, -3); }, "capacity");
  expect_error([] { EvictionTable(EvictionPolicy::Counter, 1, 4, 0); }, "counter_bits");
  expect_error([] { EvictionTable(EvictionPolicy::Counter, 1, 4, 17); }, "counter_bits");
  expect_error([] { EvictionTable(EvictionPolicy::Fifo, 1, 4, 17); }, "counter_bits");

  EvictionTable table(EvictionPolicy::Counter, 2, 4);
  expect_error([&] { table.on_insert(-1, 0, 0); }, "row -1");
  expect_error([&] { table.on_insert(2, 0, 0); }, "row 2");
  expect_error([&] { table.on_insert(0, 4, 0); }, "slot 4");
  expect_error([&] { table.on_insert(0, -1, 0); }, "slot -1");
  expect_error([&] { table.on_insert(0, 0, -1); }, "step -1");
  expect_error([&] { table.on_insert(0, 0, int64_t{1} << 31); }, "step");
  expect_error([&] { table.on_fetch(0, 0, 0); }, "empty");
  expect_error([&] { table.on_fetch(0, 5, 0); }, "slot 5");
  expect_error([&] { table.on_fetch(3, 0, 0); }, "row 3");
  table.on_insert(0, 0, 0);
  expect_error([&] { table.victim(0, 1); }, "holds 1 of 4");
  expect_error([&] { table.victim(2, 1); }, "row 2");
  expect_error([&] { table.last_use(0, 0); }, "lru");
  EvictionTable lru(EvictionPolicy::Lru, 1, 4);
  expect_error([&] { lru.counter(0, 0); }, "counter");
  expect_error([&] { lru.inserted_step(0, 9); }, "slot 9");
}

// A naive model of one row: plain structs, a full sort for the age ranking.
class NaiveRow {
 public:
  NaiveRow(EvictionPolicy policy, int64_t capacity, int64_t counter_max)
      : policy_(policy), counter_max_(counter_max), entries_(static_cast<size_t>(capacity)) {}

  void insert(int64_t slot, int64_t step) {
    entries_[static_cast<size_t>(slot)] = Entry{true, step, 0, step};
  }

  void fetch(int64_t slot, int64_t step) {
    Entry& e = entries_[static_cast<size_t>(slot)];
    if (e.counter + 1 > counter_max_) {
      for (Entry& other : entries_) other.counter /= 2;
    }
    e.counter += 1;
    e.last = std::max(e.last, step);
  }

  int64_t victim() const {
    std::vector<int64_t> order;
    for (size_t s = 0; s < entries_.size(); ++s) {
      if (entries_[s].occupied) order.push_back(static_cast<int64_t>(s));
    }
    auto age = [&](int64_t s) { return std::make_tuple(entries_[static_cast<size_t>(s)].step, s); };
    std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return age(a) < age(b); });
    const int64_t capacity = static_cast<int64_t>(entries_.size());
    const int64_t candidates = capacity == 1 ? 1 : capacity / 2;
    int64_t best = -1;
    for (int64_t i = 0; i < candidates; ++i) {
      const int64_t s = order[static_cast<size_t>(i)];
      if (best < 0 || key(s) < key(best)) best = s;  // `order` is oldest first: ties keep it
    }
    return best;
  }

  int64_t counter(int64_t slot) const { return entries_[static_cast<size_t>(slot)].counter; }
  int64_t last(int64_t slot) const { return entries_[static_cast<size_t>(slot)].last; }
  int64_t step(int64_t slot) const {
    const Entry& e = entries_[static_cast<size_t>(slot)];
    return e.occupied ? e.step : -1;
  }

 private:
  struct Entry {
    bool occupied = false;
    int64_t step = -1;
    int64_t counter = 0;
    int64_t last = -1;
  };

  int64_t key(int64_t s) const {
    const Entry& e = entries_[static_cast<size_t>(s)];
    switch (policy_) {
      case EvictionPolicy::Counter:
        return e.counter;
      case EvictionPolicy::Lru:
        return e.last;
      case EvictionPolicy::Fifo:
        return 0;
    }
    return 0;
  }

  EvictionPolicy policy_;
  int64_t counter_max_;
  std::vector<Entry> entries_;
};

struct SimConfig {
  EvictionPolicy policy;
  int64_t capacity;
  int counter_bits;
};

void simulate(const SimConfig& config, uint32_t seed) {
  SCOPED_TRACE(std::string(eviction_policy_name(config.policy)) + " capacity " +
               std::to_string(config.capacity) + " bits " + std::to_string(config.counter_bits) +
               " seed " + std::to_string(seed));
  constexpr int64_t kRows = 3;
  constexpr int64_t kSteps = 3000;
  const int64_t c = config.capacity;
  EvictionTable table(config.policy, kRows, c, config.counter_bits);
  std::vector<NaiveRow> model(kRows, NaiveRow(config.policy, c, table.counter_max()));
  std::mt19937 rng(seed);
  auto uniform = [&](int64_t n) {
    return static_cast<int64_t>(std::uniform_int_distribution<int64_t>(0, n - 1)(rng));
  };

  auto compare_state = [&](int64_t row) {
    for (int64_t s = 0; s < c; ++s) {
      ASSERT_EQ(table.inserted_step(row, s), model[row].step(s)) << "row " << row << " slot " << s;
      if (model[row].step(s) < 0) continue;
      if (config.policy == EvictionPolicy::Counter) {
        ASSERT_EQ(table.counter(row, s), model[row].counter(s)) << "row " << row << " slot " << s;
      }
      if (config.policy == EvictionPolicy::Lru) {
        ASSERT_EQ(table.last_use(row, s), model[row].last(s)) << "row " << row << " slot " << s;
      }
    }
  };

  // Prefill: slots in a random order, steps drawn from a small range so that equal steps
  // (ties by slot) and out-of-order ages both occur.
  for (int64_t row = 0; row < kRows; ++row) {
    std::vector<int64_t> slots(static_cast<size_t>(c));
    for (int64_t s = 0; s < c; ++s) slots[static_cast<size_t>(s)] = s;
    std::shuffle(slots.begin(), slots.end(), rng);
    for (int64_t s : slots) {
      const int64_t step = uniform(row == 0 ? c : 8);
      table.on_insert(row, s, step);
      model[row].insert(s, step);
    }
    ASSERT_EQ(table.size(row), c);
    compare_state(row);
  }

  int64_t victim_overwrites = 0;
  for (int64_t step = 100; step < 100 + kSteps; ++step) {
    for (int64_t row = 0; row < kRows; ++row) {
      // Fetches: a skewed choice of slots so that some are hot and counters saturate.
      const int64_t fetches = uniform(c + 1);
      for (int64_t f = 0; f < fetches; ++f) {
        const int64_t a = uniform(c);
        const int64_t slot = (a * a) / c;
        const int64_t fetch_step = uniform(10) == 0 ? step - uniform(100) : step;
        table.on_fetch(row, slot, fetch_step);
        model[row].fetch(slot, fetch_step);
      }
      const int64_t expected = model[row].victim();
      const int64_t got = table.victim(row, step);
      ASSERT_EQ(got, expected) << "row " << row << " step " << step;
      // Mostly the runtime's pattern (overwrite the victim now); sometimes an arbitrary slot
      // with an older step, which re-ranks the row by age.
      if (uniform(8) != 0) {
        table.on_insert(row, got, step);
        model[row].insert(got, step);
        ++victim_overwrites;
      } else {
        const int64_t slot = uniform(c);
        const int64_t old_step = std::max<int64_t>(0, step - uniform(200));
        table.on_insert(row, slot, old_step);
        model[row].insert(slot, old_step);
      }
      if (step % 97 == 0) compare_state(row);
    }
  }
  for (int64_t row = 0; row < kRows; ++row) compare_state(row);
  EXPECT_GT(victim_overwrites, kSteps * kRows / 2);
}

TEST(EvictionTableTest, RandomizedAgainstNaiveModel) {
  uint32_t seed = 1234;
  for (EvictionPolicy policy :
       {EvictionPolicy::Counter, EvictionPolicy::Lru, EvictionPolicy::Fifo}) {
    for (int64_t capacity : {1, 2, 3, 4, 5, 8, 13, 32}) {
      for (int bits : {1, 2, 3, 8}) {
        if (policy != EvictionPolicy::Counter && bits != 8) continue;
        simulate(SimConfig{policy, capacity, bits}, seed++);
        if (::testing::Test::HasFatalFailure()) return;
      }
    }
  }
}

}  // namespace
}  // namespace infinigen
