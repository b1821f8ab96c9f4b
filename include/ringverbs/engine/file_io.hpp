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

// co_await read(ctx, fd, buf): reads up to buf.size() bytes; gives the count (0 at end of
// file). The buffer must stay alive until the co_await returns (it does: the awaiter keeps
// the coroutine suspended until the kernel is done with it, even when cancelled).
// Errors: std::system_error "read" with the errno, timed_out or operation_canceled.
inline detail::io_awaiter<detail::read_prep> read(io_context& ctx, int fd, std::span<std::byte> buf,
                                                  std::uint64_t offset = current_position,
                                                  wait_options options = {}) noexcept {
    return {ctx, detail::read_prep{fd, buf.data(), static_cast<unsigned>(buf.size()), offset},
            std::move(options)};
}

// co_await write(ctx, fd, data): writes up to data.size() bytes; gives the count written.
// Errors: std::system_error "write", as read().
inline detail::io_awaiter<detail::write_prep> write(io_context& ctx, int fd,
                                                    std::span<const std::byte> data,
                                                    std::uint64_t offset = current_position,
                                                    wait_options options = {}) noexcept {
    return {ctx, detail::write_prep{fd, data.data(), static_cast<unsigned>(data.size()), offset},
            std::move(options)};
}

} // namespace ringverbs
