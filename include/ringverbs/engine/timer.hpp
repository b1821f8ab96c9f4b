// Sleeping on the ring: an IORING_OP_TIMEOUT per wait, no timer thread, no allocation.
#pragma once

#include <ringverbs/config.hpp>

#include <ringverbs/engine/detail/io_awaiter.hpp>
#include <ringverbs/engine/io_context.hpp>

#include <chrono>
#include <stop_token>

namespace ringverbs {

namespace detail {
struct sleep_prep {
    static constexpr const char* name = "sleep_for";
    const __kernel_timespec* ts;
    void operator()(io_uring_sqe* sqe) const {
        io_uring_prep_timeout(sqe, const_cast<__kernel_timespec*>(ts), 0, 0);
    }
    // The timeout expiring is the success of a sleep.
    static int result(int res) noexcept { return res == -ETIME ? 0 : res; }
};

class sleep_awaiter {
public:
    sleep_awaiter(io_context& ctx, std::chrono::nanoseconds d, std::stop_token stop) noexcept
        : ts_(to_kernel_timespec(d)),
          op_(ctx, sleep_prep{&ts_}, wait_options{std::move(stop)}) {}
    // op_ points at ts_: the awaiter stays where it was made (in the coroutine frame).
    sleep_awaiter(const sleep_awaiter&) = delete;
    sleep_awaiter& operator=(const sleep_awaiter&) = delete;
    bool await_ready() noexcept { return op_.await_ready(); }
    void await_suspend(std::coroutine_handle<> h) { op_.await_suspend(h); }
    void await_resume() { (void)op_.await_resume(); }

private:
    __kernel_timespec ts_; // read by the kernel when the request is submitted
    io_awaiter<sleep_prep> op_;
};
} // namespace detail

// co_await sleep_for(ctx, 10ms): resumes after `d`. Throws std::system_error "sleep_for" with
// operation_canceled when `stop` fires first (or the context is being destroyed).
inline detail::sleep_awaiter sleep_for(io_context& ctx, std::chrono::nanoseconds d,
                                       std::stop_token stop = {}) noexcept {
    return {ctx, d, std::move(stop)};
}

} // namespace ringverbs
