// tests: Stream and Event (FIFO order, cross-stream waits, inline mode, failures, busy time).
#include "core/stream.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <future>
#include <stdexcept>
#include <thread>
#include <utility>
#include <vector>

#include "core/error.h"

namespace infinigen {
namespace {

using namespace std::chrono_literals;

// Blocks a task until the test opens it, so a test controls exactly what is still queued.
class Gate {
 public:
  void open() { promise_.set_value(); }
  void pass() const { future_.wait(); }

 private:
  std::promise<void> promise_;
  std::shared_future<void> future_ = promise_.get_future().share();
};

TEST(Stream, RunsTasksInEnqueueOrder) {
  Stream stream("fifo");
  std::vector<int> order;  // touched only by the worker until synchronize()
  for (int i = 0; i < 10000; ++i) stream.enqueue([&order, i] { order.push_back(i); });
  stream.synchronize();
  ASSERT_EQ(order.size(), 10000u);
  for (int i = 0; i < 10000; ++i) ASSERT_EQ(order[i], i);
}

TEST(Stream, KeepsEachProducersOrderUnderConcurrentEnqueue) {
  Stream stream("producers");
  constexpr int kProducers = 4;
  constexpr int kTasks = 2000;
  std::vector<std::pair<int, int>> order;
  std::vector<std::thread> producers;
  for (int p = 0; p < kProducers; ++p) {
    producers.emplace_back([&stream, &order, p] {
      for (int i = 0; i < kTasks; ++i) stream.enqueue([&order, p, i] { order.emplace_back(p, i); });
    });
  }
  for (std::thread& t : producers) t.join();
  stream.synchronize();
  ASSERT_EQ(order.size(), static_cast<size_t>(kProducers * kTasks));
  std::vector<int> next(kProducers, 0);
  for (const auto& [p, i] : order) {
    ASSERT_EQ(i, next[p]) << "producer " << p << " out of order";
    ++next[p];
  }
}

TEST(Stream, RecordCompletesAfterEarlierTasks) {
  Stream stream("record");
  Gate gate;
  std::atomic<bool> ran{false};
  stream.enqueue([&] {
    gate.pass();
    ran = true;
  });
  EventPtr event = stream.record();
  std::this_thread::sleep_for(20ms);
  EXPECT_FALSE(event->ready());
  EXPECT_EQ(event->completed_at(), 0.0);
  gate.open();
  event->wait();
  EXPECT_TRUE(ran);
  EXPECT_TRUE(event->ready());
  EXPECT_GT(event->completed_at(), 0.0);
}

TEST(Stream, WaitOrdersAnotherStreamWithoutBlockingTheHost) {
  Stream a("a");
  Stream b("b");
  Gate gate;
  int value = 0;  // written by a, read by b: only the event orders them
  std::atomic<int> observed{-1};
  a.enqueue([&] {
    gate.pass();
    value = 42;
  });
  EventPtr written = a.record();
  // Both calls return while a is still blocked: wait() orders b, it does not block the host.
  b.wait(written);
  b.enqueue([&] { observed = value; });
  std::this_thread::sleep_for(20ms);
  EXPECT_EQ(observed, -1) << "b ran before the event it waits on";
  gate.open();
  b.synchronize();
  EXPECT_EQ(observed, 42);
  EXPECT_TRUE(written->ready());
}

TEST(Stream, WaitOnNullOrCompletedEventDoesNothing) {
  Stream stream("noop");
  std::atomic<int> ran{0};
  stream.wait(nullptr);
  stream.wait(completed_event());
  stream.enqueue([&] { ++ran; });
  stream.synchronize();
  EXPECT_EQ(ran, 1);
}

TEST(Stream, CompletedEventIsSharedAndReady) {
  EventPtr a = completed_event();
  EXPECT_EQ(a, completed_event());
  EXPECT_TRUE(a->ready());
  EXPECT_NO_THROW(a->wait());
  EXPECT_GT(a->completed_at(), 0.0);
}

TEST(Event, FirstCompletionWins) {
  Event event;
  EXPECT_FALSE(event.ready());
  event.complete();
  event.complete(std::make_exception_ptr(Error("late")));
  EXPECT_NO_THROW(event.wait());
}

TEST(Stream, InlineRunsOnTheCallerImmediately) {
  Stream stream("inline", Stream::Mode::Inline);
  std::thread::id ran_on;
  int value = 0;
  stream.enqueue([&] {
    ran_on = std::this_thread::get_id();
    value = 7;
  });
  EXPECT_EQ(value, 7);
  EXPECT_EQ(ran_on, std::this_thread::get_id());
  EventPtr event = stream.record();
  EXPECT_TRUE(event->ready());
  EXPECT_NO_THROW(stream.synchronize());
}

TEST(Stream, InlineWaitBlocksTheCaller) {
  Stream worker("worker");
  Stream inline_stream("inline", Stream::Mode::Inline);
  std::atomic<bool> written{false};
  worker.enqueue([&] {
    std::this_thread::sleep_for(50ms);
    written = true;
  });
  EventPtr event = worker.record();
  inline_stream.wait(event);
  EXPECT_TRUE(event->ready());
  EXPECT_TRUE(written);
  bool saw_write = false;
  inline_stream.enqueue([&] { saw_write = written; });
  EXPECT_TRUE(saw_write);
}

TEST(Stream, InlineFailureIsKeptForSynchronize) {
  Stream stream("inline", Stream::Mode::Inline);
  bool later_ran = false;
  EXPECT_NO_THROW(stream.enqueue([] { fail("inline boom"); }));
  stream.enqueue([&] { later_ran = true; });
  EXPECT_FALSE(later_ran);
  EventPtr event = stream.record();
  EXPECT_TRUE(event->ready());
  EXPECT_THROW(event->wait(), Error);
  EXPECT_THROW(stream.synchronize(), Error);
}

TEST(Stream, FailureSkipsLaterTasksAndIsRethrown) {
  Stream stream("failing");
  std::atomic<bool> first_ran{false};
  std::atomic<bool> later_ran{false};
  stream.enqueue([&] { first_ran = true; });
  EventPtr before = stream.record();
  stream.enqueue([] { fail("task exploded"); });
  stream.enqueue([&] { later_ran = true; });
  EventPtr after = stream.record();

  try {
    stream.synchronize();
    ADD_FAILURE() << "synchronize() did not rethrow the task failure";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "task exploded");
  }
  EXPECT_TRUE(first_ran);
  EXPECT_FALSE(later_ran);
  EXPECT_NO_THROW(before->wait());  // recorded before the failure
  EXPECT_THROW(after->wait(), Error);

  // The stream stays poisoned: new tasks are skipped and every synchronize() rethrows.
  stream.enqueue([&] { later_ran = true; });
  EXPECT_THROW(stream.synchronize(), Error);
  EXPECT_THROW(stream.record()->wait(), Error);
  EXPECT_FALSE(later_ran);
}

TEST(Stream, FailureKeepsItsOriginalType) {
  Stream stream("typed");
  stream.enqueue([] { throw std::out_of_range("index 9"); });
  EXPECT_THROW(stream.synchronize(), std::out_of_range);
}

TEST(Stream, WaitCarriesAFailureIntoTheWaitingStream) {
  Stream a("a");
  Stream b("b");
  std::atomic<bool> b_ran{false};
  a.enqueue([] { fail("upstream failed"); });
  b.wait(a.record());
  b.enqueue([&] { b_ran = true; });
  EventPtr b_event = b.record();
  EXPECT_THROW(b_event->wait(), Error);
  EXPECT_THROW(b.synchronize(), Error);
  EXPECT_FALSE(b_ran);
}

TEST(Stream, SynchronizeFromItsOwnTaskThrowsInsteadOfDeadlocking) {
  Stream stream("self");
  std::atomic<bool> caught{false};
  stream.enqueue([&] {
    try {
      stream.synchronize();
    } catch (const Error&) {
      caught = true;
    }
  });
  stream.synchronize();
  EXPECT_TRUE(caught);
}

TEST(Stream, DestructorRunsEverythingQueued) {
  std::atomic<int> ran{0};
  Gate gate;
  std::thread opener;
  {
    Stream stream("drain");
    stream.enqueue([&] { gate.pass(); });
    for (int i = 0; i < 100; ++i) stream.enqueue([&] { ++ran; });
    EXPECT_EQ(ran, 0);
    opener = std::thread([&] {
      std::this_thread::sleep_for(20ms);
      gate.open();
    });
  }  // the destructor must wait for the gate and then run the 100 tasks
  EXPECT_EQ(ran, 100);
  opener.join();
}

TEST(Stream, DestructorOfAPoisonedStreamDoesNotThrow) {
  std::atomic<bool> later_ran{false};
  {
    Stream stream("poisoned");
    stream.enqueue([] { fail("never synchronized"); });
    stream.enqueue([&] { later_ran = true; });
  }
  EXPECT_FALSE(later_ran);
}

TEST(Stream, BusySecondsCountsTaskTime) {
  Stream stream("busy");
  EXPECT_EQ(stream.busy_seconds(), 0.0);
  stream.enqueue([] { std::this_thread::sleep_for(50ms); });
  stream.synchronize();
  EXPECT_GE(stream.busy_seconds(), 0.045);

  Stream inline_stream("busy-inline", Stream::Mode::Inline);
  inline_stream.enqueue([] { std::this_thread::sleep_for(50ms); });
  EXPECT_GE(inline_stream.busy_seconds(), 0.045);
}

TEST(Stream, BusySecondsExcludesWaits) {
  Stream a("slow");
  Stream b("waiting");
  a.enqueue([] { std::this_thread::sleep_for(300ms); });
  b.wait(a.record());
  b.synchronize();
  EXPECT_GE(a.busy_seconds(), 0.29);
  // b spent ~300 ms blocked in the wait and microseconds running; half the wait as the bound
  // keeps the test robust on a loaded machine while still catching waits counted as busy.
  EXPECT_LT(b.busy_seconds(), 0.15);
}

}  // namespace
}  // namespace infinigen
