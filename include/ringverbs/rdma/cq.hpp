// cq: a completion queue on a channel whose completions coroutines co_await.
#pragma once

#include <ringverbs/config.hpp>

#include <ringverbs/engine/detail/waiter.hpp>
#include <ringverbs/engine/error.hpp>
#include <ringverbs/engine/io_context.hpp>
#include <ringverbs/rdma/channel.hpp>
#include <ringverbs/rdma/detail/rdma_state.hpp>

#include <infiniband/verbs.h>

#include <cstddef>
#include <memory>
#include <span>

namespace ringverbs {

namespace detail {
// Throws what a cq's consumer `op` ("cq::next", "cq::try_next") ends with once the cq failed:
// std::system_error with `err`, saying what EOVERFLOW (the CQ overran) and ENODEV (the device
// is gone) mean. Out of line: only failures reach it.
[[noreturn]] void throw_cq_failure(const char* op, int err);
} // namespace detail

struct cq_options {
    int entries = 1024;
    // -1: spread the channel's CQs over the device's completion vectors (round robin);
    // otherwise that vector (0 .. num_comp_vectors() - 1).
    int comp_vector = -1;
    // Arm with solicited_only: events only for receives that carry IBV_SEND_SOLICITED (and for
    // errors). Completions are still all polled whenever the CQ is serviced. Sends awaited on
    // such a CQ are refused (EINVAL), on every device. On a device that never raises the event
    // for a solicited receive (Soft-iWARP: Linux 6.1's siw completes receives without the
    // solicited flag), the CQ is armed for every completion instead, said once to the
    // diagnostics sink: more wakeups, nothing missed; armed_solicited_only() tells which.
    bool solicited_only = false;
};

// Owns an ibv_cq attached to a channel (armed at once unless the channel is in busy mode).
//
// Three ways to consume its completions, which may be mixed:
// - co_await cq.next(): the next completion whose wr_id is not one of ringverbs' per-request
//   awaits (see qp), FIFO among waiters;
// - cq.try_next(wc): the same completions without a wait (polling the CQ in place);
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

    class next_awaitable;
    class batch_awaitable;

    // co_await cq.next(): the next completion, without suspending when one is ready. A failed
    // completion is returned as it is (check wc.status): next() does not know who posted it.
    // Errors: std::system_error "cq::next" with timed_out, operation_canceled (stop_token, or
    // the cq was destroyed), the errno of a failed channel, or EOVERFLOW ("cq::next:
    // IBV_EVENT_CQ_ERR") once the CQ overran (reported by device_events), or ENODEV ("the RDMA
    // device is gone") once its device went away (see device_events, "A device that goes
    // away"); both after the completions polled before are taken. A stop requested
    // before the co_await ends it at once (operation_canceled) even with completions ready:
    // they stay buffered, in order, as recv_ring::next does.
    next_awaitable next(wait_options options = {}) noexcept;

    // co_await cq.next_batch(out): one or more completions (up to out.size()), waiting for the
    // first one like next() (and ending like it, a stop requested first included). Returns how
    // many were written to `out`.
    batch_awaitable next_batch(std::span<ibv_wc> out, wait_options options = {}) noexcept;

    // cq.try_next(wc): the completion next() would give next, without waiting: true with `wc`
    // set, or false. Buffered completions come first. With none buffered, and no next() or
    // next_batch() queued on this cq (what comes is theirs first), it polls the CQ now: a
    // per-request await's completion found on the way goes to its coroutine, which resumes on
    // a later turn. For a coroutine that polls on its own (busy mode: see io_context::yield),
    //
    //   while (!c.try_next(wc)) co_await ctx.yield();
    //
    // and to take the rest of a burst after a co_await next() without suspending again. A busy
    // channel's pass leaves a CQ that try_next polled empty to it for one turn (its completions
    // come through the consumer's poll; a next() queued after is served by the next pass). In
    // hybrid mode what try_next takes does not keep the channel's spin window open. Once
    // nothing is buffered it throws what next() would end with, as std::system_error
    // "cq::try_next" (EOVERFLOW, ENODEV, a failed channel's errno), or EIO when ibv_poll_cq
    // failed. On the thread of the cq's io_context only. After false, `wc` (and the part of
    // `out` past what was returned) may have been written.
    bool try_next(ibv_wc& wc) { return state_->pop(wc) || try_next_polled(wc); }
    // The same for up to out.size() completions; returns how many were written to `out`.
    std::size_t try_next_batch(std::span<ibv_wc> out) {
        std::size_t n = 0;
        while (n < out.size() && state_->pop(out[n]))
            ++n;
        return n > 0 || out.empty() ? n : try_next_polled(out);
    }

    // The cq's device went away (removed, or failed for good; see device_events): from now on
    // the cq gives only what was polled before (flushes of its QPs among them), then next()
    // ends with ENODEV. For a consumer that posts through verbs and sees a flush or a refused
    // post, this says why.
    bool device_lost() const noexcept { return state_->lost != nullptr; }

    const cq_counters& counters() const noexcept { return state_->counters; }
    int comp_vector() const noexcept { return state_->cq.comp_vector(); }
    int capacity() const noexcept { return state_->cq.capacity(); }
    // Armed solicited-only (cq_options::solicited_only, on a device that honours it).
    bool armed_solicited_only() const noexcept { return state_->arm_solicited; }
    ibv_cq* native() const noexcept { return state_->cq.native(); }
    const verbs::completion_queue& native_cq() const noexcept { return state_->cq; }
    // Completions buffered for next() consumers.
    std::size_t buffered() const noexcept { return state_->count; }

  private:
    friend class qp;
    // try_next's and try_next_batch's halves that poll: nothing was buffered.
    bool try_next_polled(ibv_wc& wc);
    std::size_t try_next_polled(std::span<ibv_wc> out);

    // What next() and next_batch() share: waits until completions are buffered for next()
    // consumers, then takes up to `capacity` of them.
    class completion_wait : detail::completion_waiter {
      public:
        completion_wait(const completion_wait&) = delete;
        completion_wait& operator=(const completion_wait&) = delete;
        bool await_ready() noexcept {
            // A stop requested before the co_await wins over completions ready (as in
            // recv_ring::next): they stay buffered, in order, for the next consumer.
            if (options_.stop.stop_requested()) {
                stopped_ = true;
                return true;
            }
            while (taken < capacity && state_->pop(out[taken]))
                ++taken;
            return taken > 0 || state_->closed || state_->error != 0 ||
                   (state_->channel && state_->channel->error != 0);
        }
        void await_suspend(std::coroutine_handle<> h) {
            state_->polled_by_consumer = false; // a busy pass polls for this waiter at once
            wait_in(state_->waiters, *state_->channel->ctx, options_, h);
        }

      protected:
        completion_wait(detail::cq_state* state, ibv_wc* out, std::size_t capacity,
                        wait_options options) noexcept
            : state_(state), options_(std::move(options)) {
            this->out = out;
            this->capacity = capacity;
        }
        // How many completions were written to out; throws when the wait failed.
        std::size_t take() {
            // Decided (the source fulfilled or failed it, or the deadline or stop came): the
            // outcome is in this object, and *state_ is not touched any more, because the cq
            // may have been destroyed by a coroutine that resumed before this one.
            if (decided()) {
                if (const int err = error(); err != 0) fail_with(err);
                return taken;
            }
            // Ready at once (await_ready), without suspending: *state_ is alive.
            if (stopped_)
                throw_system_error(ECANCELED, "cq::next (stop requested; completions ready stay "
                                              "buffered)");
            if (taken == 0) {
                fail_with(state_->closed       ? ECANCELED
                          : state_->error != 0 ? state_->error
                                               : state_->channel->error);
            }
            return taken;
        }
        [[noreturn]] static void fail_with(int err) { detail::throw_cq_failure("cq::next", err); }

      private:
        detail::cq_state* state_;
        wait_options options_;
        bool stopped_ = false; // its stop was requested before it waited
    };

    std::shared_ptr<detail::cq_state> state_;
};

// cq::next_awaitable: returned by cq::next(); co_await gives the next ibv_wc (see next()).
// Awaited in place, not moved.
class cq::next_awaitable : public cq::completion_wait {
  public:
    ibv_wc await_resume() {
        take();
        return wc_;
    }

  private:
    friend class cq;
    next_awaitable(detail::cq_state* state, wait_options options) noexcept
        : completion_wait(state, &wc_, 1, std::move(options)) {}
    ibv_wc wc_{};
};

// cq::batch_awaitable: returned by cq::next_batch(); co_await gives how many completions were
// written to the span (at least one; see next_batch()). Awaited in place, not moved.
class cq::batch_awaitable : public cq::completion_wait {
  public:
    std::size_t await_resume() { return take(); }

  private:
    friend class cq;
    using completion_wait::completion_wait;
};

inline cq::next_awaitable cq::next(wait_options options) noexcept {
    return {state_.get(), std::move(options)};
}

inline cq::batch_awaitable cq::next_batch(std::span<ibv_wc> out, wait_options options) noexcept {
    return {state_.get(), out.data(), out.size(), std::move(options)};
}

} // namespace ringverbs
