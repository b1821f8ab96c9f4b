#include <ringverbs/engine/io_context.hpp>
#include <ringverbs/engine/timer.hpp>
#include <ringverbs/engine/when_all.hpp>

#include <doctest/doctest.h>

#include <chrono>
#include <stop_token>
#include <system_error>
#include <thread>
#include <type_traits>
#include <utility>

using namespace std::chrono_literals;
using ringverbs::io_context;
using ringverbs::task;

// The public surface: sleep_for() returns a named awaitable that only the library builds; the
// kernel reads the timespec inside it, so it stays in place.
static_assert(std::is_same_v<decltype(ringverbs::sleep_for(std::declval<io_context&>(), 1ms)),
                             ringverbs::sleep_awaitable>);
static_assert(!std::is_constructible_v<ringverbs::sleep_awaitable, io_context&,
                                       std::chrono::nanoseconds, std::stop_token>);
static_assert(!std::is_move_constructible_v<ringverbs::sleep_awaitable>);

TEST_CASE("sleep_for resumes after at least the duration") {
    io_context ctx;
    auto t0 = std::chrono::steady_clock::now();
    ctx.run([&]() -> task<void> { co_await ringverbs::sleep_for(ctx, 20ms); }());
    CHECK(std::chrono::steady_clock::now() - t0 >= 20ms);
}

TEST_CASE("sleeps end in the order of their durations") {
    io_context ctx;
    std::vector<int> order;
    auto sleeper = [&](int id, std::chrono::milliseconds d) -> task<void> {
        co_await ringverbs::sleep_for(ctx, d);
        order.push_back(id);
    };
    ctx.spawn(sleeper(3, 60ms));
    ctx.spawn(sleeper(1, 0ms));
    ctx.spawn(sleeper(2, 30ms));
    ctx.run();
    CHECK(order == std::vector<int>{1, 2, 3});
}

TEST_CASE("a sleep is cancelled by its stop_token, from this thread and from another") {
    io_context ctx;
    std::stop_source same;
    std::stop_source other;
    int cancelled = 0;
    auto sleeper = [&](std::stop_token tok) -> task<void> {
        try {
            co_await ringverbs::sleep_for(ctx, 3600s, tok);
        } catch (const std::system_error& e) {
            if (e.code() == std::errc::operation_canceled) ++cancelled;
        }
    };
    auto canceller = [&]() -> task<void> {
        co_await ringverbs::sleep_for(ctx, 1ms);
        same.request_stop();
    };
    ctx.spawn(sleeper(same.get_token()));
    ctx.spawn(sleeper(other.get_token()));
    ctx.spawn(canceller());
    std::thread t([&] {
        std::this_thread::sleep_for(10ms);
        other.request_stop();
    });
    ctx.run();
    t.join();
    CHECK(cancelled == 2);
    CHECK(ctx.operations_in_flight() == 0);
}

TEST_CASE("a stop requested before the co_await cancels without a request") {
    io_context ctx;
    std::stop_source src;
    src.request_stop();
    auto t = [&]() -> task<std::errc> {
        try {
            co_await ringverbs::sleep_for(ctx, 3600s, src.get_token());
        } catch (const std::system_error& e) {
            co_return static_cast<std::errc>(e.code().value());
        }
        co_return std::errc{};
    };
    CHECK(ctx.run(t()) == std::errc::operation_canceled);
}
