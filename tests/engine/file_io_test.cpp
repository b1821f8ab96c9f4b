#include "fd.hpp"

#include <ringverbs/engine/file_io.hpp>
#include <ringverbs/engine/io_context.hpp>
#include <ringverbs/engine/timer.hpp>

#include <doctest/doctest.h>

#include <chrono>
#include <cstddef>
#include <cstdio>
#include <cstring>
#include <span>
#include <stop_token>
#include <string>
#include <system_error>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

using namespace std::chrono_literals;
using ringverbs::io_context;
using ringverbs::task;
using ringverbs::wait_options;

// The public surface: read() and write() return named awaitables that only the library builds.
static_assert(std::is_same_v<decltype(ringverbs::read(std::declval<io_context&>(), 0,
                                                      std::span<std::byte>{})),
                             ringverbs::read_awaitable>);
static_assert(std::is_same_v<decltype(ringverbs::write(std::declval<io_context&>(), 0,
                                                       std::span<const std::byte>{})),
                             ringverbs::write_awaitable>);
static_assert(!std::is_constructible_v<ringverbs::read_awaitable, io_context&,
                                       ringverbs::detail::read_prep, wait_options>);
static_assert(!std::is_constructible_v<ringverbs::write_awaitable, io_context&,
                                       ringverbs::detail::write_prep, wait_options>);

namespace {
std::span<const std::byte> bytes(const std::string& s) {
    return std::as_bytes(std::span<const char>(s.data(), s.size()));
}
} // namespace

TEST_CASE("write then read through a pipe") {
    io_context ctx;
    test::pipe_pair p;
    std::string msg = "ringverbs";
    std::vector<std::byte> buf(64);
    auto t = [&]() -> task<std::string> {
        int w = co_await ringverbs::write(ctx, p.wr.get(), bytes(msg));
        CHECK(w == static_cast<int>(msg.size()));
        int r = co_await ringverbs::read(ctx, p.rd.get(), buf);
        co_return std::string(reinterpret_cast<const char*>(buf.data()),
                              static_cast<std::size_t>(r));
    };
    CHECK(ctx.run(t()) == msg);
}

TEST_CASE("read and write at offsets in a file") {
    io_context ctx;
    std::FILE* f = std::tmpfile();
    REQUIRE(f != nullptr);
    int fd = fileno(f);
    std::string data = "0123456789";
    std::vector<std::byte> buf(4);
    auto t = [&]() -> task<std::string> {
        co_await ringverbs::write(ctx, fd, bytes(data), 0);
        int r = co_await ringverbs::read(ctx, fd, buf, 3);
        co_return std::string(reinterpret_cast<const char*>(buf.data()),
                              static_cast<std::size_t>(r));
    };
    CHECK(ctx.run(t()) == "3456");
    std::fclose(f);
}

TEST_CASE("read times out, and the data written later is still in the pipe") {
    io_context ctx;
    test::pipe_pair p;
    std::vector<std::byte> buf(8);
    auto t = [&]() -> task<std::errc> {
        try {
            co_await ringverbs::read(ctx, p.rd.get(), buf, ringverbs::current_position,
                                     wait_options{3ms});
        } catch (const std::system_error& e) {
            co_return static_cast<std::errc>(e.code().value());
        }
        co_return std::errc{};
    };
    CHECK(ctx.run(t()) == std::errc::timed_out);
    char c = 'z';
    REQUIRE(::write(p.wr.get(), &c, 1) == 1);
    char back = 0;
    CHECK(::read(p.rd.get(), &back, 1) == 1);
    CHECK(back == 'z');
}

TEST_CASE("a stop requested before a timed read's co_await ends it as cancelled, not timed out") {
    io_context ctx;
    test::pipe_pair p;
    std::vector<std::byte> buf(8);
    std::stop_source src;
    src.request_stop();
    auto t = [&]() -> task<std::errc> {
        try {
            co_await ringverbs::read(ctx, p.rd.get(), buf, ringverbs::current_position,
                                     wait_options{1s, src.get_token()});
        } catch (const std::system_error& e) {
            co_return static_cast<std::errc>(e.code().value());
        }
        co_return std::errc{};
    };
    CHECK(ctx.run(t()) == std::errc::operation_canceled);
}

TEST_CASE("cancelling a read races the data: every byte is read exactly once") {
    // Each round a byte is written while a stop is requested from another thread. The read
    // either returns the byte or is cancelled and the byte stays in the pipe: never both,
    // never neither.
    io_context ctx;
    test::pipe_pair p;
    constexpr int rounds = 2000;
    int via_ring = 0;
    int left_in_pipe = 0;
    int cancelled = 0;
    for (int i = 0; i < rounds; ++i) {
        std::stop_source src;
        std::byte b{};
        auto t = [&]() -> task<void> {
            try {
                int r = co_await ringverbs::read(ctx, p.rd.get(), std::span<std::byte>(&b, 1),
                                                 ringverbs::current_position,
                                                 wait_options{src.get_token()});
                if (r == 1 && b == static_cast<std::byte>(i & 0xff)) ++via_ring;
            } catch (const std::system_error& e) {
                if (e.code() == std::errc::operation_canceled) ++cancelled;
            }
        };
        ctx.spawn(t());
        ctx.run_once(false);
        auto value = static_cast<unsigned char>(i & 0xff);
        // Three orders: the cancel reaches the kernel first, the data is reaped first, both
        // at once from two threads.
        if (i % 3 == 0) {
            src.request_stop();
            ctx.run_once(false);
            REQUIRE(::write(p.wr.get(), &value, 1) == 1);
        } else if (i % 3 == 1) {
            REQUIRE(::write(p.wr.get(), &value, 1) == 1);
            ctx.run_once(false);
            src.request_stop();
        } else {
            std::thread other([&] { src.request_stop(); });
            REQUIRE(::write(p.wr.get(), &value, 1) == 1);
            other.join();
        }
        ctx.run();
        // Whatever the ring did not take is still there.
        int flags = ::fcntl(p.rd.get(), F_GETFL);
        ::fcntl(p.rd.get(), F_SETFL, flags | O_NONBLOCK);
        unsigned char rest = 0;
        if (::read(p.rd.get(), &rest, 1) == 1 && rest == value) ++left_in_pipe;
        ::fcntl(p.rd.get(), F_SETFL, flags);
    }
    MESSAGE("read by the ring " << via_ring << ", cancelled " << cancelled);
    CHECK(via_ring + left_in_pipe == rounds);
    CHECK(cancelled == left_in_pipe);
    CHECK(cancelled >= rounds / 3);
}
