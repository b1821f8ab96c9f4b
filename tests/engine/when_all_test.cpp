#include <ringverbs/engine/io_context.hpp>
#include <ringverbs/engine/timer.hpp>
#include <ringverbs/engine/when_all.hpp>

#include <doctest/doctest.h>

#include <chrono>
#include <stdexcept>
#include <string>
#include <vector>

using namespace std::chrono_literals;
using ringverbs::io_context;
using ringverbs::task;

TEST_CASE("when_all runs tasks concurrently and gives every result") {
    io_context ctx;
    auto after = [&](std::chrono::milliseconds d, int v) -> task<int> {
        co_await ringverbs::sleep_for(ctx, d);
        co_return v;
    };
    auto nothing = [&]() -> task<void> { co_await ringverbs::sleep_for(ctx, 1ms); };
    auto t0 = std::chrono::steady_clock::now();
    auto [a, b, c] = ctx.run(ringverbs::when_all(after(30ms, 1), after(30ms, 2), nothing()));
    auto took = std::chrono::steady_clock::now() - t0;
    CHECK(a == 1);
    CHECK(b == 2);
    (void)c;
    CHECK(took >= 30ms);
}

TEST_CASE("when_all with tasks that complete synchronously") {
    io_context ctx;
    auto value = [](int v) -> task<int> { co_return v; };
    auto [x, y] = ctx.run(ringverbs::when_all(value(4), value(5)));
    CHECK(x + y == 9);
}

TEST_CASE("when_all over a vector keeps the order") {
    io_context ctx;
    auto after = [&](int i) -> task<int> {
        co_await ringverbs::sleep_for(ctx, std::chrono::milliseconds(10 - i));
        co_return i;
    };
    std::vector<task<int>> tasks;
    for (int i = 0; i < 10; ++i)
        tasks.push_back(after(i));
    auto out = ctx.run(ringverbs::when_all(std::move(tasks)));
    CHECK(out == std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9});
}

TEST_CASE("when_all waits for every task and rethrows the first exception") {
    io_context ctx;
    int finished = 0;
    auto ok = [&]() -> task<void> {
        co_await ringverbs::sleep_for(ctx, 5ms);
        ++finished;
    };
    auto bad = [&]() -> task<void> {
        co_await ringverbs::sleep_for(ctx, 1ms);
        throw std::runtime_error("child failed");
    };
    CHECK_THROWS_WITH(ctx.run(ringverbs::when_all(ok(), bad(), ok())), "child failed");
    CHECK(finished == 2);
}
