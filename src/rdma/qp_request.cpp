// qp::request: one posted work request (or chain) awaited by a coroutine: its post (signaled,
// unsignaled, in the error state), its completion, its deadline and stop, and its outcome.
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

using detail::never_flushed_vendor_err;
using detail::qp_state;
using detail::wr_id_for;
using verbs::detail::hooks;

// ~request(), of a request posted with post() and never awaited: it still owns its buffer and
// its wr_id names this object. Reset the QP: nothing can name it after that.
void qp::request::abandon_unawaited() noexcept {
    detail::diagnose("%s: a posted request was destroyed before its completion; qp %u is reset",
                     name_, qp_->qp.qp_num());
    abandon();
}

// await_ready() of an unsignaled send (still built, not stopped): the lean way in, which
// skips post()'s checks that cannot apply (a receive on an srq) and its signaled path.
void qp::request::post_unsignaled_at_await() {
    qp_->before_post(name_);
    if (!post_unsignaled()) [[unlikely]]
        post_throttled();
}

// The forced-signaled request is due while too many are unconfirmed (post_unsignaled): post
// it signaled, awaited like any other. Apart so that the lean path above stays lean.
// Checked already (before_post); counted throttled once. A post that throws leaves it
// unsignaled, as it was: built when nothing was queued, ended by the QP's reset (abandon())
// when the device queued it and refused the doorbell.
void qp::request::post_throttled() {
    signaled_ = true;
    try {
        post_signaled();
    } catch (...) {
        signaled_ = false;
        throw;
    }
}

[[gnu::flatten]] void qp::request::post() {
    if (stage_ != stage::built) return;
    if (kind_ == kind::recv && qp_->srq) [[unlikely]]
        throw_system_error(EINVAL, std::string(name_) +
                                       ": the qp receives from an srq: post the receive there");
    qp_->before_post(name_);
    if (!signaled_ && post_unsignaled()) return;
    post_signaled();
}

// post() after its checks, signaled: the request (or chain) names this awaiter.
[[gnu::always_inline]] inline void qp::request::post_signaled() {
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
        if (rc != 0) [[unlikely]] {
            if (bad == nullptr) {
                abandon(); // all of it queued: it names this awaiter
                refused_doorbell(rc);
            }
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
        if (rc != 0) [[unlikely]] {
            if (head->next != nullptr && bad != head) abandon();
            throw_system_error(verbs::verb_errno(rc), name_);
        }
    }
    stage_ = stage::posted;
    qp_->link(this);
    qp_->after_post(true);
}

// A send failed with no request named bad: the provider queued every request and only its
// doorbell failed. siw and rxe write sends into the queue they share with the kernel, then ring
// the doorbell with a system call, which the kernel may refuse: siw with ENOTCONN in any state
// but RTS and ERROR (its connection ending, or not made yet) and when its QP's state lock is
// busy; rxe with EINVAL before RTS. What was queued may still complete (siw flushes it once
// the QP is in ERROR; rxe sends it once in RTS), and after such a refusal siw's provider does
// not ring again while that request sits unprocessed: the send queue stalls. The caller has
// reset the QP (ERR, then RESET: nothing of it completes later against an awaiter told it
// failed); this throws, naming the verb, the qp and the errno. Receives have no doorbell on
// either device (a failure names its request), so this is for sends only.
void qp::request::refused_doorbell(int rc) const {
    throw_system_error(verbs::verb_errno(rc),
                       std::string(name_) + ": qp " + std::to_string(qp_->qp.qp_num()) +
                           ": the device queued the request but refused its doorbell (the QP "
                           "is not in RTS, or its connection is ending); the QP was reset, so "
                           "nothing of it completes later");
}

// send_options::signaled = false. Posts the request unsignaled (or, one in signal_interval,
// signaled with the qp's sink as its wr_id) and ends the await at once: returns true. Returns
// false without posting when the forced-signaled request is due while too many are still
// unconfirmed: the caller then posts it signaled, awaited like any other (back pressure).
[[gnu::always_inline]] inline bool qp::request::post_unsignaled() {
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
    if (rc != 0) [[unlikely]]
        unsignaled_post_failed(rc, bad, forced);
    ++q.counters.unsignaled;
    if (forced) {
        ++q.counters.forced_signaled;
        q.unsignaled_run = 0;
        q.sink_posted();
    } else {
        ++q.unsignaled_run;
    }
    q.after_post(forced);           // a plain unsignaled send is owed nothing: no bound
    result_.qp_num = q.qp.qp_num(); // the rest of the made-up completion: await_resume()
    stage_ = stage::done;
    done_at_post_ = true;
    return true;
}

// post_unsignaled's ibv_post_send failed: out of line, so that the lean path saves no
// registers for it.
void qp::request::unsignaled_post_failed(int rc, const ibv_send_wr* bad, bool forced) {
    if (bad == nullptr) {
        // Queued all the same: its completion names the sink (forced) or the CQ's unsignaled
        // op, never this request. Count the sink's as owed, so that the reset's flush (or
        // made-up end) finds it, then reset and throw as for a signaled send.
        if (forced) qp_->sink_posted();
        qp_->reset(0);
        refused_doorbell(rc);
    }
    throw_system_error(verbs::verb_errno(rc), name_); // nothing was posted
}

bool qp::request::await_suspend(std::coroutine_handle<> h) {
    // Everything that can throw comes before the request is posted (a throw after it would
    // leave a posted request behind an awaiter about to go): room for the timer's SQE first.
    bool timer = false;
    try {
        timer = reserve_timer(*ctx_, options_);
    } catch (...) {
        // Posted early with post(): owed, and the awaiter goes.
        if (stage_ == stage::posted) abandon();
        throw;
    }
    try {
        post();
    } catch (...) {
        unreserve(*ctx_, timer);
        throw;
    }
    if (stage_ == stage::done) [[unlikely]] {
        // Ended inside its own post: the flush bound it armed found no SQE, so the QP was
        // reset and what it owed ended, this request too. No wait: nothing would decide it.
        unreserve(*ctx_, timer);
        return false;
    }
    begin_wait(*ctx_, options_, timer, h, &qp::request::interrupted_by);
    return true;
}

// This awaiter goes while requests it posted are owed (post() failed part-way through a
// chain, or a request posted with post() is never awaited): reset the QP, which ends every
// owed request at once (reset(): the device's completions dispatched, the rest made up), so
// that no completion names this object after it is gone.
void qp::request::abandon() noexcept {
    if (stage_ == stage::built) qp_->link(this); // a chain posted in part
    stage_ = stage::abandoned;
    qp_->reset(0);
}

void qp::request::completed(wr_op* op, const ibv_wc& wc, bool last) noexcept {
    auto* self = static_cast<qp::request*>(op);
    if (self->stage_ == stage::abandoned) {
        // Only counted, but a later co_await of it must not read as a success: its first
        // failure (the reset's flush) is its outcome.
        if (wc.status != IBV_WC_SUCCESS && self->outcome_ == outcome::ok) {
            self->first_error_ = wc;
            self->outcome_ = outcome::failed;
        }
        if (last) {
            self->result_ = wc;
            self->stage_ = stage::done;
            self->qp_->unlink(self);
        }
        return;
    }
    if (self->seen_ < self->each_.size()) self->each_[self->seen_] = wc;
    ++self->seen_;
    if (wc.status != IBV_WC_SUCCESS && self->outcome_ == outcome::ok) {
        self->first_error_ = wc;
        // Flushed because its device went away or its channel failed (cut off: the QP was
        // reset): reads as that.
        if (wc.status == IBV_WC_WR_FLUSH_ERR)
            if (const std::uint32_t v = self->qp_->cut_off_vendor_err(); v != 0)
                self->first_error_.vendor_err = v;
        self->outcome_ =
            self->qp_->flushed_by_closed_connection(wc) ? outcome::closed : outcome::failed;
    }
    if (!last) return;
    self->result_ = wc;
    self->stage_ = stage::done;
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

ibv_wc qp::request::await_resume_waited() {
    if (stage_ == stage::cancelled_early) throw_system_error(ECANCELED, name_);
    const int interrupted = this->interrupted();
    finish_wait();
    if (outcome_ == outcome::ok) return result_; // its real outcome came first
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
    detail::throw_failed_completion(first_error_, what, outcome_ == outcome::closed);
}

} // namespace ringverbs
