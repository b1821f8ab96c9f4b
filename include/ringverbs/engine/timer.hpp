// Sleeping on the ring: an IORING_OP_TIMEOUT per wait, no timer thread, no allocation.
#pragma once

#include <ringverbs/config.hpp>

#include <ringverbs/engine/detail/io_awaiter.hpp>
#include <ringverbs/engine/io_context.hpp>

#include <chrono>
#include <coroutine>
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
} // namespace detail

// The awaitable sleep_for() returns. `co_await` resumes after the duration and gives nothing,
// or throws std::system_error "sleep_for" with errc::operation_canceled when the stop_token
// fires first (or the io_context is being destroyed). Await it once, in place: the kernel
// reads the timespec it holds, so it is neither copyable nor movable.
class [[nodiscard]] sleep_awaitable {
  public:
    sleep_awaitable(const sleep_awaitable&) = delete;
    sleep_awaitable& operator=(const sleep_awaitable&) = delete;
    bool await_ready() noexcept { return op_.await_ready(); }
    void await_suspend(std::coroutine_handle<> h) { op_.await_suspend(h); }
    void await_resume() { (void)op_.await_resume(); }

  private:
    sleep_awaitable(io_context& ctx, std::chrono::nanoseconds d, std::stop_token stop) noexcept
        : ts_(detail::to_kernel_timespec(d)),
          op_(ctx, detail::sleep_prep{&ts_}, wait_options{std::move(stop)}) {}
    friend sleep_awaitable sleep_for(io_context&, std::chrono::nanoseconds,
                                     std::stop_token) noexcept;

    __kernel_timespec ts_; // read by the kernel when the request is submitted; op_ points at it
    detail::io_awaiter<detail::sleep_prep> op_;
};

// co_await sleep_for(ctx, 10ms): resumes after `d`. Throws std::system_error "sleep_for" with
// operation_canceled when `stop` fires first (or the context is being destroyed).
inline sleep_awaitable sleep_for(io_context& ctx, std::chrono::nanoseconds d,
                                 std::stop_token stop = {}) noexcept {
    return {ctx, d, std::move(stop)};
}

} // namespace ringverbs
