// io_awaiter: the awaitable behind every single-shot io_uring operation (read, recv, poll,
// sleep, ...). Lives in the awaiting coroutine's frame: no allocation per operation.
#pragma once

#include <ringverbs/config.hpp>

#include <ringverbs/engine/detail/operation.hpp>
#include <ringverbs/engine/detail/stop_gate.hpp>
#include <ringverbs/engine/error.hpp>
#include <ringverbs/engine/io_context.hpp>

#include <liburing.h>

#include <cerrno>
#include <chrono>
#include <coroutine>

namespace ringverbs::detail {

inline __kernel_timespec to_kernel_timespec(std::chrono::nanoseconds d) noexcept {
    if (d.count() < 0) d = std::chrono::nanoseconds{0};
    __kernel_timespec ts{};
    ts.tv_sec = static_cast<long long>(d.count() / 1'000'000'000);
    ts.tv_nsec = static_cast<long long>(d.count() % 1'000'000'000);
    return ts;
}

// Prep is a small value type describing the request:
//   static constexpr const char* name;     // the operation, for error messages
//   void operator()(io_uring_sqe*) const;   // fills the SQE
//   optional: static int result(int res);   // maps the CQE result (e.g. -ETIME to 0 for sleep)
//
// Lifetime invariant: the awaiter is the request's user_data. The coroutine is resumed only
// after the request's CQE arrived (a cancellation, by timeout or stop_token, only asks the
// kernel; its own CQE and the linked timeout's carry ignored_user_data), so the awaiter, the
// buffers it names and the timespec outlive everything the kernel does for it.
template <typename Prep>
class [[nodiscard]] io_awaiter : operation {
  public:
    io_awaiter(io_context& ctx, Prep prep, wait_options options) noexcept
        : ctx_(&ctx), prep_(prep), options_(std::move(options)) {
        on_cqe = &io_awaiter::complete;
    }
    io_awaiter(const io_awaiter&) = delete;
    io_awaiter& operator=(const io_awaiter&) = delete;
    io_awaiter(io_awaiter&& o) noexcept : io_awaiter(*o.ctx_, o.prep_, std::move(o.options_)) {}

    bool await_ready() noexcept {
        if (options_.stop.stop_requested() || ctx_->shutting_down()) {
            res_ = -ECANCELED;
            never_started_ = true; // cancelled, whatever the timeout
            return true;
        }
        return false;
    }

    void await_suspend(std::coroutine_handle<> h) {
        handle_ = h;
        const bool timed = options_.timeout != wait_options::no_timeout;
        io_uring_sqe* sqe = detail::loop(*ctx_).get_sqe(timed ? 2 : 1);
        prep_(sqe);
        io_uring_sqe_set_data(sqe, static_cast<operation*>(this));
        if (timed) {
            sqe->flags |= IOSQE_IO_LINK;
            ts_ = to_kernel_timespec(options_.timeout);
            io_uring_sqe* t = io_uring_get_sqe(detail::loop(*ctx_).native_ring());
            io_uring_prep_link_timeout(t, &ts_, 0);
            io_uring_sqe_set_data64(t, ignored_user_data);
        }
        detail::loop(*ctx_).start_operation();
        gate_.arm(*ctx_, options_.stop, this, &io_awaiter::on_stop, &io_awaiter::on_resume);
    }

    // The CQE's result (bytes, revents, fd: what the operation returns), or throws
    // std::system_error naming the operation: errc::timed_out when the timeout fired,
    // errc::operation_canceled when the stop_token fired or the context is being destroyed.
    int await_resume() {
        gate_.disarm();
        int res = res_;
        if constexpr (requires { Prep::result(0); }) res = Prep::result(res);
        if (res >= 0) return res;
        int err = -res;
        if (err == ECANCELED && !never_started_ && !gate_.stop_won() &&
            options_.timeout != wait_options::no_timeout && !ctx_->shutting_down())
            err = ETIMEDOUT;
        throw_system_error(err, Prep::name);
    }

  private:
    static void complete(operation* op, int res, unsigned) noexcept {
        auto* self = static_cast<io_awaiter*>(op);
        self->res_ = res;
        detail::loop(*self->ctx_).finish_operation();
        if (self->gate_.finish()) detail::loop(*self->ctx_).ready(self->handle_);
    }
    static bool on_stop(void* owner) noexcept {
        auto* self = static_cast<io_awaiter*>(owner);
        try {
            detail::loop(*self->ctx_).cancel(self);
        } catch (...) {
            // The ring is unusable; the operation completes on its own or at destruction.
        }
        return false; // the request's CQE still has to come
    }
    static void on_resume(void* owner) noexcept {
        auto* self = static_cast<io_awaiter*>(owner);
        detail::loop(*self->ctx_).ready(self->handle_);
    }

    io_context* ctx_;
    Prep prep_;
    wait_options options_;
    std::coroutine_handle<> handle_;
    int res_ = 0;
    bool never_started_ = false; // ended in await_ready (stop requested, or the context's end)
    __kernel_timespec ts_{};
    stop_gate gate_;
};

} // namespace ringverbs::detail
