// read and write on any fd (files, pipes, eventfds) through the ring.
#pragma once

#include <ringverbs/config.hpp>

#include <ringverbs/engine/detail/io_awaiter.hpp>
#include <ringverbs/engine/io_context.hpp>

#include <cstddef>
#include <cstdint>
#include <span>

namespace ringverbs {

namespace detail {
struct read_prep {
    static constexpr const char* name = "read";
    int fd;
    void* buf;
    unsigned len;
    std::uint64_t offset;
    void operator()(io_uring_sqe* sqe) const { io_uring_prep_read(sqe, fd, buf, len, offset); }
};
struct write_prep {
    static constexpr const char* name = "write";
    int fd;
    const void* buf;
    unsigned len;
    std::uint64_t offset;
    void operator()(io_uring_sqe* sqe) const { io_uring_prep_write(sqe, fd, buf, len, offset); }
};
} // namespace detail

// Use as the offset for fds without a position (pipes, sockets) or to use the file position.
inline constexpr std::uint64_t current_position = static_cast<std::uint64_t>(-1);

// The awaitable read() returns. `co_await` gives the bytes read (0 at end of file), or throws
// std::system_error "read": the errno, errc::timed_out, or errc::operation_canceled (stop_token
// fired, or the io_context is being destroyed). Await it once. While awaited it is the
// request's user_data: it stays in the awaiting coroutine's frame until the kernel is done
// (even when cancelled), so the buffer only has to outlive the co_await. Movable only before
// it is awaited.
class [[nodiscard]] read_awaitable : detail::io_awaiter<detail::read_prep> {
  public:
    using io_awaiter::await_ready;
    using io_awaiter::await_resume;
    using io_awaiter::await_suspend;

  private:
    read_awaitable(io_context& ctx, detail::read_prep prep, wait_options options) noexcept
        : io_awaiter(ctx, prep, std::move(options)) {}
    friend read_awaitable read(io_context&, int, std::span<std::byte>, std::uint64_t,
                               wait_options) noexcept;
};

// The awaitable write() returns. `co_await` gives the bytes written, or throws
// std::system_error "write" (as read_awaitable). Same lifetime rules as read_awaitable: the
// data only has to outlive the co_await.
class [[nodiscard]] write_awaitable : detail::io_awaiter<detail::write_prep> {
  public:
    using io_awaiter::await_ready;
    using io_awaiter::await_resume;
    using io_awaiter::await_suspend;

  private:
    write_awaitable(io_context& ctx, detail::write_prep prep, wait_options options) noexcept
        : io_awaiter(ctx, prep, std::move(options)) {}
    friend write_awaitable write(io_context&, int, std::span<const std::byte>, std::uint64_t,
                                 wait_options) noexcept;
};

// co_await read(ctx, fd, buf): reads up to buf.size() bytes; gives the count (0 at end of
// file). The buffer must stay alive until the co_await returns (it does: the awaiter keeps
// the coroutine suspended until the kernel is done with it, even when cancelled).
// Errors: std::system_error "read" with the errno, timed_out or operation_canceled.
inline read_awaitable read(io_context& ctx, int fd, std::span<std::byte> buf,
                           std::uint64_t offset = current_position,
                           wait_options options = {}) noexcept {
    return {ctx, detail::read_prep{fd, buf.data(), static_cast<unsigned>(buf.size()), offset},
            std::move(options)};
}

// co_await write(ctx, fd, data): writes up to data.size() bytes; gives the count written.
// Errors: std::system_error "write", as read().
inline write_awaitable write(io_context& ctx, int fd, std::span<const std::byte> data,
                             std::uint64_t offset = current_position,
                             wait_options options = {}) noexcept {
    return {ctx, detail::write_prep{fd, data.data(), static_cast<unsigned>(data.size()), offset},
            std::move(options)};
}

} // namespace ringverbs
