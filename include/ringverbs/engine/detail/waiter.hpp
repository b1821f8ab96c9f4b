// waiter: a coroutine queued on a source of events (a multishot poll stream, a CQ's next(), an
// rdma_cm id, device events), with an optional deadline and stop_token.
#pragma once

#include <ringverbs/config.hpp>

#include <ringverbs/engine/detail/wait_core.hpp>
#include <ringverbs/engine/io_context.hpp>

#include <coroutine>

namespace ringverbs::detail {

class waiter_queue;

// A coroutine queued on a source (a CQ's next(), a poll stream, an rdma_cm id, device events,
// qp::close()). Exactly one of three things decides it: the source fulfils it, its deadline
// passes, or its stop_token fires. Whoever decides first unlinks it from the source's queue
// (the source before calling fulfil(); the deadline and the stop through the detach function).
// The rest (resumed once decided and once its timer's CQE came) is wait_core's.
class waiter : wait_core {
  public:
    using detach_fn = void (*)(void* source, waiter* w) noexcept;

    waiter* prev = nullptr; // the source's queue links, owned by the source
    waiter* next = nullptr;

    waiter() noexcept = default;

    // Starts waiting: call after linking into the source's queue. When it throws (no SQE for
    // the timer: std::system_error naming io_uring_submit) it has unlinked the waiter again
    // through `detach` and counted nothing: the co_await throws, nothing refers to it.
    void start(io_context& ctx, const wait_options& options, std::coroutine_handle<> h,
               void* source, detach_fn detach) {
        source_ = source;
        detach_ = detach;
        bool timer = false;
        try {
            timer = reserve_timer(ctx, options);
        } catch (...) {
            detach_(source_, this);
            throw;
        }
        begin_wait(ctx, options, timer, h, &waiter::interrupted_by);
    }

    // The form of every source whose waiters sit in one waiter_queue: links this waiter at
    // the end of `queue`, then start()s (which unlinks it again when it throws).
    void wait_in(waiter_queue& queue, io_context& ctx, const wait_options& options,
                 std::coroutine_handle<> h);

    // The source gives the waiter its outcome (0, or a positive errno), after unlinking it.
    void fulfil(int error) noexcept { decide(error); }

    // True once suspended and decided (false for an await that was ready at once).
    bool decided() const noexcept { return wait_phase() == phase::decided; }

    // After resuming: 0, or the errno that ended the wait (ETIMEDOUT, ECANCELED, or the
    // source's error).
    int error() noexcept { return finish_wait(); }

  private:
    // The deadline or the stop came first: leave the source's queue, end with that reason.
    static bool interrupted_by(wait_core* core, int) noexcept {
        auto* self = static_cast<waiter*>(core);
        self->detach_(self->source_, self);
        return true;
    }

    void* source_ = nullptr;
    detach_fn detach_ = nullptr;
};

// An intrusive FIFO of waiters. Not thread-safe: the source lives on one context's thread.
class waiter_queue {
  public:
    bool empty() const noexcept { return head_ == nullptr; }
    // The first waiter (or null), for a source that decides some of its waiters only: walk on
    // through waiter::next, read before remove().
    waiter* front() const noexcept { return head_; }
    void push_back(waiter* w) noexcept {
        w->next = nullptr;
        w->prev = tail_;
        if (tail_)
            tail_->next = w;
        else
            head_ = w;
        tail_ = w;
    }
    waiter* pop_front() noexcept {
        waiter* w = head_;
        if (w) remove(w);
        return w;
    }
    // A waiter::detach_fn for waiters whose source is a waiter_queue.
    static void detach(void* queue, waiter* w) noexcept {
        static_cast<waiter_queue*>(queue)->remove(w);
    }
    void remove(waiter* w) noexcept {
        if (w->prev)
            w->prev->next = w->next;
        else
            head_ = w->next;
        if (w->next)
            w->next->prev = w->prev;
        else
            tail_ = w->prev;
        w->prev = w->next = nullptr;
    }

  private:
    waiter* head_ = nullptr;
    waiter* tail_ = nullptr;
};

inline void waiter::wait_in(waiter_queue& queue, io_context& ctx, const wait_options& options,
                            std::coroutine_handle<> h) {
    queue.push_back(this);
    start(ctx, options, h, &queue, &waiter_queue::detach);
}

} // namespace ringverbs::detail
