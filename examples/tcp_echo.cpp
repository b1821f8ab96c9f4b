// tcp_echo: the engine in one page. An echo server and its clients are coroutines on one
// io_context (one thread, one io_uring ring), talking over TCP on 127.0.0.1.
//
//   tcp_echo [--clients N] [--messages N] [--size BYTES]
//
// Every client sends messages and checks that each comes back byte for byte; the program
// prints the round trips verified and their rate. (The RDMA echo server comes with the
// completion runtime: see the README.)
#include <ringverbs/ringverbs.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

using namespace ringverbs;

namespace {

struct fd_guard {
    int fd;
    ~fd_guard() { ::close(fd); }
};

// Receives exactly buf.size() bytes, or throws when the peer closes first.
task<void> recv_all(io_context& ctx, int fd, std::span<std::byte> buf) {
    while (!buf.empty()) {
        int n = co_await recv(ctx, fd, buf, std::chrono::seconds(10));
        if (n == 0) throw std::runtime_error("peer closed the connection");
        buf = buf.subspan(static_cast<std::size_t>(n));
    }
}

task<void> send_all(io_context& ctx, int fd, std::span<const std::byte> data) {
    while (!data.empty())
        data = data.subspan(static_cast<std::size_t>(co_await send(ctx, fd, data)));
}

// One coroutine per connection: echo until the client closes.
task<void> serve(io_context& ctx, int fd) {
    fd_guard guard{fd};
    std::vector<std::byte> buf(64 * 1024);
    for (;;) {
        int n = co_await recv(ctx, fd, buf);
        if (n <= 0) co_return;
        co_await send_all(ctx, fd, std::span(buf).first(static_cast<std::size_t>(n)));
    }
}

task<void> accept_loop(io_context& ctx, int listen_fd, int connections) {
    for (int i = 0; i < connections; ++i)
        ctx.spawn(serve(ctx, co_await accept(ctx, listen_fd)));
}

task<long> client(io_context& ctx, sockaddr_in addr, int messages, std::size_t size, int id) {
    fd_guard s{::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)};
    int one = 1;
    ::setsockopt(s.fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    co_await connect(ctx, s.fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
    std::vector<std::byte> out(size), in(size);
    long verified = 0;
    for (int m = 0; m < messages; ++m) {
        for (std::size_t i = 0; i < size; ++i)
            out[i] = static_cast<std::byte>((id * 131 + m + i) & 0xff);
        co_await send_all(ctx, s.fd, out);
        co_await recv_all(ctx, s.fd, in);
        if (std::memcmp(in.data(), out.data(), size) != 0)
            throw std::runtime_error("echo mismatch");
        ++verified;
    }
    co_return verified;
}

} // namespace

int main(int argc, char** argv) {
    int clients = 4, messages = 10000;
    std::size_t size = 64;
    for (int i = 1; i + 1 < argc; i += 2) {
        std::string a = argv[i];
        if (a == "--clients")
            clients = std::stoi(argv[i + 1]);
        else if (a == "--messages")
            messages = std::stoi(argv[i + 1]);
        else if (a == "--size")
            size = std::stoul(argv[i + 1]);
        else {
            std::fprintf(stderr, "usage: tcp_echo [--clients N] [--messages N] [--size BYTES]\n");
            return 2;
        }
    }
    try {
        io_context ctx;
        fd_guard l{::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0)};
        sockaddr_in addr{};
        addr.sin_family = AF_INET;
        addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK); // loopback only
        socklen_t len = sizeof addr;
        if (::bind(l.fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
            ::getsockname(l.fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0 ||
            ::listen(l.fd, 128) != 0)
            throw_system_error(errno, "bind/listen on 127.0.0.1");
        ctx.spawn(accept_loop(ctx, l.fd, clients));
        std::vector<task<long>> all;
        for (int c = 0; c < clients; ++c)
            all.push_back(client(ctx, addr, messages, size, c));
        auto t0 = std::chrono::steady_clock::now();
        std::vector<long> done = ctx.run(when_all(std::move(all)));
        double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        long total = 0;
        for (long d : done)
            total += d;
        std::printf(
            "tcp_echo: %d clients, %ld messages of %zu bytes echoed and verified byte for byte\n",
            clients, total, size);
        std::printf("tcp_echo: %.0f round trips/s, %.1f us mean round trip per client\n",
                    static_cast<double>(total) / secs,
                    secs * 1e6 * clients / static_cast<double>(total));
        return total == static_cast<long>(clients) * messages ? 0 : 1;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "tcp_echo: %s\n", e.what());
        return 1;
    }
}
