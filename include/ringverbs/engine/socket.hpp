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
    void operator()(io_uring_sqe* sqe) const {
        io_uring_prep_accept(sqe, fd, addr, addrlen, flags);
    }
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

// The awaitables below are single io_uring requests. Each is awaited once; while awaited it is
// the request's user_data and stays in the awaiting coroutine's frame until the kernel is done
// with it, even when cancelled, so the buffers and addresses it names only have to outlive the
// co_await. Movable only before it is awaited. Besides the errno of the call, each throws
// std::system_error with errc::timed_out, or errc::operation_canceled when the stop_token fired
// or the io_context is being destroyed.

// The awaitable accept() returns. `co_await` gives the accepted socket's fd (the caller owns
// it), or throws std::system_error "accept".
class [[nodiscard]] accept_awaitable : detail::io_awaiter<detail::accept_prep> {
  public:
    using io_awaiter::await_ready;
    using io_awaiter::await_resume;
    using io_awaiter::await_suspend;

  private:
    accept_awaitable(io_context& ctx, detail::accept_prep prep, wait_options options) noexcept
        : io_awaiter(ctx, prep, std::move(options)) {}
    friend accept_awaitable accept(io_context&, int, wait_options, sockaddr*, socklen_t*,
                                   int) noexcept;
};

// The awaitable connect() returns. `co_await` gives 0 once connected, or throws
// std::system_error "connect".
class [[nodiscard]] connect_awaitable : detail::io_awaiter<detail::connect_prep> {
  public:
    using io_awaiter::await_ready;
    using io_awaiter::await_resume;
    using io_awaiter::await_suspend;

  private:
    connect_awaitable(io_context& ctx, detail::connect_prep prep, wait_options options) noexcept
        : io_awaiter(ctx, prep, std::move(options)) {}
    friend connect_awaitable connect(io_context&, int, const sockaddr*, socklen_t,
                                     wait_options) noexcept;
};

// The awaitable recv() returns. `co_await` gives the bytes received (0: the peer closed), or
// throws std::system_error "recv".
class [[nodiscard]] recv_awaitable : detail::io_awaiter<detail::recv_prep> {
  public:
    using io_awaiter::await_ready;
    using io_awaiter::await_resume;
    using io_awaiter::await_suspend;

  private:
    recv_awaitable(io_context& ctx, detail::recv_prep prep, wait_options options) noexcept
        : io_awaiter(ctx, prep, std::move(options)) {}
    friend recv_awaitable recv(io_context&, int, std::span<std::byte>, wait_options, int) noexcept;
};

// The awaitable send() returns. `co_await` gives the bytes sent, or throws std::system_error
// "send" (EPIPE when the peer closed, with the default MSG_NOSIGNAL).
class [[nodiscard]] send_awaitable : detail::io_awaiter<detail::send_prep> {
  public:
    using io_awaiter::await_ready;
    using io_awaiter::await_resume;
    using io_awaiter::await_suspend;

  private:
    send_awaitable(io_context& ctx, detail::send_prep prep, wait_options options) noexcept
        : io_awaiter(ctx, prep, std::move(options)) {}
    friend send_awaitable send(io_context&, int, std::span<const std::byte>, wait_options,
                               int) noexcept;
};

// co_await accept(ctx, listen_fd): gives the connected socket's fd (SOCK_CLOEXEC by default;
// the caller owns it). `addr`/`addrlen`, when given, receive the peer address and must live
// until the co_await returns. Errors: std::system_error "accept".
inline accept_awaitable accept(io_context& ctx, int listen_fd, wait_options options = {},
                               sockaddr* addr = nullptr, socklen_t* addrlen = nullptr,
                               int flags = SOCK_CLOEXEC) noexcept {
    return {ctx, detail::accept_prep{listen_fd, addr, addrlen, flags}, std::move(options)};
}

// co_await connect(ctx, fd, addr, len): connects a socket. `addr` must live until the
// co_await returns. Errors: std::system_error "connect" (e.g. connection_refused).
inline connect_awaitable connect(io_context& ctx, int fd, const sockaddr* addr, socklen_t addrlen,
                                 wait_options options = {}) noexcept {
    return {ctx, detail::connect_prep{fd, addr, addrlen}, std::move(options)};
}

// co_await recv(ctx, fd, buf): gives the bytes received (0: the peer closed).
// Errors: std::system_error "recv".
inline recv_awaitable recv(io_context& ctx, int fd, std::span<std::byte> buf,
                           wait_options options = {}, int flags = 0) noexcept {
    return {ctx, detail::recv_prep{fd, buf.data(), buf.size(), flags}, std::move(options)};
}

// co_await send(ctx, fd, data): gives the bytes sent (MSG_NOSIGNAL by default: a closed peer
// is an EPIPE error, not a signal). Errors: std::system_error "send".
inline send_awaitable send(io_context& ctx, int fd, std::span<const std::byte> data,
                           wait_options options = {}, int flags = MSG_NOSIGNAL) noexcept {
    return {ctx, detail::send_prep{fd, data.data(), data.size(), flags}, std::move(options)};
}

} // namespace ringverbs
