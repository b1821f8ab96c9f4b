// cq: a completion queue on a channel whose completions coroutines co_await.
#pragma once

#include <ringverbs/config.hpp>

#include <ringverbs/rdma/channel.hpp>
#include <ringverbs/rdma/detail/rdma_state.hpp>
#include <ringverbs/engine/detail/waiter.hpp>
#include <ringverbs/engine/error.hpp>
#include <ringverbs/engine/io_context.hpp>

#include <infiniband/verbs.h>

#include <cstddef>
#include <memory>
#include <span>

namespace ringverbs {

struct cq_options {
    int entries = 1024;
    // -1: spread the channel's CQs over the device's completion vectors (round robin);
    // otherwise that vector (0 .. num_comp_vectors() - 1).
    int comp_vector = -1;
    // Arm with solicited_only: events only for receives that carry IBV_SEND_SOLICITED (and for
    // errors). Completions are still all polled whenever the CQ is serviced.
    bool solicited_only = false;
};

// Owns an ibv_cq attached to a channel (armed at once unless the channel is in busy mode).
//
// Two ways to consume its completions, which may be mixed:
// - co_await cq.next(): the next completion whose wr_id is not one of ringverbs' per-request
//   awaits (see qp), FIFO among waiters;
// - the per-request awaits of qp: their completions go straight to the coroutine that posted.
//
// Lifetime: the state lives while a qp uses it; destroying the handle resumes pending next()
// calls with operation_canceled. Destroy before the io_context, on its thread.
class cq {
public:
    // Throws std::system_error naming ibv_create_cq (EINVAL: comp_vector out of range or too
    // many entries; ENOMEM: out of resources) or ibv_req_notify_cq.
    explicit cq(channel& ch, cq_options options = {});
    ~cq();
    cq(const cq&) = delete;
    cq& operator=(const cq&) = delete;

    // co_await cq.next(): the next completion, without suspending when one is ready. A failed
    // completion is returned as it is (check wc.status): next() does not know who posted it.
    // Errors: std::system_error "cq::next" with timed_out, operation_canceled (stop_token, or
    // the cq was destroyed), the errno of a failed channel, or EOVERFLOW ("cq::next:
    // IBV_EVENT_CQ_ERR") once the CQ overran (reported by device_events).
    auto next(wait_options options = {}) noexcept;

    // co_await cq.next_batch(out): one or more completions (up to out.size()), waiting for the
    // first one like next(). Returns how many were written to `out`.
    auto next_batch(std::span<ibv_wc> out, wait_options options = {}) noexcept;

    const cq_counters& counters() const noexcept { return state_->counters; }
    int comp_vector() const noexcept { return state_->cq.comp_vector(); }
    int capacity() const noexcept { return state_->cq.capacity(); }
    ibv_cq* native() const noexcept { return state_->cq.native(); }
    const verbs::completion_queue& native_cq() const noexcept { return state_->cq; }
    // Completions buffered for next() consumers.
    std::size_t buffered() const noexcept { return state_->count; }

private:
    friend class qp;
    friend struct detail::cq_state;

    struct batch_awaiter : detail::waiter {
        detail::cq_state* s;
        ibv_wc* out;
        std::size_t capacity;
        std::size_t n = 0;
        wait_options options;

        batch_awaiter(detail::cq_state* st, ibv_wc* o, std::size_t cap, wait_options opts) noexcept
            : s(st), out(o), capacity(cap), options(std::move(opts)) {}
        bool await_ready() noexcept {
            while (n < capacity && s->pop(out[n])) ++n;
            return n > 0 || s->closed || s->error != 0 || (s->channel && s->channel->error != 0);
        }
        void await_suspend(std::coroutine_handle<> h) {
            s->waiters.push_back(this);
            start(*s->channel->ctx, options, h, s, &cq::detach);
        }
        std::size_t take() {
            // Decided (the source fulfilled or failed it, or the deadline or stop came): the
            // outcome is in this object, and *s is not touched any more, because the cq may
            // have been destroyed by a coroutine that resumed before this one.
            if (decided()) {
                const int err = error();
                if (err == EOVERFLOW) throw_system_error(err, "cq::next: IBV_EVENT_CQ_ERR (the CQ overran)");
                if (err != 0) throw_system_error(err, "cq::next");
                return n;
            }
            // Ready at once (await_ready), without suspending: *s is alive.
            if (n == 0) {
                const int err = s->closed ? ECANCELED : s->error != 0 ? s->error : s->channel->error;
                if (err == EOVERFLOW) throw_system_error(err, "cq::next: IBV_EVENT_CQ_ERR (the CQ overran)");
                throw_system_error(err, "cq::next");
            }
            return n;
        }
    };
    struct next_awaiter : batch_awaiter {
        ibv_wc wc{};
        next_awaiter(detail::cq_state* st, wait_options opts) noexcept
            : batch_awaiter(st, &wc, 1, std::move(opts)) {}
        next_awaiter(const next_awaiter&) = delete;
        ibv_wc await_resume() {
            take();
            return wc;
        }
    };
    struct many_awaiter : batch_awaiter {
        using batch_awaiter::batch_awaiter;
        std::size_t await_resume() { return take(); }
    };

    static void detach(void* source, detail::waiter* w) noexcept;

    std::shared_ptr<detail::cq_state> state_;
};

inline auto cq::next(wait_options options) noexcept {
    return next_awaiter{state_.get(), std::move(options)};
}

inline auto cq::next_batch(std::span<ibv_wc> out, wait_options options) noexcept {
    return many_awaiter{state_.get(), out.data(), out.size(), std::move(options)};
}

} // namespace ringverbs
