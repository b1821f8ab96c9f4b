#include <ringverbs/engine/io_context.hpp>
#include <ringverbs/engine/task.hpp>

#include <doctest/doctest.h>

#include <memory>
#include <stdexcept>
#include <string>

using ringverbs::io_context;
using ringverbs::task;

namespace {

task<int> forty_two() {
    co_return 42;
}
task<std::string> greet(std::string who) {
    co_return "hello " + who;
}
task<void> nothing() {
    co_return;
}
task<int> add(int a) {
    co_return a + co_await forty_two();
}
task<int> throws() {
    throw std::runtime_error("boom");
    co_return 0;
}
task<std::unique_ptr<int>> move_only() {
    co_return std::make_unique<int>(7);
}

} // namespace

TEST_CASE("task gives its value to the awaiter") {
    io_context ctx;
    CHECK(ctx.run(forty_two()) == 42);
    CHECK(ctx.run(greet("rdma")) == "hello rdma");
    CHECK(ctx.run(add(1)) == 43);
    CHECK(*ctx.run(move_only()) == 7);
    ctx.run(nothing());
}

TEST_CASE("task is lazy: nothing runs until it is awaited") {
    bool ran = false;
    auto make = [&ran]() -> task<void> {
        ran = true;
        co_return;
    };
    io_context ctx;
    auto t = make();
    CHECK_FALSE(ran);
    ctx.run(std::move(t));
    CHECK(ran);
}

TEST_CASE("an exception thrown in a task reaches the awaiter") {
    io_context ctx;
    auto outer = []() -> task<std::string> {
        try {
            co_await throws();
        } catch (const std::runtime_error& e) {
            co_return std::string("caught ") + e.what();
        }
        co_return "not caught";
    };
    CHECK(ctx.run(outer()) == "caught boom");
    CHECK_THROWS_WITH_AS(ctx.run(throws()), "boom", std::runtime_error);
}

TEST_CASE("task is move-only and an unawaited task is destroyed without leaking") {
    static_assert(!std::is_copy_constructible_v<task<int>>);
    static_assert(std::is_nothrow_move_constructible_v<task<int>>);
    auto t = forty_two();
    auto u = std::move(t);
    CHECK_FALSE(static_cast<bool>(t));
    CHECK(static_cast<bool>(u));
    // u is destroyed unstarted here; ASan reports a leaked frame if it is not.
}

TEST_CASE("a million synchronously completing co_awaits run in constant stack") {
    io_context ctx;
    auto loop = []() -> task<long> {
        long sum = 0;
        for (int i = 0; i < 1'000'000; ++i)
            sum += co_await forty_two();
        co_return sum;
    };
    CHECK(ctx.run(loop()) == 42'000'000L);
}

TEST_CASE("deep recursion of awaited tasks that complete synchronously") {
    // Each level suspends into its child: depth costs stack, but only depth, not count.
    struct rec {
        static task<int> down(int n) {
            if (n == 0) co_return 0;
            co_return 1 + co_await down(n - 1);
        }
    };
    io_context ctx;
    CHECK(ctx.run(rec::down(1000)) == 1000);
}
