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

// co_await poll(ctx, fd, POLLIN): waits once until `fd` has one of `events` (poll(2) bits) and
// gives the revents. Errors: std::system_error "poll" (timed_out, operation_canceled, or the
// kernel's errno, e.g. EBADF). The fd must stay open until the co_await returns.
inline detail::io_awaiter<detail::poll_prep> poll(io_context& ctx, int fd, unsigned events,
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
    auto next(wait_options options = {}) noexcept;

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
    static void detach(void* source, detail::waiter* w) noexcept;

    std::unique_ptr<state> state_;

    struct next_awaiter;
};

struct poll_stream::next_awaiter : detail::waiter {
    poll_stream::state* s;
    wait_options options;
    unsigned revents = 0;

    next_awaiter(poll_stream::state* st, wait_options o) noexcept : s(st), options(std::move(o)) {}

    bool await_ready() noexcept {
        if (s->pending != 0 || s->error != 0) return true;
        return false;
    }
    void await_suspend(std::coroutine_handle<> h) {
        s->waiters.push_back(this);
        start(*s->ctx, options, h, s, &poll_stream::detach);
    }
    unsigned await_resume() {
        if (decided()) { // fulfilled (revents set) or failed; the stream may be gone
            const int err = error();
            if (err != 0) throw_system_error(err, "poll_stream");
            return revents;
        }
        // Ready at once: *s is alive.
        if (s->pending == 0) throw_system_error(s->error, "poll_stream");
        return std::exchange(s->pending, 0u);
    }
};

inline auto poll_stream::next(wait_options options) noexcept {
    return next_awaiter{state_.get(), std::move(options)};
}

} // namespace ringverbs
