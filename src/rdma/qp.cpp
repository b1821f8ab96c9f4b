#include <ringverbs/engine/diagnostics.hpp>
#include <ringverbs/rdma/qp.hpp>

#include <ringverbs/rdma/detail/object_registry.hpp>
#include <ringverbs/rdma/detail/outcome.hpp>
#include <ringverbs/rdma/detail/verbs_hooks.hpp>
#include <ringverbs/rdma/srq.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>

namespace ringverbs {

namespace detail {

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
    // An srq and its qps are served by one loop: a device's loss, an SRQ limit event and the
    // srq's own bookkeeping act on both without a lock.
    if (srq && (srq->ctx != ctx || srq->ctx != recv_cq->channel->ctx))
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

void qp_state::link(wr_op* op) noexcept {
    push_owed(pending, op);
    ++pending_count;
}

void qp_state::unlink(wr_op* op) noexcept {
    remove_owed(pending, op);
    if (--pending_count == 0) owed_nothing();
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

void qp_state::sink_posted() noexcept {
    if (sink_outstanding++ == 0)
        link(&sink);
    else
        ++pending_count;
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

void qp_state::to_error() noexcept {
    if (!in_error) {
        try {
            move_to(IBV_QPS_ERR);
        } catch (const std::exception& e) {
            // The flush timer still ends what is owed.
            detail::diagnose("%s", e.what());
        }
        in_error = true;
    }
    watch_flush();
}

void qp_state::posting_while_in_error(const char* verb) {
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
    if (self->keep_alive && self->pending_count == 0) {
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
    in_error = false; // RESET now; connecting it again is the user's
    reset_by_us = true;
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

using detail::hooks;
using detail::never_flushed_vendor_err;
using detail::qp_state;
using detail::wr_id_for;

qp::request::request(detail::qp_state* qp, kind k, const char* name, const detail::wr_request& r,
                     wait_options options) noexcept
    : qp_(qp), ctx_(qp->ctx), kind_(k), name_(name), options_(std::move(options)) {
    on_wc = &qp::request::completed;
    sge_.addr = reinterpret_cast<std::uintptr_t>(r.local.addr);
    sge_.length = r.local.length;
    sge_.lkey = r.local.lkey;
    each_ = r.each;
    signaled_ = r.signaled || k == kind::recv;
    if (k == kind::recv) {
        recv_chain_ = r.recv_chain;
        recv_wr_.sg_list = &sge_;
        recv_wr_.num_sge = 1;
        return;
    }
    send_chain_ = r.send_chain;
    send_wr_.opcode = r.opcode;
    send_wr_.sg_list = &sge_;
    send_wr_.num_sge = r.local.length > 0 || r.opcode == IBV_WR_ATOMIC_CMP_AND_SWP ||
                               r.opcode == IBV_WR_ATOMIC_FETCH_AND_ADD
                           ? 1
                           : 0;
    send_wr_.send_flags = r.send_flags | IBV_SEND_SIGNALED;
    if (r.imm) send_wr_.imm_data = htobe32(*r.imm);
    if (r.opcode == IBV_WR_ATOMIC_CMP_AND_SWP || r.opcode == IBV_WR_ATOMIC_FETCH_AND_ADD) {
        send_wr_.wr.atomic.remote_addr = r.remote.addr;
        send_wr_.wr.atomic.rkey = r.remote.rkey;
        send_wr_.wr.atomic.compare_add = r.compare_add;
        send_wr_.wr.atomic.swap = r.swap;
    } else {
        send_wr_.wr.rdma.remote_addr = r.remote.addr;
        send_wr_.wr.rdma.rkey = r.remote.rkey;
    }
}

qp::request::~request() {
    if (posted_ && !done_) {
        // Posted with post() and never awaited: the request still owns its buffer and its
        // wr_id names this object. Reset the QP: nothing can name us after that.
        detail::diagnose("%s: a posted request was destroyed before its completion; qp %u is reset",
                         name_, qp_->qp.qp_num());
        abandon();
    }
}

void qp::request::post() {
    if (posted_) return;
    if (kind_ == kind::recv && qp_->srq) [[unlikely]]
        throw_system_error(EINVAL, std::string(name_) +
                                       ": the qp receives from an srq: post the receive there");
    if (qp_->in_error || qp_->reset_by_us) [[unlikely]]
        qp_->posting_while_in_error(name_);
    if (!signaled_ && post_unsignaled()) return;
    if (kind_ == kind::send) {
        ibv_send_wr* head = send_chain_ ? send_chain_ : &send_wr_;
        ibv_send_wr* last = head;
        for (ibv_send_wr* w = head; w; w = w->next) {
            w->wr_id = wr_id_for(this, w->next == nullptr);
            last = w;
        }
        last->send_flags |= IBV_SEND_SIGNALED;
        if (qp_->send_cq->solicited_only &&
            qp_->send_cq->channel->options.mode != polling_mode::busy)
            throw_system_error(EINVAL,
                               std::string(name_) +
                                   ": the qp's send CQ is armed solicited-only, where a send "
                                   "completion raises no event: this await could wait for "
                                   "ever. Give the sends a CQ without "
                                   "cq_options::solicited_only, or use busy polling");
        ibv_send_wr* bad = nullptr;
        int rc = hooks().post_send(qp_->qp.native(), head, &bad);
        if (rc != 0) {
            // Requests before `bad` were posted and would complete against this awaiter, which
            // is about to throw: reset the QP so that none can (only what was posted is owed).
            if (head->next != nullptr && bad != head) abandon();
            throw_system_error(verbs::verb_errno(rc), name_);
        }
        qp_->unsignaled_run = 0; // the signaled last request frees every slot before it
    } else {
        ibv_recv_wr* head = recv_chain_ ? recv_chain_ : &recv_wr_;
        for (ibv_recv_wr* w = head; w; w = w->next)
            w->wr_id = wr_id_for(this, w->next == nullptr);
        ibv_recv_wr* bad = nullptr;
        int rc = hooks().post_recv(qp_->qp.native(), head, &bad);
        if (rc != 0) {
            if (head->next != nullptr && bad != head) abandon();
            throw_system_error(verbs::verb_errno(rc), name_);
        }
    }
    posted_ = true;
    qp_->link(this);
    if (qp_->posted_in_error) {
        qp_->posted_in_error = false;
        qp_->watch_flush();
    }
}

// send_options::signaled = false. Posts the request unsignaled (or, one in signal_interval,
// signaled with the qp's sink as its wr_id) and ends the await at once: returns true. Returns
// false without posting when the forced-signaled request is due while too many are still
// unconfirmed: the caller then posts it signaled, awaited like any other (back pressure).
bool qp::request::post_unsignaled() {
    qp_state& q = *qp_;
    const bool forced = q.unsignaled_run + 1 >= q.signal_interval;
    if (forced && q.sink_outstanding >= qp_state::max_sink_outstanding) {
        ++q.counters.throttled;
        return false;
    }
    send_wr_.send_flags &= ~unsigned{IBV_SEND_SIGNALED};
    if (forced) {
        send_wr_.send_flags |= IBV_SEND_SIGNALED;
        send_wr_.wr_id = wr_id_for(&q.sink, true);
    } else {
        send_wr_.wr_id = wr_id_for(&q.send_cq->unsignaled, false);
    }
    ibv_send_wr* bad = nullptr;
    int rc = hooks().post_send(q.qp.native(), &send_wr_, &bad);
    if (rc != 0) throw_system_error(verbs::verb_errno(rc), name_); // nothing was posted
    ++q.counters.unsignaled;
    if (forced) {
        ++q.counters.forced_signaled;
        q.unsignaled_run = 0;
        q.sink_posted();
        if (q.posted_in_error) q.watch_flush();
    } else {
        ++q.unsignaled_run;
    }
    q.posted_in_error = false;
    result_ = ibv_wc{};
    result_.status = IBV_WC_SUCCESS;
    result_.opcode =
        send_wr_.opcode == IBV_WR_RDMA_WRITE || send_wr_.opcode == IBV_WR_RDMA_WRITE_WITH_IMM
            ? IBV_WC_RDMA_WRITE
            : IBV_WC_SEND;
    result_.qp_num = q.qp.qp_num();
    posted_ = true;
    done_ = true;
    return true;
}

void qp::request::await_suspend(std::coroutine_handle<> h) {
    // Everything that can throw comes before the request is posted (a throw after it would
    // leave a posted request behind an awaiter about to go): the timer's SQE first.
    io_uring_sqe* timer = nullptr;
    try {
        timer = reserve_timer(*ctx_, options_);
    } catch (...) {
        if (posted_) abandon(); // posted early with post(): owed, and the awaiter goes
        throw;
    }
    try {
        post();
    } catch (...) {
        unreserve(timer);
        throw;
    }
    begin_wait(*ctx_, options_, timer, h, &qp::request::interrupted_by);
}

// This awaiter goes while requests it posted are owed (post() failed part-way through a
// chain, or a request posted with post() is never awaited): reset the QP, which ends every
// owed request at once (reset(): the device's completions dispatched, the rest made up), so
// that no completion names this object after it is gone.
void qp::request::abandon() noexcept {
    abandoned_ = true;
    if (!posted_) {
        posted_ = true;
        qp_->link(this);
    }
    qp_->reset(0);
}

void qp::request::completed(wr_op* op, const ibv_wc& wc, bool last) noexcept {
    auto* self = static_cast<qp::request*>(op);
    if (self->abandoned_) {
        if (last) {
            self->done_ = true;
            self->qp_->unlink(self);
        }
        return;
    }
    if (self->seen_ < self->each_.size()) self->each_[self->seen_] = wc;
    ++self->seen_;
    if (wc.status != IBV_WC_SUCCESS && !self->failed_) {
        self->failed_ = true;
        self->first_error_ = wc;
        // Flushed because its device went away or its channel failed (cut off: the QP was
        // reset): reads as that.
        if (wc.status == IBV_WC_WR_FLUSH_ERR)
            if (const std::uint32_t v = self->qp_->cut_off_vendor_err(); v != 0)
                self->first_error_.vendor_err = v;
        self->closed_ = self->qp_->flushed_by_closed_connection(wc);
    }
    if (!last) return;
    self->result_ = wc;
    self->done_ = true;
    self->qp_->unlink(self);
    // Posted early and not awaited yet: the co_await will find it done.
    if (self->wait_phase() == phase::waiting) self->decide(0);
}

bool qp::request::interrupted_by(wait_core* core, int) noexcept {
    auto* self = static_cast<qp::request*>(core);
    self->qp_->to_error(); // owed, so the qp's state is alive
    return false;
}

namespace {
// What a request is, for the failures of its completion (a post's failure names the verb
// alone): "the receive (ibv_post_recv) on qp 17". Not the verb alone: a receive whose wait
// timed out read as "ibv_post_recv: Connection timed out", as if the post had failed.
std::string described(const char* verb, std::uint32_t qp_num) {
    const std::string_view v(verb);
    const char* noun = v.starts_with("ibv_post_recv")              ? "the receive"
                       : v.find("RDMA_WRITE") != std::string::npos ? "the RDMA write"
                       : v.find("RDMA_READ") != std::string::npos  ? "the RDMA read"
                       : v.find("ATOMIC") != std::string::npos     ? "the atomic"
                       : v.find("SEND") != std::string::npos       ? "the send"
                                                                   : "the chain";
    return std::string(noun) + " (" + verb + ") on qp " + std::to_string(qp_num);
}
} // namespace

ibv_wc qp::request::await_resume() {
    if (cancelled_early_) throw_system_error(ECANCELED, name_);
    const int interrupted = this->interrupted();
    finish_wait();
    if (!failed_) return result_; // its real outcome came first
    const bool never_flushed = first_error_.status == IBV_WC_WR_FLUSH_ERR &&
                               first_error_.vendor_err == never_flushed_vendor_err;
    const std::string what = described(name_, first_error_.qp_num);
    const char* note = never_flushed ? " (never flushed by the device; the QP was reset)" : "";
    // A posted request cannot be recalled: the stop or the deadline moved the QP to error,
    // and says why the wait ended (also when the device went away meanwhile).
    if (stop_won() || interrupted == ECANCELED)
        throw_system_error(ECANCELED, what +
                                          ": cancelled (its stop_token, or the io_context's "
                                          "end; the QP was moved to the error state to end it)" +
                                          note);
    if (interrupted == ETIMEDOUT)
        throw_system_error(ETIMEDOUT, what +
                                          ": no completion within its wait_options timeout "
                                          "(the QP was moved to the error state to end it)" +
                                          note);
    detail::throw_failed_completion(first_error_, what, closed_);
}

std::shared_ptr<detail::srq_state> qp::shared_state(const qp_options& o) {
    return o.shared_receive_queue ? o.shared_receive_queue->state_ : nullptr;
}

qp::qp(const verbs::protection_domain& pd, cq& send_cq, cq& recv_cq, const verbs::qp_caps& caps,
       qp_options o)
    : state_(std::make_shared<detail::qp_state>(pd, send_cq.state_, recv_cq.state_, shared_state(o),
                                                caps, o.flush_timeout, o.allow_cq_overcommit)) {}

namespace {
verbs::queue_pair checked_adoption(verbs::queue_pair q, const cq& send_cq, const cq& recv_cq,
                                   const qp_options& o) {
    const ibv_qp* native = q.native();
    if (native == nullptr) throw_system_error(EINVAL, "qp: the adopted verbs::queue_pair is empty");
    if (native->qp_type != IBV_QPT_RC)
        throw_system_error(EINVAL, "qp: the adopted QP is not an RC QP");
    if (native->send_cq != send_cq.native() || native->recv_cq != recv_cq.native())
        throw_system_error(EINVAL, "qp: the adopted QP's send_cq/recv_cq are not the given cqs");
    const ibv_srq* expected = o.shared_receive_queue ? o.shared_receive_queue->native() : nullptr;
    if (native->srq != expected)
        throw_system_error(EINVAL,
                           "qp: the adopted QP's srq is not qp_options::shared_receive_queue");
    return q;
}
} // namespace

qp::qp(verbs::queue_pair adopted, cq& send_cq, cq& recv_cq, qp_options o)
    : state_(std::make_shared<detail::qp_state>(
          send_cq.state_, recv_cq.state_, shared_state(o),
          checked_adoption(std::move(adopted), send_cq, recv_cq, o), o.flush_timeout,
          o.allow_cq_overcommit)) {}

qp::~qp() {
    if (state_) detail::qp_state::release(std::move(state_));
}

qp& qp::operator=(qp&& other) noexcept {
    if (this != &other) {
        if (state_) detail::qp_state::release(std::move(state_));
        state_ = std::move(other.state_);
    }
    return *this;
}

void qp::to_error() {
    // Reset when its device went away or its channel failed: nothing is left to flush.
    if (state_->cut_off_vendor_err() != 0) return;
    state_->move_to(IBV_QPS_ERR);
    state_->in_error = true;
    state_->watch_flush();
}

using detail::wr_request;

namespace {
unsigned flags_of(const send_options& o) {
    unsigned f = 0;
    if (o.inline_data) f |= IBV_SEND_INLINE;
    if (o.solicited) f |= IBV_SEND_SOLICITED;
    if (o.fence) f |= IBV_SEND_FENCE;
    return f;
}
} // namespace

qp::request qp::send(local_buffer data, send_options o, wait_options w) noexcept {
    wr_request r;
    r.opcode = o.imm ? IBV_WR_SEND_WITH_IMM : IBV_WR_SEND;
    r.local = data;
    r.send_flags = flags_of(o);
    r.imm = o.imm;
    r.signaled = o.signaled;
    return {state_.get(), request::kind::send,
            o.imm ? "ibv_post_send(SEND_WITH_IMM)" : "ibv_post_send(SEND)", r, std::move(w)};
}

qp::request qp::recv(local_buffer into, wait_options w) noexcept {
    wr_request r;
    r.local = into;
    return {state_.get(), request::kind::recv, "ibv_post_recv", r, std::move(w)};
}

qp::request qp::write(local_buffer data, remote_buffer to, send_options o,
                      wait_options w) noexcept {
    wr_request r;
    r.opcode = o.imm ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE;
    r.local = data;
    r.remote = to;
    r.send_flags = flags_of(o);
    r.imm = o.imm;
    r.signaled = o.signaled;
    return {state_.get(), request::kind::send,
            o.imm ? "ibv_post_send(RDMA_WRITE_WITH_IMM)" : "ibv_post_send(RDMA_WRITE)", r,
            std::move(w)};
}

qp::request qp::read(local_buffer into, remote_buffer from, wait_options w) noexcept {
    wr_request r;
    r.opcode = IBV_WR_RDMA_READ;
    r.local = into;
    r.remote = from;
    return {state_.get(), request::kind::send, "ibv_post_send(RDMA_READ)", r, std::move(w)};
}

qp::request qp::compare_swap(local_buffer old_value, remote_buffer at, std::uint64_t compare,
                             std::uint64_t swap, wait_options w) noexcept {
    wr_request r;
    r.opcode = IBV_WR_ATOMIC_CMP_AND_SWP;
    r.local = old_value;
    r.remote = at;
    r.compare_add = compare;
    r.swap = swap;
    return {state_.get(), request::kind::send, "ibv_post_send(ATOMIC_CMP_AND_SWP)", r,
            std::move(w)};
}

qp::request qp::fetch_add(local_buffer old_value, remote_buffer at, std::uint64_t add,
                          wait_options w) noexcept {
    wr_request r;
    r.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
    r.local = old_value;
    r.remote = at;
    r.compare_add = add;
    return {state_.get(), request::kind::send, "ibv_post_send(ATOMIC_FETCH_AND_ADD)", r,
            std::move(w)};
}

qp::request qp::post_send(ibv_send_wr& chain, std::span<ibv_wc> each, wait_options w) noexcept {
    wr_request r;
    r.send_chain = &chain;
    r.each = each;
    return {state_.get(), request::kind::send, "ibv_post_send", r, std::move(w)};
}

qp::request qp::post_recv(ibv_recv_wr& chain, std::span<ibv_wc> each, wait_options w) noexcept {
    wr_request r;
    r.recv_chain = &chain;
    r.each = each;
    return {state_.get(), request::kind::recv, "ibv_post_recv", r, std::move(w)};
}

} // namespace ringverbs
