// waiter: a coroutine queued on a source of events (a multishot poll stream; later a CQ's
// next()), with an optional deadline and stop_token.
#pragma once

#include <ringverbs/detail/config.hpp>

#include <ringverbs/detail/io_awaiter.hpp>
#include <ringverbs/detail/operation.hpp>
#include <ringverbs/detail/stop_gate.hpp>
#include <ringverbs/io_context.hpp>

#include <cerrno>
#include <coroutine>

namespace ringverbs::detail {

// Exactly one of three things decides a waiter: the source fulfils it, its deadline passes,
// or its stop_token fires. Whoever decides first unlinks it from the source's queue (the
// source before calling fulfil(); the deadline and the stop through detach()). The waiter is
// resumed once decided AND its timer request (an IORING_OP_TIMEOUT whose user_data is the
// waiter) has delivered its CQE, so the kernel never touches a dead waiter.
class waiter : operation {
public:
    using detach_fn = void (*)(void* source, waiter* w) noexcept;

    waiter* prev = nullptr; // the source's queue links, owned by the source
    waiter* next = nullptr;

    waiter() noexcept { on_cqe = &waiter::timer_fired; }
    waiter(const waiter&) = delete;
    waiter& operator=(const waiter&) = delete;

    // Starts waiting: call after linking into the source's queue. When it throws (no SQE for
    // the timer: std::system_error naming io_uring_submit) it has unlinked the waiter again
    // through `detach` and counted nothing: the co_await throws, nothing refers to it.
    void start(io_context& ctx, const wait_options& options, std::coroutine_handle<> h,
               void* source, detach_fn detach) {
        ctx_ = &ctx;
        handle_ = h;
        source_ = source;
        detach_ = detach;
        io_uring_sqe* sqe = nullptr;
        if (options.timeout != wait_options::no_timeout) {
            try {
                sqe = ctx.get_sqe();
            } catch (...) {
                detach_(source_, this);
                throw;
            }
        }
        ctx.add_waiter();
        if (sqe) {
            ts_ = to_kernel_timespec(options.timeout);
            io_uring_prep_timeout(sqe, &ts_, 0, 0);
            io_uring_sqe_set_data(sqe, static_cast<operation*>(this));
            timer_pending_ = true;
            ctx.start_operation();
        }
        gate_.arm(ctx, options.stop, this, &waiter::on_stop, &waiter::on_resume);
    }

    // The source gives the waiter its outcome (0, or a positive errno), after unlinking it.
    void fulfil(int error) noexcept {
        decided_ = true;
        error_ = error;
        if (timer_pending_) cancel_timer();
        else finish();
    }

    bool decided() const noexcept { return decided_; }

    // 0, or the errno that ended the wait (ETIMEDOUT, ECANCELED, or the source's error).
    int error() noexcept {
        gate_.disarm();
        return error_;
    }

private:
    void finish() noexcept {
        if (gate_.finish()) resume();
    }
    void resume() noexcept {
        ctx_->remove_waiter();
        ctx_->ready(handle_);
    }
    void cancel_timer() noexcept {
        try {
            ctx_->cancel(this);
        } catch (...) {
            // The ring is unusable: the timer still fires on its own.
        }
    }
    static void timer_fired(operation* op, int, unsigned) noexcept {
        auto* self = static_cast<waiter*>(op);
        self->timer_pending_ = false;
        self->ctx_->finish_operation();
        if (!self->decided_) {
            self->decided_ = true;
            self->error_ = self->ctx_->shutting_down() ? ECANCELED : ETIMEDOUT;
            self->detach_(self->source_, self);
        }
        self->finish();
    }
    static bool on_stop(void* owner) noexcept {
        auto* self = static_cast<waiter*>(owner);
        if (!self->decided_) {
            self->decided_ = true;
            self->error_ = ECANCELED;
            self->detach_(self->source_, self);
        }
        if (self->timer_pending_) {
            self->cancel_timer();
            return false;
        }
        return true;
    }
    static void on_resume(void* owner) noexcept { static_cast<waiter*>(owner)->resume(); }

    io_context* ctx_ = nullptr;
    std::coroutine_handle<> handle_;
    void* source_ = nullptr;
    detach_fn detach_ = nullptr;
    int error_ = 0;
    bool decided_ = false;
    bool timer_pending_ = false;
    __kernel_timespec ts_{};
    stop_gate gate_;
};

// An intrusive FIFO of waiters. Not thread-safe: the source lives on one context's thread.
class waiter_queue {
public:
    bool empty() const noexcept { return head_ == nullptr; }
    void push_back(waiter* w) noexcept {
        w->next = nullptr;
        w->prev = tail_;
        if (tail_) tail_->next = w;
        else head_ = w;
        tail_ = w;
    }
    waiter* pop_front() noexcept {
        waiter* w = head_;
        if (w) remove(w);
        return w;
    }
    // A waiter::detach_fn for waiters whose source is a waiter_queue.
    static void detach(void* queue, waiter* w) noexcept { static_cast<waiter_queue*>(queue)->remove(w); }
    void remove(waiter* w) noexcept {
        if (w->prev) w->prev->next = w->next;
        else head_ = w->next;
        if (w->next) w->next->prev = w->prev;
        else tail_ = w->prev;
        w->prev = w->next = nullptr;
    }

private:
    waiter* head_ = nullptr;
    waiter* tail_ = nullptr;
};

} // namespace ringverbs::detail
