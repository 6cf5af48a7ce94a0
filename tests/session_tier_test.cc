// tests: the host-memory tier of sessions (offload/session_tier.h): the eviction policy (Belady with
// look-ahead, LRU without), the budget never exceeded, a session too large bypassing, and
// --session-cache's text.
#include "offload/session_tier.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <string>
#include <vector>

namespace infinigen {
namespace {

SessionTier::Entry entry_of(uint64_t bytes) {
  SessionTier::Entry entry;
  entry.bytes = bytes;
  return entry;
}

TEST(SessionTierPolicy, LookAheadEvictsTheFurthestNextUseAndLruWithout) {
  const std::vector<TierCandidate> candidates = {
      {/*next_use=*/5, /*last_use=*/1}, {9, 3}, {2, 2}, {9, 2}};
  // Furthest next use (9), ties to the least recently used (last use 2: index 3).
  EXPECT_EQ(choose_victim(candidates, true), 3u);
  // Without look-ahead: the least recently used.
  EXPECT_EQ(choose_victim(candidates, false), 0u);
  // A session never used again goes first.
  EXPECT_EQ(choose_victim({{4, 0}, {kNeverUsedAgain, 9}, {7, 1}}, true), 1u);
}

TEST(SessionTier, EvictsInLookAheadOrder) {
  // The job's order: a b c c a b; at position 2 (c's turn) the tier holds a and b and must make
  // room for c, used next at 3: b is used at 5, a at 4, so b goes.
  const std::vector<std::string> order = {"a", "b", "c", "c", "a", "b"};
  size_t position = 0;
  SessionTier tier(200);
  tier.set_next_use([&](const std::string& name) {
    for (size_t i = position + 1; i < order.size(); ++i) {
      if (order[i] == name) return static_cast<int64_t>(i);
    }
    return kNeverUsedAgain;
  });
  ASSERT_TRUE(tier.put("a", entry_of(100)));
  position = 1;
  ASSERT_TRUE(tier.put("b", entry_of(100)));
  position = 2;
  ASSERT_TRUE(tier.put("c", entry_of(100)));
  EXPECT_EQ(tier.residents(), (std::vector<std::string>{"a", "c"}));
  EXPECT_EQ(tier.stats().evictions, 1);
  // With LRU the least recently used (a) would have gone.
  SessionTier lru(200);
  ASSERT_TRUE(lru.put("a", entry_of(100)));
  ASSERT_TRUE(lru.put("b", entry_of(100)));
  ASSERT_TRUE(lru.put("c", entry_of(100)));
  EXPECT_EQ(lru.residents(), (std::vector<std::string>{"b", "c"}));
}

TEST(SessionTier, LookAheadBypassesASessionNeededLaterThanEveryResident) {
  size_t position = 0;
  const std::vector<std::string> order = {"x", "a", "b", "a", "b", "x"};
  SessionTier tier(200);
  tier.set_next_use([&](const std::string& name) {
    for (size_t i = position + 1; i < order.size(); ++i) {
      if (order[i] == name) return static_cast<int64_t>(i);
    }
    return kNeverUsedAgain;
  });
  position = 2;
  ASSERT_TRUE(tier.put("a", entry_of(100)));
  ASSERT_TRUE(tier.put("b", entry_of(100)));
  // x comes back last (5), after a (3) and b (4): nothing is evicted for it.
  EXPECT_FALSE(tier.put("x", entry_of(100)));
  EXPECT_EQ(tier.residents(), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(tier.stats().bypassed, 1);
}

TEST(SessionTier, BudgetNeverExceededAndTooLargeBypasses) {
  std::mt19937 rng(31);
  for (bool look_ahead : {false, true}) {
    SessionTier tier(1000);
    if (look_ahead) {
      tier.set_next_use([](const std::string& name) { return static_cast<int64_t>(name.size()); });
    }
    for (int i = 0; i < 2000; ++i) {
      const std::string name(1 + rng() % 12, 's');
      const uint64_t bytes = 1 + rng() % 600;
      const bool admitted = tier.put(name + std::to_string(rng() % 5), entry_of(bytes));
      ASSERT_LE(tier.bytes(), tier.budget());
      if (bytes > tier.budget()) {
        ASSERT_FALSE(admitted);
      }
    }
    EXPECT_LE(tier.stats().peak_bytes, 1000u);
    EXPECT_GT(tier.stats().evictions, 0);
  }
  SessionTier tier(100);
  ASSERT_TRUE(tier.put("a", entry_of(60)));
  // Too large: bypasses, and its older entry (no longer what the disk holds) goes too.
  EXPECT_FALSE(tier.put("a", entry_of(101)));
  EXPECT_FALSE(tier.holds("a"));
  EXPECT_EQ(tier.bytes(), 0u);
  EXPECT_EQ(tier.find("a"), nullptr);
  EXPECT_EQ(tier.stats().misses, 1);
}

TEST(SessionTier, CacheSizeText) {
  EXPECT_EQ(parse_session_cache("512M"), std::optional<uint64_t>(512ull << 20));
  EXPECT_EQ(parse_session_cache("0"), std::optional<uint64_t>(0));
  ASSERT_TRUE(parse_session_cache("10%").has_value());
  EXPECT_GT(*parse_session_cache("10%"), 0u);
  EXPECT_LT(*parse_session_cache("10%"), *parse_session_cache("20%"));
  for (const char* bad : {"", "%", "ten", "-5%", "101%", "12Q", "5%%"}) {
    EXPECT_FALSE(parse_session_cache(bad).has_value()) << bad;
  }
}

}  // namespace
}  // namespace infinigen
