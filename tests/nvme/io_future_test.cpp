// IoFuture's callbacks: each runs once, in the order added, also when one is added from another
// thread while the completing thread is still running the earlier ones.
#include "tier/ext/io_future.hpp"

#include <gtest/gtest.h>

#include <future>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "nvme/io_op_state.hpp"

namespace tier::nvme {
namespace {

TEST(IoFuture, ACallbackAddedWhileEarlierOnesRunWaitsItsTurn) {
  auto state = std::make_shared<detail::IoOpState>(0);
  IoFuture f(state);
  std::mutex mu;
  std::vector<int> order;
  std::promise<void> first_started, first_may_end;
  auto may_end = first_may_end.get_future().share();
  f.on_complete([&](const Status&) {
    first_started.set_value();
    may_end.wait();
    std::lock_guard<std::mutex> lock(mu);
    order.push_back(1);
  });
  std::thread completer([&] { state->complete(Status::Ok()); });
  first_started.get_future().wait();
  // The future is complete and its first callback is running: a callback added now must not run
  // before it ends (nor beside it, on this thread).
  std::thread adder([&] {
    f.on_complete([&](const Status& s) {
      EXPECT_TRUE(s.ok());
      std::lock_guard<std::mutex> lock(mu);
      order.push_back(2);
    });
  });
  adder.join();
  {
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_TRUE(order.empty()) << "the second callback ran while the first was still running";
  }
  first_may_end.set_value();
  completer.join();
  EXPECT_EQ(order, (std::vector<int>{1, 2}));
  // Once every callback has run, a new one runs at once on the caller's thread.
  bool now = false;
  f.on_complete([&](const Status&) { now = true; });
  EXPECT_TRUE(now);
}

TEST(IoFuture, ACallbackAddedFromACallbackRunsAfterIt) {
  auto state = std::make_shared<detail::IoOpState>(0);
  IoFuture f(state);
  std::vector<int> order;
  f.on_complete([&](const Status&) {
    f.on_complete([&](const Status&) { order.push_back(3); });
    order.push_back(1);
  });
  f.on_complete([&](const Status&) { order.push_back(2); });
  state->complete(Status::Ok());
  EXPECT_EQ(order, (std::vector<int>{1, 2, 3}));
}

}  // namespace
}  // namespace tier::nvme
