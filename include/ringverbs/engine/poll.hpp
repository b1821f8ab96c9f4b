// Waiting for an fd to become ready: a one-shot poll, and a multishot poll stream.
#pragma once

#include <ringverbs/config.hpp>

#include <ringverbs/engine/detail/fd_watch.hpp>
#include <ringverbs/engine/detail/io_awaiter.hpp>
#include <ringverbs/engine/detail/waiter.hpp>
#include <ringverbs/engine/io_context.hpp>

#include <poll.h>

#include <cstdint>
#include <memory>

namespace ringverbs {

namespace detail {
struct poll_prep {
    static constexpr const char* name = "poll";
    int fd;
    unsigned events;
    void operator()(io_uring_sqe* sqe) const { io_uring_prep_poll_add(sqe, fd, events); }
};
} // namespace detail

// The awaitable poll() returns. `co_await` gives the revents, or throws std::system_error
// "poll": the kernel's errno (e.g. EBADF), errc::timed_out, or errc::operation_canceled
// (stop_token fired, or the io_context is being destroyed). Await it once. While awaited it
// is the request's user_data and stays in the awaiting coroutine's frame until the kernel is
// done with it, even when cancelled. Movable only before it is awaited.
class [[nodiscard]] poll_awaitable : detail::io_awaiter<detail::poll_prep> {
  public:
    using io_awaiter::await_ready;
    using io_awaiter::await_resume;
    using io_awaiter::await_suspend;

  private:
    poll_awaitable(io_context& ctx, detail::poll_prep prep, wait_options options) noexcept
        : io_awaiter(ctx, prep, std::move(options)) {}
    friend poll_awaitable poll(io_context&, int, unsigned, wait_options) noexcept;
};

// co_await poll(ctx, fd, POLLIN): waits once until `fd` has one of `events` (poll(2) bits) and
// gives the revents. Errors: std::system_error "poll" (timed_out, operation_canceled, or the
// kernel's errno, e.g. EBADF). The fd must stay open until the co_await returns.
inline poll_awaitable poll(io_context& ctx, int fd, unsigned events,
                           wait_options options = {}) noexcept {
    return {ctx, detail::poll_prep{fd, events}, std::move(options)};
}

// A multishot poll on one fd: the kernel keeps reporting readiness without a new request per
// event. The kernel may end a multishot request at any time (CQ overflow, memory pressure);
// the stream then re-arms it, and no readiness is lost, since a level-triggered poll on a
// ready fd reports at once. Events that arrive while nobody waits are merged (OR of revents)
// and given to the next next().
//
// Owns one heap-allocated state (per stream, not per event). Destroying the stream cancels
// the poll; if the kernel still owes its last CQE, the io_context frees the state when that
// CQE arrives. The fd must stay open until the stream is destroyed; close it after.
// Pending next() calls are resumed with operation_canceled when the stream is destroyed.
class poll_stream {
  public:
    // Arms the poll. Throws std::system_error "poll_stream" when the ring fails.
    poll_stream(io_context& ctx, int fd, unsigned events = POLLIN);
    ~poll_stream();
    poll_stream(poll_stream&&) noexcept = default;
    poll_stream& operator=(poll_stream&&) noexcept = delete;
    poll_stream(const poll_stream&) = delete;

    // co_await stream.next(): the revents reported since the last next(), waiting for one
    // when none is pending (without suspending when one is). FIFO among several waiters.
    // Errors: std::system_error "poll_stream" with timed_out, operation_canceled, or the
    // error the kernel reported for the fd (after which the stream stays failed).
    class next_awaitable;
    next_awaitable next(wait_options options = {}) noexcept;

    // How many times the kernel ended the multishot request and the stream re-armed it.
    std::uint64_t rearms() const noexcept { return state_->watch ? state_->watch->rearms() : 0; }
    // Readiness CQEs received.
    std::uint64_t completions() const noexcept { return state_->completions; }
    int fd() const noexcept { return state_->fd; }

  private:
    struct state {
        io_context* ctx;
        int fd;
        unsigned pending = 0; // revents not yet handed to a waiter
        int error = 0;        // a failure the kernel reported; the stream is done
        std::uint64_t completions = 0;
        detail::fd_watch* watch = nullptr; // the multishot poll (outlives us until its last CQE)
        detail::waiter_queue waiters;
    };

    static void ready(void* owner, unsigned revents) noexcept;
    static void failed(void* owner, int err) noexcept;

    std::unique_ptr<state> state_;
};

// The awaitable poll_stream::next() returns. `co_await` gives the revents reported since the
// last next() (at once, without suspending, when some are pending), or throws
// std::system_error "poll_stream": errc::timed_out, errc::operation_canceled (stop_token
// fired, or the stream or the io_context was destroyed meanwhile), or the kernel's error for
// the fd. Await it once, in place: while suspended it is linked into the stream's queue of
// waiters, so it is neither copyable nor movable. The stream may be destroyed while it waits.
class [[nodiscard]] poll_stream::next_awaitable : detail::waiter {
  public:
    next_awaitable(const next_awaitable&) = delete;
    next_awaitable& operator=(const next_awaitable&) = delete;

    bool await_ready() noexcept {
        if (state_->pending != 0 || state_->error != 0) return true;
        return false;
    }
    void await_suspend(std::coroutine_handle<> h) {
        wait_in(state_->waiters, *state_->ctx, options_, h);
    }
    unsigned await_resume() {
        if (decided()) { // fulfilled (revents set) or failed; the stream may be gone
            const int err = error();
            if (err != 0) throw_system_error(err, "poll_stream");
            return revents_;
        }
        // Ready at once: *state_ is alive.
        if (state_->pending == 0) throw_system_error(state_->error, "poll_stream");
        return std::exchange(state_->pending, 0u);
    }

  private:
    friend class poll_stream; // links it into its queue and hands it revents_

    next_awaitable(poll_stream::state* st, wait_options o) noexcept
        : state_(st), options_(std::move(o)) {}

    poll_stream::state* state_;
    wait_options options_;
    unsigned revents_ = 0;
};

inline poll_stream::next_awaitable poll_stream::next(wait_options options) noexcept {
    return next_awaitable{state_.get(), std::move(options)};
}

} // namespace ringverbs
