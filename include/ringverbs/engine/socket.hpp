// Socket operations through the ring: accept, connect, recv, send.
#pragma once

#include <ringverbs/config.hpp>

#include <ringverbs/engine/detail/io_awaiter.hpp>
#include <ringverbs/engine/io_context.hpp>

#include <sys/socket.h>

#include <cstddef>
#include <span>

namespace ringverbs {

namespace detail {
struct accept_prep {
    static constexpr const char* name = "accept";
    int fd;
    sockaddr* addr;
    socklen_t* addrlen;
    int flags;
    void operator()(io_uring_sqe* sqe) const { io_uring_prep_accept(sqe, fd, addr, addrlen, flags); }
};
struct connect_prep {
    static constexpr const char* name = "connect";
    int fd;
    const sockaddr* addr;
    socklen_t addrlen;
    void operator()(io_uring_sqe* sqe) const { io_uring_prep_connect(sqe, fd, addr, addrlen); }
};
struct recv_prep {
    static constexpr const char* name = "recv";
    int fd;
    void* buf;
    std::size_t len;
    int flags;
    void operator()(io_uring_sqe* sqe) const { io_uring_prep_recv(sqe, fd, buf, len, flags); }
};
struct send_prep {
    static constexpr const char* name = "send";
    int fd;
    const void* buf;
    std::size_t len;
    int flags;
    void operator()(io_uring_sqe* sqe) const { io_uring_prep_send(sqe, fd, buf, len, flags); }
};
} // namespace detail

// co_await accept(ctx, listen_fd): gives the connected socket's fd (SOCK_CLOEXEC by default;
// the caller owns it). `addr`/`addrlen`, when given, receive the peer address and must live
// until the co_await returns. Errors: std::system_error "accept".
inline detail::io_awaiter<detail::accept_prep>
accept(io_context& ctx, int listen_fd, wait_options options = {}, sockaddr* addr = nullptr,
       socklen_t* addrlen = nullptr, int flags = SOCK_CLOEXEC) noexcept {
    return {ctx, detail::accept_prep{listen_fd, addr, addrlen, flags}, std::move(options)};
}

// co_await connect(ctx, fd, addr, len): connects a socket. `addr` must live until the
// co_await returns. Errors: std::system_error "connect" (e.g. connection_refused).
inline detail::io_awaiter<detail::connect_prep> connect(io_context& ctx, int fd,
                                                        const sockaddr* addr, socklen_t addrlen,
                                                        wait_options options = {}) noexcept {
    return {ctx, detail::connect_prep{fd, addr, addrlen}, std::move(options)};
}

// co_await recv(ctx, fd, buf): gives the bytes received (0: the peer closed).
// Errors: std::system_error "recv".
inline detail::io_awaiter<detail::recv_prep> recv(io_context& ctx, int fd, std::span<std::byte> buf,
                                                  wait_options options = {},
                                                  int flags = 0) noexcept {
    return {ctx, detail::recv_prep{fd, buf.data(), buf.size(), flags}, std::move(options)};
}

// co_await send(ctx, fd, data): gives the bytes sent (MSG_NOSIGNAL by default: a closed peer
// is an EPIPE error, not a signal). Errors: std::system_error "send".
inline detail::io_awaiter<detail::send_prep> send(io_context& ctx, int fd,
                                                  std::span<const std::byte> data,
                                                  wait_options options = {},
                                                  int flags = MSG_NOSIGNAL) noexcept {
    return {ctx, detail::send_prep{fd, data.data(), data.size(), flags}, std::move(options)};
}

} // namespace ringverbs
