// The runtime's state behind a qp (detail::qp_state): its creation on the CQs, what it owes,
// the sink of its unsignaled sends, the error state and the bounded flush, the reset that
// ends what is owed, the cut off when a channel fails, and teardown. qp_request.cpp holds the
// awaitable request, qp.cpp the handle and its request builders.
#include <ringverbs/engine/diagnostics.hpp>
#include <ringverbs/rdma/qp.hpp>

#include <ringverbs/rdma/detail/object_registry.hpp>
#include <ringverbs/rdma/detail/outcome.hpp>
#include <ringverbs/rdma/srq.hpp>
#include <ringverbs/verbs/detail/verbs_hooks.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>

namespace ringverbs {

namespace detail {

using verbs::detail::hooks;

qp_state::qp_state(const verbs::protection_domain& pd, std::shared_ptr<cq_state> scq,
                   std::shared_ptr<cq_state> rcq, std::shared_ptr<srq_state> shared,
                   const verbs::qp_caps& caps, std::chrono::nanoseconds flush_timeout,
                   bool overcommit)
    : qp_state(scq, rcq, shared,
               verbs::queue_pair(pd, scq->cq, rcq->cq, caps, false,
                                 shared ? shared->srq.get() : nullptr),
               flush_timeout, overcommit) {}

namespace {

// EINVAL when the QPs on `c` could hold more requests than it has entries.
void check_commitment(const cq_state& c, std::size_t adding, const char* what) {
    const auto capacity = static_cast<std::size_t>(c.cq.capacity());
    if (c.committed + adding <= capacity) return;
    throw_system_error(
        EINVAL,
        "qp: its CQ has " + std::to_string(capacity) +
            " entries but the QPs on it could "
            "have " +
            std::to_string(c.committed + adding) + " requests outstanding (this one " +
            std::to_string(adding) + " " + what + ", the others " + std::to_string(c.committed) +
            "): a QP error flushes them all at once and overruns it. Give the CQ more entries "
            "(cq_options::entries) or set qp_options::allow_cq_overcommit");
}

} // namespace

qp_state::qp_state(std::shared_ptr<cq_state> scq, std::shared_ptr<cq_state> rcq,
                   std::shared_ptr<srq_state> shared, verbs::queue_pair q,
                   std::chrono::nanoseconds timeout, bool overcommit)
    : send_cq(std::move(scq)), recv_cq(std::move(rcq)), srq(std::move(shared)), qp(std::move(q)),
      ctx(send_cq->channel->ctx), flush_timeout(timeout) {
    // A QP is served by one loop: its completions, posts, flush timer and teardown touch its
    // owed-request list, and the channel lists a violation puts it on, without a lock.
    if (send_cq->channel->ctx != recv_cq->channel->ctx)
        throw_system_error(EINVAL, "qp: its send CQ and its receive CQ belong to two "
                                   "io_contexts; a QP is served by one loop (one thread): give "
                                   "it CQs of channels of one io_context");
    // An srq and its qps are served by one loop: a device's loss, an SRQ limit event and the
    // srq's own bookkeeping act on both without a lock.
    if (srq && srq->ctx != ctx)
        throw_system_error(EINVAL, "qp: the srq (qp_options::shared_receive_queue) belongs to "
                                   "another io_context than the qp's CQs");
    // Nothing of a QP on a failed channel's CQ could be read (channel_state::fail).
    for (const cq_state* c : {send_cq.get(), recv_cq.get()})
        if (const int err = c->channel->error; err != 0)
            throw_system_error(err, "qp: a completion channel of its CQs failed, so nothing of "
                                    "the QP's could complete (channel::error())");
    if (srq && srq->channel_failed != 0)
        throw_system_error(srq->channel_failed,
                           "qp: a completion channel of its srq's receive CQs failed, so no "
                           "receive of the srq could complete (channel::error())");
    if (srq) srq->attach(recv_cq); // may throw
    sink.owner = this;
    sink.on_wc = &qp_state::sink_completed;
    flush_timer.owner = this;
    flush_timer.on_cqe = &qp_state::flush_timer_fired;
    signal_interval = std::clamp<std::uint32_t>(qp.caps().max_send_wr / 4, 1, 64);
    committed_send = qp.caps().max_send_wr;
    committed_recv = srq ? 0 : qp.caps().max_recv_wr; // an SRQ's receives: see srq
    if (!overcommit) {
        if (send_cq == recv_cq) {
            check_commitment(*send_cq, committed_send + committed_recv, "sends and receives");
        } else {
            check_commitment(*send_cq, committed_send, "sends");
            check_commitment(*recv_cq, committed_recv, "receives");
        }
    }
    send_cq->committed += committed_send;
    recv_cq->committed += committed_recv;
    send_cq->qps.push_back(this);
    if (recv_cq != send_cq) recv_cq->qps.push_back(this);
    try {
        if (srq) // its receives' completions count on the SRQ (srq::posted)
            recv_cq->srq_qps.insert_or_assign(
                qp.qp_num(), cq_state::srq_receiver{srq.get(), send_cq != recv_cq});
        register_object(qp.native(), this); // for device_events' routing
    } catch (...) {
        send_cq->committed -= committed_send;
        recv_cq->committed -= committed_recv;
        std::erase(send_cq->qps, this);
        std::erase(recv_cq->qps, this);
        if (srq) recv_cq->srq_qps.erase(qp.qp_num());
        throw;
    }
}

qp_state::~qp_state() {
    unregister_object(qp.native());
    if (watch_deferred)
        for (qp_state** at = &recv_cq->channel->deferred_watches; *at; at = &(*at)->deferred_next)
            if (*at == this) {
                *at = deferred_next;
                break;
            }
    while (waiter* w = close_waiters.pop_front())
        w->fulfil(ECANCELED);
    // release() keeps the state until nothing is owed; this is a last resort.
    if (pending_count > 0) reset(0);
    send_cq->committed -= committed_send;
    recv_cq->committed -= committed_recv;
    std::erase(send_cq->qps, this);
    std::erase(recv_cq->qps, this);
    if (srq) recv_cq->srq_qps.erase(qp.qp_num());
}

void qp_state::owed_nothing() noexcept {
    while (waiter* w = close_waiters.pop_front())
        w->fulfil(0);
    if (!flush_timer_armed) return;
    try {
        detail::loop(*ctx).cancel(&flush_timer);
    } catch (...) {
        // The ring is unusable: the timer fires on its own and finds nothing owed.
    }
}

void qp_state::sink_completed(wr_op* op, const ibv_wc& wc, bool) noexcept {
    qp_state* q = static_cast<sink_op*>(op)->owner;
    q->note_unsignaled(wc);
    if (--q->sink_outstanding == 0)
        q->unlink(&q->sink);
    else
        --q->pending_count; // > 0: the sink itself is still owed
}

void qp_state::note_unsignaled(const ibv_wc& wc) noexcept {
    if (wc.status == IBV_WC_SUCCESS) return;
    if (wc.status == IBV_WC_WR_FLUSH_ERR) {
        ++counters.flushed;
        return;
    }
    ++counters.failed;
    if (!unsignaled_failure) unsignaled_failure = wc;
}

void qp_state::move_to(ibv_qp_state state) {
    ibv_qp_attr attr{};
    attr.qp_state = state;
    if (const int rc = hooks().modify_qp(qp.native(), &attr, IBV_QP_STATE); rc != 0)
        throw_system_error(verbs::verb_errno(rc), "ibv_modify_qp(qp " +
                                                      std::to_string(qp.qp_num()) + " to " +
                                                      (state == IBV_QPS_RESET ? "RESET"
                                                       : state == IBV_QPS_ERR ? "ERR"
                                                                              : "?") +
                                                      ")");
}

void qp_state::enter_error() noexcept {
    if (in_error) return;
    try {
        move_to(IBV_QPS_ERR);
    } catch (const std::exception& e) {
        // The flush watch still ends what is owed.
        detail::diagnose("%s", e.what());
    }
    in_error = true;
}

void qp_state::to_error() noexcept {
    enter_error();
    watch_flush();
}

void qp_state::to_error_in_poll() noexcept {
    enter_error();
    if (watch_deferred) return;
    watch_deferred = true;
    // Run at the end of the channel's service pass (queued here: the at-once path has none),
    // or after the polls of a reset() or an srq's end (the only polls of an io_context
    // shutting down, whose service passes no longer run).
    channel_state& ch = *recv_cq->channel;
    deferred_next = ch.deferred_watches;
    ch.deferred_watches = this;
    detail::loop(*ch.ctx).queue_poller(&ch.service);
}

void qp_state::posting_while_in_error(const char* verb) {
    // A mark left by an earlier post that failed after this probe is for nobody: only the
    // probe sets it, and a post can reach a healthy QP's fast path again only through it.
    posted_in_error = false;
    if (lost)
        throw_system_error(ENODEV, std::string(verb) + ": the RDMA device is gone (" + lost +
                                       "): nothing can be posted any more");
    if (channel_failed != 0)
        throw_system_error(channel_failed,
                           std::string(verb) + ": qp " + std::to_string(qp.qp_num()) + ": " +
                               cut_off_cause() +
                               ", so nothing posted could complete any more (channel::error())");
    // The user may have reset and connected the QP again since (through native_qp(), which
    // we do not see): ask the device. Only on this path, never on a healthy QP's posts. RESET
    // does not count as out of error: a device that never reports the state says RESET (siw:
    // ibv_query_qp leaves qp_state 0), and a QP really in RESET takes no posts anyway.
    std::optional<ibv_qp_state> now;
    try {
        now = qp.state();
    } catch (const std::exception&) {
        // Cannot tell: treat it as still in error, the bound only ends what is owed.
    }
    if (now && *now != IBV_QPS_ERR && *now != IBV_QPS_RESET) {
        in_error = false;
        reset_by_us = false;
        return;
    }
    // We reset it and it reads RESET: refused like rxe refuses a post in RESET (EINVAL). siw
    // reads RESET too, but its QP is still in ERROR (it ignores RESET): there the post would
    // be queued and never completed, nor flushed.
    if (now == IBV_QPS_RESET && reset_by_us)
        throw_system_error(EINVAL, std::string(verb) + ": qp " + std::to_string(qp.qp_num()) +
                                       " was reset when the runtime ended what it owed (its "
                                       "bounded flush, or a request abandoned) and is not "
                                       "connected again");
    // Still in the error state: what is posted now completes only by a flush, which some
    // devices never deliver for requests posted in this state (Linux 6.1's rxe): bound it.
    posted_in_error = true;
}

void qp_state::watch_flush() noexcept {
    if (pending_count == 0 || flush_timer_armed) return;
    if (ctx->shutting_down()) {
        // ~io_context: no flush will be serviced any more (the channels' polls are cancelled).
        reset(0);
        return;
    }
    try {
        io_uring_sqe* sqe = detail::loop(*ctx).get_sqe();
        flush_ts = to_kernel_timespec(flush_timeout);
        io_uring_prep_timeout(sqe, &flush_ts, 0, 0);
        io_uring_sqe_set_data(sqe, static_cast<operation*>(&flush_timer));
    } catch (const std::exception& e) {
        diagnose("qp %u: no flush timer (%s): its %zu owed requests end now", qp.qp_num(), e.what(),
                 pending_count);
        reset(0);
        return;
    }
    flush_timer_armed = true;
    detail::loop(*ctx).start_background();
}

void qp_state::flush_timer_fired(operation* op, int res, unsigned) noexcept {
    qp_state* self = static_cast<flush_timer_op*>(op)->owner;
    self->flush_timer_armed = false;
    detail::loop(*self->ctx).finish_background();
    if (self->pending_count > 0) {
        if (res == -ETIME) {
            diagnose("qp %u: %zu requests still not flushed %lld ms after the QP entered the "
                     "error state: QP reset, their awaits end as never flushed",
                     self->qp.qp_num(), self->pending_count,
                     static_cast<long long>(
                         std::chrono::duration_cast<std::chrono::milliseconds>(self->flush_timeout)
                             .count()));
            self->reset(never_flushed_vendor_err);
        } else if (self->ctx->shutting_down()) {
            self->reset(0);
        } else if (self->in_error) {
            self->watch_flush(); // cancelled when nothing was owed; owed again since
        }
    }
    // Freed only with no timer of its own in flight: the kernel names the state until that
    // timer's CQE, so a timer armed again above (or by a handler that reset() ran) keeps it
    // alive until then.
    if (self->keep_alive && self->pending_count == 0 && !self->flush_timer_armed) {
        detail::loop(*self->ctx).end_teardown();
        std::shared_ptr<qp_state> last = std::move(self->keep_alive);
        // `self` is freed here, with the QP.
    }
}

void qp_state::reset(std::uint32_t made_up) noexcept {
    // To the error state first, unless we moved it there already: a device may ignore RESET
    // and keep what is posted (Linux 6.1's siw leaves a QP in RTS, ERROR, CLOSING or TERMINATE
    // as it is, and returns 0), to complete it later naming an awaiter that ends below, or
    // even to write a receive's buffer. In the error state every device flushes what it
    // holds; siw does so inside the call, and what it holds in that state it never processes.
    if (!in_error) {
        try {
            move_to(IBV_QPS_ERR);
        } catch (const std::exception& e) {
            diagnose("%s", e.what());
        }
    }
    try {
        move_to(IBV_QPS_RESET); // from here on the device produces no completion for this QP
    } catch (const std::exception& e) {
        diagnose("%s", e.what());
    }
    reset_by_us = true;
    // Until what it owed has ended, it counts as moved to the error state by us: the flushes
    // below are this reset's, not an iWARP connection's end (flushed_by_closed_connection),
    // and a handler's to_error() does not move a QP in RESET back to ERR.
    in_error = true;
    // What the device delivered before the reset names live awaiters: dispatch it.
    send_cq->channel->drain_cq(*send_cq);
    if (recv_cq != send_cq) recv_cq->channel->drain_cq(*recv_cq);
    while (pending) {
        ibv_wc wc{};
        wc.status = IBV_WC_WR_FLUSH_ERR;
        wc.qp_num = qp.qp_num();
        wc.vendor_err = made_up;
        wr_op* op = pending;
        op->on_wc(op, wc, true);
    }
    in_error = false; // RESET now; connecting it again is the user's
    // A violation the polls above found (to_error_in_poll) has its flush watch now (an
    // io_context shutting down runs no service pass that would), or just after, when this
    // reset is itself a listed watch's (the list's run under way takes it). After the made-up
    // ends: this QP, if listed, owes nothing and arms no timer (which ~qp_state's reset would
    // outlive).
    send_cq->channel->run_deferred_watches_if_any();
    recv_cq->channel->run_deferred_watches_if_any();
}

void qp_state::mark_cut_off(int err, bool by_srq) noexcept {
    if (lost || channel_failed != 0) return;
    channel_failed = err;
    cut_off_by_srq = by_srq;
    cut_off_owed = true;
}

const char* qp_state::cut_off_cause() const noexcept {
    return cut_off_by_srq ? "a completion channel of its srq's receive CQs failed"
                          : "a completion channel of its CQs failed";
}

void qp_state::finish_cut_off() noexcept {
    if (!cut_off_owed) return;
    cut_off_owed = false;
    if (pending_count > 0)
        diagnose("qp %u: %s (%s): its %zu owed requests end now", qp.qp_num(), cut_off_cause(),
                 std::system_category().message(channel_failed).c_str(), pending_count);
    // Nothing of this QP's could be read any more: RESET, so that nothing it holds completes
    // after the made-up ends (the device's flushes polled first, read as the same failure).
    reset(channel_failed_vendor_err(channel_failed, cut_off_by_srq));
    in_error = true; // posts take the slow path, which refuses them
}

std::uint32_t qp_state::cut_off_vendor_err() const noexcept {
    if (lost) return device_lost_vendor_err;
    if (channel_failed != 0) return channel_failed_vendor_err(channel_failed, cut_off_by_srq);
    return 0;
}

void qp_state::release(std::shared_ptr<qp_state> self) noexcept {
    if (self->pending_count > 0) self->to_error();
    // Freed with `self`, unless the flush timer is in flight (owed requests, or a cancelled
    // timer whose CQE has not come yet): the kernel still names it, so the state waits for
    // that CQE (flush_timer_fired frees it once nothing is owed).
    if (!self->flush_timer_armed) return;
    qp_state* s = self.get();
    detail::loop(*s->ctx).start_teardown(); // io_context::teardown_in_flight()
    s->keep_alive = std::move(self);
}

} // namespace detail

} // namespace ringverbs
