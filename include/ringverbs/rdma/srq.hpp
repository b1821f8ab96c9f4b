// srq: a shared receive queue. Many QPs (made with qp_options::shared_receive_queue, or
// cm_id::make_qp with it) take their receives from one pool, so registered memory grows with the
// traffic, not with the number of connections.
#pragma once

#include <ringverbs/config.hpp>

#include <ringverbs/engine/detail/wait_core.hpp>
#include <ringverbs/engine/detail/waiter.hpp>
#include <ringverbs/engine/io_context.hpp>
#include <ringverbs/rdma/buffers.hpp>
#include <ringverbs/rdma/detail/srq_state.hpp>
#include <ringverbs/verbs/protection_domain.hpp>

#include <infiniband/verbs.h>

#include <coroutine>
#include <cstdint>
#include <memory>

namespace ringverbs {

struct srq_options {
    std::uint32_t max_wr = 1024; // receives the SRQ holds at once
    std::uint32_t max_sge = 1;
};

// Owns an ibv_srq on `pd`'s device. Two ways to receive from it, which may be mixed:
// - co_await srq.recv(buffer): one receive, resumed by its own completion (which names, in
//   qp_num, the QP that took it), like qp::recv;
// - srq.post_recv(buffer, wr_id): a receive of a pool; its completion goes to cq::next() of the
//   receive CQ of the QP that took it (check wc.qp_num and wc.wr_id).
// co_await srq.low_water(n) resumes when fewer than n receives are left posted, so that a
// refiller coroutine sleeps until the pool runs low; several may wait, each with its own n
// (see low_water()).
//
// The receive CQs of the QPs on an SRQ must hold what it can complete at once: give them at
// least max_wr entries more than their QPs' send queues need.
//
// Lifetime: the handles may go in any order; the SRQ lives while a qp receives from it. A
// posted receive cannot be recalled (a stop or timeout has nothing to cancel, so recv takes
// none): it ends by its completion, by its QP's flush once a QP took it and failed, or, when
// the srq handle and every qp on it are gone, with a made-up IBV_WC_WR_FLUSH_ERR. When the
// device goes (ENODEV) or a completion channel of one of its qps' receive CQs fails (that
// errno, see channel::error()), every qp on it is reset, what is owed ends at once with that
// error, and later posts and new qps on it are refused. The receives the device still holds
// stay posted in the SRQ: a qp brought back to RTR through native_qp() could take them. The
// low_water() waits end with the handle (ECANCELED), whether or not the SRQ lives on. Destroy
// before the io_context, on its thread.
class srq {
  public:
    class request;
    class low_water_awaitable;

    // Throws std::system_error naming ibv_create_srq (EINVAL: beyond the device's limits).
    srq(io_context& ctx, const verbs::protection_domain& pd, srq_options options = {});
    ~srq();
    srq(const srq&) = delete;
    srq& operator=(const srq&) = delete;

    // co_await srq.recv(into): posts one receive at co_await and gives its completion. A failed
    // completion throws completion_error (IBV_WC_WR_FLUSH_ERR when its QP failed or the SRQ
    // went), a post failure std::system_error naming ibv_post_srq_recv (ENOMEM: full).
    request recv(local_buffer into) noexcept;
    // Posts a receive whose completion goes to cq::next() with `wr_id` (top bit clear, else
    // EINVAL: those wr_ids are ringverbs'). Throws std::system_error naming ibv_post_srq_recv.
    void post_recv(local_buffer into, std::uint64_t wr_id);
    // co_await srq.low_water(n): resumes once fewer than n receives are posted. At once when
    // posted() is below n already (the device raises its limit event only when it takes a
    // receive: a limit armed below what it holds would never fire). Else it waits for the
    // first of: polled completions bring posted() below n; the device's
    // IBV_EVENT_SRQ_LIMIT_REACHED (which needs a device_events watching the device) for a
    // limit of at most n. One limit serves every waiter: when none is armed, the wait arms it
    // (ibv_modify_srq) at the largest n waiting; its event resumes the waiters whose n is at
    // least that limit (and those posted() has crossed), and the SRQ is armed again for the
    // largest n still waiting. An armed limit is never replaced (its event could already be on
    // the way and be taken for the new one's): a wait for a larger n meanwhile ends by the
    // count. So no wait resumes before fewer than its own n are posted, whatever the order of
    // the waits and their n. No allocation. n is at least 1: fewer than 0 are never
    // posted (and a limit of 0 disarms the SRQ), so low_water(0) throws EINVAL at once rather
    // than wait for ever. Throws std::system_error "srq::low_water" with EINVAL (n == 0),
    // timed_out / operation_canceled per `w`, ECANCELED when this srq handle goes (even while
    // qps still receive from the SRQ), EIO after IBV_EVENT_SRQ_ERR, ENODEV or a failed
    // channel's errno (see the lifetime above), or naming ibv_modify_srq.
    low_water_awaitable low_water(std::uint32_t n, wait_options w = {}) noexcept;

    ibv_srq* native() const noexcept { return state_->srq.get(); }
    std::uint32_t capacity() const noexcept { return state_->max_wr; }
    // Per-request receives posted and not yet completed.
    std::size_t pending() const noexcept { return state_->pending_count; }
    // Receives posted through this srq (recv and post_recv) whose completion has not been
    // polled yet, as low_water() counts them: never less than the device holds. A pool
    // receive counts as completed when a receive CQ of a qp on this srq polls its completion;
    // a failed one only where that CQ is not also the qp's send CQ (a failed completion does
    // not say whether it was a receive). Receives posted on native() are not counted.
    std::size_t posted() const noexcept { return state_->posted; }
    // IBV_EVENT_SRQ_LIMIT_REACHED events routed to this srq so far.
    std::uint64_t limit_events() const noexcept { return state_->limit_events; }

  private:
    friend class qp;
    std::shared_ptr<detail::srq_state> state_;
};

// srq::request: one receive of srq::recv(); co_await posts it and gives its ibv_wc. Awaited in
// place, not moved (its address is the receive's wr_id).
class srq::request : detail::wr_op, detail::wait_core {
  public:
    request(const request&) = delete;
    request& operator=(const request&) = delete;
    bool await_ready() const noexcept { return false; }
    // Posts the receive (throws std::system_error naming ibv_post_srq_recv, nothing posted).
    void await_suspend(std::coroutine_handle<> h);
    ibv_wc await_resume();

  private:
    friend class srq;
    request(detail::srq_state* state, local_buffer into) noexcept;
    static void completed(wr_op* op, const ibv_wc& wc, bool last) noexcept;
    static bool never_interrupted(wait_core*, int) noexcept { return false; }

    detail::srq_state* state_; // alive while this receive is owed
    io_context* ctx_;
    ibv_recv_wr wr_{};
    ibv_sge sge_{};
    ibv_wc result_{};
};

// srq::low_water_awaitable: returned by srq::low_water(); co_await resumes once fewer receives
// than asked are posted (see low_water()). Awaited in place, not moved.
class srq::low_water_awaitable : detail::srq_low_water_waiter {
  public:
    low_water_awaitable(const low_water_awaitable&) = delete;
    low_water_awaitable& operator=(const low_water_awaitable&) = delete;
    // Decided at once when fewer than asked are posted already (no event would come), and
    // for n == 0, which is refused.
    bool await_ready() const noexcept {
        return below == 0 || state_->error != 0 || state_->posted < below;
    }
    // Arms the limit unless one is armed (throws std::system_error naming ibv_modify_srq,
    // nothing queued) and waits.
    void await_suspend(std::coroutine_handle<> h);
    void await_resume();

  private:
    friend class srq;
    low_water_awaitable(detail::srq_state* state, std::uint32_t n, wait_options w) noexcept
        : state_(state), options_(std::move(w)) {
        below = n;
    }

    detail::srq_state* state_;
    wait_options options_;
};

} // namespace ringverbs
