// device_events: a device's asynchronous events (QP and CQ errors, port state, device fatal)
// on an io_context. The context's async_fd is watched by a multishot io_uring poll; each event
// is read, routed to the ringverbs object it names, acked at once, and handed to co_await next().
#pragma once

#include <ringverbs/config.hpp>

#include <ringverbs/engine/detail/fd_watch.hpp>
#include <ringverbs/engine/detail/waiter.hpp>
#include <ringverbs/engine/error.hpp>
#include <ringverbs/engine/io_context.hpp>
#include <ringverbs/rdma/detail/device_loss.hpp>
#include <ringverbs/verbs/context.hpp>

#include <infiniband/verbs.h>

#include <cstdint>
#include <deque>
#include <memory>

namespace ringverbs {

// One asynchronous event, copied out before it was acked. The pointers identify the object
// (compare them with cq::native(), qp::native_qp().native()): it may be gone by the time you
// look, so do not dereference them.
struct async_event {
    ibv_event_type type = IBV_EVENT_DEVICE_FATAL;
    ibv_cq* cq = nullptr;     // CQ_ERR
    ibv_qp* qp = nullptr;     // QP_FATAL, QP_REQ_ERR, QP_ACCESS_ERR, COMM_EST, SQ_DRAINED,
                              // PATH_MIG, PATH_MIG_ERR, QP_LAST_WQE_REACHED
    std::uint32_t qp_num = 0; // of `qp`
    ibv_srq* srq = nullptr;   // SRQ_ERR, SRQ_LIMIT_REACHED
    int port = 0;             // PORT_ACTIVE, PORT_ERR, LID/PKEY/GID_CHANGE, SM_CHANGE, ...
    // The event reached the ringverbs cq, qp or srq it names (see device_events): acted on at
    // once when the object belongs to this io_context, or handed to its own io_context.
    bool routed = false;
    const char* name() const noexcept { return ibv_event_type_str(type); }
};

struct device_events_counters {
    std::uint64_t wakeups = 0; // times the async fd was reported readable
    std::uint64_t events = 0;  // events read (each acked at once)
    std::uint64_t routed = 0;  // of those, handed to a ringverbs cq, qp or srq
    // of `routed`, posted to another io_context (the object's owner thread)
    std::uint64_t routed_to_other_threads = 0;
};

// Watches `device`'s async events on `ctx` (the fd is made O_NONBLOCK). One per ibv_context:
// a second one on the same context throws (EBUSY).
//
// Routing, before next() sees the event, for the cqs, qps and srqs made on this ibv_context,
// whichever io_context owns them (librdmacm gives every id of a device one ibv_context, so one
// watcher serves every thread's connections). An object of this io_context is acted on at
// once; another thread's is handed to its owner with io_context::post() and acted on there
// when that loop next runs (if the object still exists then):
// - IBV_EVENT_CQ_ERR (the CQ overran: completions are lost): the cq's next() waiters resume
//   with std::system_error(EOVERFLOW) "cq::next: IBV_EVENT_CQ_ERR", and so does every later
//   next() once the completions polled before are taken;
//   every qp using that CQ is moved to the error state.
// - IBV_EVENT_QP_FATAL, QP_REQ_ERR, QP_ACCESS_ERR: the qp is moved to the error state (if the
//   device has not), so its pending awaits resume with their flush completions.
// - IBV_EVENT_SRQ_LIMIT_REACHED: the srq's low_water() waiters resume; SRQ_ERR fails them.
// - the others only go to next().
// Every event is acked right after it was copied, so no ibv_destroy_cq/qp ever waits for us.
//
// Lifetime: destroy before the io_context, on its thread; pending next() calls resume with
// operation_canceled.
class device_events {
  public:
    // Throws std::system_error naming fcntl (the async fd), io_uring_submit, or
    // "device_events" with EBUSY when the context is already watched.
    device_events(io_context& ctx, const verbs::context& device);
    ~device_events();
    device_events(const device_events&) = delete;
    device_events& operator=(const device_events&) = delete;

    class next_awaitable;

    // co_await events.next(): the next async event, without suspending when one is queued.
    // Errors: std::system_error "device_events::next" with timed_out, operation_canceled, or
    // the errno of a failed watch.
    next_awaitable next(wait_options options = {}) noexcept;

    const device_events_counters& counters() const noexcept { return state_->counters; }
    // Events read and not yet taken by next().
    std::size_t queued() const noexcept { return state_->queue.size(); }

  private:
    // Tells this watcher that its device is gone (see detail::device_lost).
    friend std::size_t detail::device_events_lost(ibv_context* device, const char* cause) noexcept;

    struct state {
        io_context* ctx = nullptr;
        std::shared_ptr<ibv_context> device;
        detail::fd_watch* watch = nullptr;
        std::deque<async_event> queue;
        detail::waiter_queue waiters;
        device_events_counters counters;
        int error = 0;
        const char* lost_cause = nullptr; // error is ENODEV: the device went away (why)
        bool closed = false;

        void drain() noexcept;
        void lost(const char* cause) noexcept;
        void hand_to_next(const async_event& e) noexcept;
        void route(async_event& e) noexcept;
        template <typename Object, typename State, typename Apply>
        bool deliver(Object* object, State& s, io_context& owner, std::uint64_t generation,
                     Apply apply) noexcept;
        void fail(int err) noexcept;
    };

    std::unique_ptr<state> state_;
};

// device_events::next_awaitable: returned by device_events::next(); co_await gives the next
// async_event (see next()). Awaited in place, not moved.
class device_events::next_awaitable : detail::waiter {
  public:
    next_awaitable(const next_awaitable&) = delete;
    next_awaitable& operator=(const next_awaitable&) = delete;
    bool await_ready() noexcept {
        if (!state_->queue.empty()) {
            event = state_->queue.front();
            state_->queue.pop_front();
            has = true;
        }
        return has || state_->closed || state_->error != 0;
    }
    void await_suspend(std::coroutine_handle<> h) {
        wait_in(state_->waiters, *state_->ctx, options_, h);
    }
    async_event await_resume() {
        const int err = decided() ? error() : 0;
        if (!has) {
            const int e = err != 0 ? err : state_->closed ? ECANCELED : state_->error;
            if (e == ENODEV)
                throw_system_error(e, "device_events::next: the RDMA device is gone (removed, or "
                                      "failed for good)");
            throw_system_error(e, "device_events::next");
        }
        return event;
    }

  private:
    friend class device_events;
    friend struct device_events::state; // drain() hands an event over: `event`, `has`
    next_awaitable(state* s, wait_options options) noexcept
        : state_(s), options_(std::move(options)) {}

    state* state_;
    wait_options options_;
    async_event event;
    bool has = false; // `event` is set (taken from the queue, or handed over by drain())
};

inline device_events::next_awaitable device_events::next(wait_options options) noexcept {
    return {state_.get(), std::move(options)};
}

} // namespace ringverbs
