#include "fd.hpp"

#include <ringverbs/engine/io_context.hpp>
#include <ringverbs/engine/socket.hpp>
#include <ringverbs/engine/when_all.hpp>

#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <chrono>
#include <cstddef>
#include <span>
#include <string>
#include <system_error>
#include <type_traits>
#include <utility>
#include <vector>

using namespace std::chrono_literals;
using ringverbs::io_context;
using ringverbs::task;
using ringverbs::wait_options;

// The public surface: the socket calls return named awaitables that only the library builds.
static_assert(std::is_same_v<decltype(ringverbs::accept(std::declval<io_context&>(), 0)),
                             ringverbs::accept_awaitable>);
static_assert(std::is_same_v<decltype(ringverbs::connect(std::declval<io_context&>(), 0, nullptr,
                                                         socklen_t{})),
                             ringverbs::connect_awaitable>);
static_assert(std::is_same_v<decltype(ringverbs::recv(std::declval<io_context&>(), 0,
                                                      std::span<std::byte>{})),
                             ringverbs::recv_awaitable>);
static_assert(std::is_same_v<decltype(ringverbs::send(std::declval<io_context&>(), 0,
                                                      std::span<const std::byte>{})),
                             ringverbs::send_awaitable>);
static_assert(!std::is_constructible_v<ringverbs::recv_awaitable, io_context&,
                                       ringverbs::detail::recv_prep, wait_options>);

namespace {

// A listening TCP socket on 127.0.0.1 with a kernel-chosen port: traffic stays on loopback.
struct listener {
    test::unique_fd fd{::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)};
    sockaddr_in addr{};
    listener() {
        addr.sin_family = AF_INET;
        addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        addr.sin_port = 0;
        REQUIRE(::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
        socklen_t len = sizeof addr;
        REQUIRE(::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &len) == 0);
        REQUIRE(::listen(fd.get(), 16) == 0);
    }
};

test::unique_fd tcp_socket() {
    return test::unique_fd{::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)};
}

} // namespace

TEST_CASE("accept, connect, send and recv on loopback") {
    io_context ctx;
    listener l;
    auto server = [&]() -> task<std::string> {
        test::unique_fd conn{co_await ringverbs::accept(ctx, l.fd.get())};
        std::vector<std::byte> buf(100);
        std::string got;
        while (got.size() < 5) {
            int n = co_await ringverbs::recv(ctx, conn.get(), buf);
            if (n == 0) break;
            got.append(reinterpret_cast<const char*>(buf.data()), static_cast<std::size_t>(n));
        }
        co_await ringverbs::send(ctx, conn.get(), std::as_bytes(std::span(got.data(), got.size())));
        co_return got;
    };
    auto client = [&]() -> task<std::string> {
        auto s = tcp_socket();
        co_await ringverbs::connect(ctx, s.get(), reinterpret_cast<sockaddr*>(&l.addr),
                                    sizeof l.addr);
        std::string msg = "hello";
        co_await ringverbs::send(ctx, s.get(), std::as_bytes(std::span(msg.data(), msg.size())));
        std::vector<std::byte> buf(100);
        int n = co_await ringverbs::recv(ctx, s.get(), buf, wait_options{10s});
        co_return std::string(reinterpret_cast<const char*>(buf.data()),
                              static_cast<std::size_t>(n));
    };
    auto [served, echoed] = ctx.run(ringverbs::when_all(server(), client()));
    CHECK(served == "hello");
    CHECK(echoed == "hello");
}

TEST_CASE("connect where nothing listens gives connection_refused naming connect") {
    io_context ctx;
    sockaddr_in addr{};
    {
        listener l; // take a free port, then close it
        addr = l.addr;
    }
    auto t = [&]() -> task<std::string> {
        auto s = tcp_socket();
        try {
            co_await ringverbs::connect(ctx, s.get(), reinterpret_cast<sockaddr*>(&addr),
                                        sizeof addr);
        } catch (const std::system_error& e) {
            CHECK(e.code() == std::errc::connection_refused);
            co_return e.what();
        }
        co_return "";
    };
    CHECK(ctx.run(t()).rfind("connect", 0) == 0);
}

TEST_CASE("recv times out and accept is cancelled by its stop_token") {
    io_context ctx;
    listener l;
    std::stop_source src;
    auto t = [&]() -> task<void> {
        auto s = tcp_socket();
        co_await ringverbs::connect(ctx, s.get(), reinterpret_cast<sockaddr*>(&l.addr),
                                    sizeof l.addr);
        std::vector<std::byte> buf(8);
        CHECK_THROWS_AS(co_await ringverbs::recv(ctx, s.get(), buf, wait_options{2ms}),
                        std::system_error);
        test::unique_fd first{co_await ringverbs::accept(ctx, l.fd.get())};
        src.request_stop();
        try {
            co_await ringverbs::accept(ctx, l.fd.get(), wait_options{src.get_token()});
            FAIL("accepted");
        } catch (const std::system_error& e) {
            CHECK(e.code() == std::errc::operation_canceled);
        }
    };
    ctx.run(t());
}
