// tests: host memory pinned ahead on a background thread (core/pin_ahead.h) and handed out by
// pinned_alloc.
#include "core/pin_ahead.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <set>
#include <string>
#include <vector>

#include "core/device.h"

namespace infinigen {
namespace {

constexpr size_t kBytes = size_t{3} << 20;

TEST(PinAhead, PinnedAllocOfItsSizeTakesItsBuffersThenPinsAsBefore) {
  const size_t before = pinned_bytes_in_use();
  {
    const AllocationCounts start = allocation_counts();
    PinAhead ahead(4, kBytes);
    std::vector<void*> buffers;
    for (int i = 0; i < 4; ++i) buffers.push_back(pinned_alloc(kBytes, "a test buffer"));
    EXPECT_EQ(ahead.taken(), 4u);
    // Pinned (and counted) once, by the thread, not again by these calls.
    EXPECT_EQ(allocation_counts().since(start).pinned_allocs, 4u);
    EXPECT_EQ(std::set<void*>(buffers.begin(), buffers.end()).size(), 4u);
    for (void* buffer : buffers) static_cast<char*>(buffer)[kBytes - 1] = 1;  // usable
    // A fifth, and another size: pinned by the call itself.
    void* fifth = pinned_alloc(kBytes, "a test buffer");
    void* other = pinned_alloc(kBytes / 2, "a test buffer");
    EXPECT_EQ(ahead.taken(), 4u);
    EXPECT_EQ(allocation_counts().since(start).pinned_allocs, 6u);
    pinned_free(fifth);
    pinned_free(other);
    for (void* buffer : buffers) pinned_free(buffer);
  }
  EXPECT_EQ(pinned_bytes_in_use(), before);
}

TEST(PinAhead, WhatNobodyTookIsFreedAndASecondOneWaitsItsTurn) {
  const size_t before = pinned_bytes_in_use();
  {
    PinAhead first(3, kBytes);
    PinAhead second(3, kBytes / 4);  // inactive while the first is
    EXPECT_EQ(second.take(kBytes / 4), nullptr);
    void* buffer = pinned_alloc(kBytes, "a test buffer");
    EXPECT_EQ(first.taken(), 1u);
    pinned_free(buffer);
  }
  EXPECT_EQ(pinned_bytes_in_use(), before);
  PinAhead third(1, kBytes / 4);  // the first has gone: this one is active
  void* buffer = pinned_alloc(kBytes / 4, "a test buffer");
  EXPECT_EQ(third.taken(), 1u);
  pinned_free(buffer);
}

// In a process of its own: INFINIGEN_PINNED_LIMIT is read once per process.
void pin_beyond_the_limit() {
  setenv("INFINIGEN_PINNED_LIMIT", "8M", 1);
  PinAhead ahead(4, kBytes);  // 12 MiB: the thread pins two, then fails
  void* a = pinned_alloc(kBytes, "a test buffer");
  void* b = pinned_alloc(kBytes, "a test buffer");
  bool refused = false;
  try {
    pinned_alloc(kBytes, "the third test buffer");
  } catch (const PinnedAllocationError& e) {
    refused = std::string(e.what()).find("the third test buffer") != std::string::npos;
  }
  pinned_free(a);
  pinned_free(b);
  std::exit(refused && ahead.taken() == 2 ? 0 : 1);
}

TEST(PinAhead, WhenPinningFailsTheCallerPinsAndGetsItsOwnError) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(pin_beyond_the_limit(), ::testing::ExitedWithCode(0), "");
}

}  // namespace
}  // namespace infinigen
