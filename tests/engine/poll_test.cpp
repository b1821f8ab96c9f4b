#include "fd.hpp"

#include <ringverbs/engine/io_context.hpp>
#include <ringverbs/engine/poll.hpp>
#include <ringverbs/engine/timer.hpp>

#include <doctest/doctest.h>

#include <sys/resource.h>

#include <chrono>
#include <stop_token>
#include <system_error>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

using namespace std::chrono_literals;
using ringverbs::io_context;
using ringverbs::task;
using ringverbs::wait_options;

// The public surface: poll() and poll_stream::next() return named awaitables that only the
// library builds; a waiting next() is linked into the stream's queue, so it stays in place.
static_assert(std::is_same_v<decltype(ringverbs::poll(std::declval<io_context&>(), 0, POLLIN)),
                             ringverbs::poll_awaitable>);
static_assert(!std::is_constructible_v<ringverbs::poll_awaitable, io_context&,
                                       ringverbs::detail::poll_prep, wait_options>);
static_assert(std::is_same_v<decltype(std::declval<ringverbs::poll_stream&>().next()),
                             ringverbs::poll_stream::next_awaitable>);
static_assert(!std::is_move_constructible_v<ringverbs::poll_stream::next_awaitable>);

namespace {
std::errc error_of(const std::system_error& e) {
    return static_cast<std::errc>(e.code().value());
}
} // namespace

TEST_CASE("poll gives the revents once the fd is ready") {
    io_context ctx;
    auto efd = test::make_eventfd();
    auto waiter = [&]() -> task<unsigned> {
        co_return co_await ringverbs::poll(ctx, efd.get(), POLLIN);
    };
    auto signaller = [&]() -> task<void> {
        co_await ringverbs::sleep_for(ctx, 1ms);
        test::signal(efd);
    };
    ctx.spawn(signaller());
    CHECK((ctx.run(waiter()) & POLLIN) != 0);
}

TEST_CASE("poll times out with errc::timed_out") {
    io_context ctx;
    auto efd = test::make_eventfd();
    auto t = [&]() -> task<std::errc> {
        try {
            co_await ringverbs::poll(ctx, efd.get(), POLLIN, 5ms);
        } catch (const std::system_error& e) {
            CHECK(std::string(e.what()).find("poll") != std::string::npos);
            co_return error_of(e);
        }
        co_return std::errc{};
    };
    CHECK(ctx.run(t()) == std::errc::timed_out);
    CHECK(ctx.operations_in_flight() == 0);
}

TEST_CASE("poll with a timeout that does not fire returns the revents") {
    io_context ctx;
    auto efd = test::make_eventfd();
    test::signal(efd);
    auto t = [&]() -> task<unsigned> {
        co_return co_await ringverbs::poll(ctx, efd.get(), POLLIN, wait_options{10s});
    };
    CHECK((ctx.run(t()) & POLLIN) != 0);
}

TEST_CASE("poll on a bad fd names the operation and the errno") {
    io_context ctx;
    auto t = [&]() -> task<std::errc> {
        try {
            co_await ringverbs::poll(ctx, 987654, POLLIN);
        } catch (const std::system_error& e) {
            co_return error_of(e);
        }
        co_return std::errc{};
    };
    CHECK(ctx.run(t()) == std::errc::bad_file_descriptor);
}

TEST_CASE("100,000 concurrent polls all complete") {
    io_context ctx;
    constexpr int fds = 100;
    constexpr int polls = 100'000;
    std::vector<test::unique_fd> efds;
    for (int i = 0; i < fds; ++i)
        efds.push_back(test::make_eventfd());
    int completed = 0;
    auto waiter = [&](int fd) -> task<void> {
        unsigned ev = co_await ringverbs::poll(ctx, fd, POLLIN);
        if (ev & POLLIN) ++completed;
    };
    for (int i = 0; i < polls; ++i)
        ctx.spawn(waiter(efds[static_cast<std::size_t>(i % fds)].get()));
    while (ctx.operations_in_flight() < polls)
        ctx.run_once(false);
    CHECK(completed == 0);
    for (auto& e : efds)
        test::signal(e);
    ctx.run();
    CHECK(completed == polls);
}

TEST_CASE("cancelling a poll races its completion: every wait ends exactly once") {
    // The stop and the readiness happen together; either outcome is right, none is lost.
    io_context ctx;
    auto efd = test::make_eventfd();
    int ready = 0;
    int cancelled = 0;
    constexpr int rounds = 2000;
    for (int i = 0; i < rounds; ++i) {
        std::stop_source src;
        auto t = [&]() -> task<void> {
            try {
                co_await ringverbs::poll(ctx, efd.get(), POLLIN, wait_options{src.get_token()});
                ++ready;
            } catch (const std::system_error& e) {
                if (e.code() == std::errc::operation_canceled) ++cancelled;
            }
        };
        ctx.spawn(t());
        ctx.run_once(false);
        // Three orders: the cancel reaches the kernel first, the readiness is reaped first,
        // both at once from two threads.
        if (i % 3 == 0) {
            src.request_stop();
            ctx.run_once(false);
            test::signal(efd);
        } else if (i % 3 == 1) {
            test::signal(efd);
            ctx.run_once(false);
            src.request_stop();
        } else {
            std::thread other([&] { src.request_stop(); });
            test::signal(efd);
            other.join();
        }
        ctx.run();
        test::drain(efd);
    }
    CHECK(ready + cancelled == rounds);
    CHECK(cancelled >= rounds / 3); // the rounds that stopped first were cancelled
    CHECK(ready >= rounds / 3);     // the rounds that signalled first were served
    MESSAGE("ready " << ready << ", cancelled " << cancelled);
    CHECK(ctx.operations_in_flight() == 0);
}

TEST_CASE("poll_stream delivers merged events and waiters in FIFO order") {
    io_context ctx;
    auto efd = test::make_eventfd();
    ringverbs::poll_stream stream(ctx, efd.get(), POLLIN);
    std::vector<int> order;
    auto waiter = [&](int id) -> task<void> {
        unsigned ev = co_await stream.next();
        CHECK((ev & POLLIN) != 0);
        order.push_back(id);
        test::drain(efd);
    };
    auto signaller = [&]() -> task<void> {
        for (int i = 0; i < 3; ++i) {
            co_await ringverbs::sleep_for(ctx, 1ms);
            test::signal(efd);
        }
    };
    ctx.spawn(waiter(1));
    ctx.spawn(waiter(2));
    ctx.spawn(waiter(3));
    ctx.spawn(signaller());
    while (order.size() < 3)
        ctx.run_once(true);
    CHECK(order == std::vector<int>{1, 2, 3});
}

TEST_CASE("poll_stream next() times out and can be cancelled, and the stream goes on") {
    io_context ctx;
    auto efd = test::make_eventfd();
    ringverbs::poll_stream stream(ctx, efd.get(), POLLIN);
    std::stop_source src;
    auto t = [&]() -> task<void> {
        try {
            co_await stream.next(wait_options{2ms});
            FAIL("no timeout");
        } catch (const std::system_error& e) {
            CHECK(error_of(e) == std::errc::timed_out);
        }
        auto stopper = [&]() -> task<void> {
            co_await ringverbs::sleep_for(ctx, 1ms);
            src.request_stop();
        };
        ctx.spawn(stopper());
        try {
            co_await stream.next(wait_options{10s, src.get_token()});
            FAIL("no cancel");
        } catch (const std::system_error& e) {
            CHECK(error_of(e) == std::errc::operation_canceled);
        }
        test::signal(efd);
        unsigned ev = co_await stream.next(wait_options{10s});
        CHECK((ev & POLLIN) != 0);
    };
    ctx.run(t());
}

TEST_CASE("a multishot poll that the kernel ends is re-armed and loses nothing") {
    // A completion ring of 4 entries and 32 streams that all fire at once: the kernel cannot
    // post every CQE and terminates multishot requests (a CQE without IORING_CQE_F_MORE).
    io_context ctx(ringverbs::io_context_options{.sq_entries = 4, .cq_entries = 4});
    constexpr int n = 32;
    constexpr int rounds = 20;
    std::vector<test::unique_fd> efds;
    std::vector<ringverbs::poll_stream> streams;
    for (int i = 0; i < n; ++i)
        efds.push_back(test::make_eventfd());
    for (int i = 0; i < n; ++i)
        streams.emplace_back(ctx, efds[static_cast<std::size_t>(i)].get(), POLLIN);
    int delivered = 0;
    auto consumer = [&](std::size_t i) -> task<void> {
        for (int r = 0; r < rounds; ++r) {
            co_await streams[i].next(wait_options{10s});
            test::drain(efds[i]);
            ++delivered;
        }
    };
    for (std::size_t i = 0; i < n; ++i)
        ctx.spawn(consumer(i));
    ctx.run_once(false);
    for (int r = 0; r < rounds; ++r) {
        for (auto& e : efds)
            test::signal(e);
        while (delivered < (r + 1) * n)
            ctx.run_once(true);
    }
    std::uint64_t rearms = 0;
    for (auto& s : streams)
        rearms += s.rearms();
    MESSAGE("re-arms after the kernel ended the multishot poll: " << rearms);
    CHECK(delivered == n * rounds);
    CHECK(rearms > 0);
}

TEST_CASE("destroying a poll_stream with a waiter resumes it with operation_canceled") {
    io_context ctx;
    auto efd = test::make_eventfd();
    auto stream = std::make_unique<ringverbs::poll_stream>(ctx, efd.get(), POLLIN);
    std::errc seen{};
    auto t = [&]() -> task<void> {
        try {
            co_await stream->next();
        } catch (const std::system_error& e) {
            seen = error_of(e);
        }
    };
    ctx.spawn(t());
    ctx.run_once(false);
    stream.reset();
    ctx.run();
    CHECK(seen == std::errc::operation_canceled);
    CHECK(ctx.operations_in_flight() == 0);
}
