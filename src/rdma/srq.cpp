#include <ringverbs/rdma/srq.hpp>

#include <ringverbs/engine/diagnostics.hpp>
#include <ringverbs/engine/error.hpp>
#include <ringverbs/rdma/completion_error.hpp>
#include <ringverbs/rdma/detail/object_registry.hpp>
#include <ringverbs/rdma/detail/outcome.hpp>
#include <ringverbs/verbs/detail/mmap_keys.hpp>
#include <ringverbs/verbs/detail/verbs_hooks.hpp>
#include <ringverbs/verbs/verb_error.hpp>

#include <algorithm>
#include <cerrno>
#include <string>
#include <system_error>

namespace ringverbs {

namespace detail {

srq_state::srq_state(io_context& c, const verbs::protection_domain& pd, std::uint32_t wr,
                     std::uint32_t sge)
    : ctx(&c) {
    ibv_srq_init_attr init{};
    init.attr.max_wr = wr;
    init.attr.max_sge = sge;
    verbs::detail::prepare_for_queues(pd.native()->context);
    errno = 0;
    ibv_srq* raw = ibv_create_srq(pd.native(), &init);
    const int err = errno;
    if (raw == nullptr)
        throw_system_error(verbs::errno_or_eio(err),
                           "ibv_create_srq(max_wr " + std::to_string(wr) + ", max_sge " +
                               std::to_string(sge) + ")" +
                               verbs::detail::create_failure_note(pd.native()->context, err));
    srq =
        std::shared_ptr<ibv_srq>(raw, [pd_keep = pd.handle()](ibv_srq* s) { ibv_destroy_srq(s); });
    max_wr = init.attr.max_wr;  // what the device granted
    register_object(raw, this); // for device_events' routing
}

srq_state::~srq_state() {
    unregister_object(srq.get());
    // Every QP on this SRQ is gone: what their receive CQs still hold is the last that can
    // name our receives.
    for (auto& c : recv_cqs) {
        c->channel->drain_cq(*c);
        c->channel->run_deferred_watches_if_any(); // a recv_ring's violation on another QP
    }
    end_owed(0);
    while (waiter* w = low_water_waiters.pop_front())
        w->fulfil(ECANCELED);
}

void srq_state::refuse_post() const {
    if (lost)
        throw_system_error(ENODEV, std::string("ibv_post_srq_recv: the RDMA device is gone (") +
                                       lost + ")");
    throw_system_error(channel_failed,
                       "ibv_post_srq_recv: a completion channel of the srq's receive CQs "
                       "failed, so no receive could complete any more (channel::error())");
}

void srq_state::end_owed(std::uint32_t vendor_err) noexcept {
    while (pending) {
        ibv_wc wc{};
        wc.status = IBV_WC_WR_FLUSH_ERR;
        wc.vendor_err = vendor_err;
        wr_op* op = pending;
        op->on_wc(op, wc, true);
    }
}

void srq_state::link(wr_op* op) noexcept {
    push_owed(pending, op);
    ++pending_count;
    ++posted;
}

void srq_state::unlink(wr_op* op) noexcept {
    remove_owed(pending, op);
    --pending_count;
}

void srq_state::consumed() noexcept {
    if (posted > 0) --posted; // not below 0: receives posted on native() are not counted
    for (waiter* w = low_water_waiters.front(); w != nullptr;) {
        waiter* next = w->next;
        if (static_cast<srq_low_water_waiter*>(w)->below > posted) {
            low_water_waiters.remove(w);
            w->fulfil(0); // resumed later, by the loop: `next` is still queued
        }
        w = next;
    }
}

void srq_state::attach(const std::shared_ptr<cq_state>& recv_cq) {
    if (std::find(recv_cqs.begin(), recv_cqs.end(), recv_cq) == recv_cqs.end())
        recv_cqs.push_back(recv_cq);
}

void srq_state::arm(std::uint32_t limit) {
    ibv_srq_attr attr{};
    attr.srq_limit = limit;
    if (const int rc = ibv_modify_srq(srq.get(), &attr, IBV_SRQ_LIMIT); rc != 0)
        throw_system_error(verbs::verb_errno(rc),
                           "ibv_modify_srq(srq_limit " + std::to_string(limit) + ")");
    armed_limit = limit;
}

std::uint32_t srq_state::largest_waiting() const noexcept {
    std::uint32_t largest = 0;
    for (const waiter* w = low_water_waiters.front(); w != nullptr; w = w->next)
        largest = std::max(largest, static_cast<const srq_low_water_waiter*>(w)->below);
    return largest;
}

void srq_state::limit_reached() noexcept {
    ++limit_events;
    // The event of the one arm outstanding (the device disarmed the SRQ as it raised it): the
    // device held fewer than `fired` receives, which settles every waiter of n >= fired. The
    // others are settled by the count, which may already say more than the event (0: an arm
    // that is not ours, made on native(): only the count decides).
    const std::uint32_t fired = std::exchange(armed_limit, 0);
    for (waiter* w = low_water_waiters.front(); w != nullptr;) {
        waiter* next = w->next;
        const std::uint32_t n = static_cast<srq_low_water_waiter*>(w)->below;
        if ((fired != 0 && n >= fired) || n > posted) {
            low_water_waiters.remove(w);
            w->fulfil(0); // resumed later, by the loop: `next` is still queued
        }
        w = next;
    }
    // The rest wait on: the SRQ is armed again for the largest of them.
    if (const std::uint32_t largest = largest_waiting(); largest != 0) {
        try {
            arm(largest);
        } catch (const std::exception& e) {
            // Not armed: those waits still end by the count of posted receives (or their
            // deadline), as when no device_events routes the event.
            diagnose("srq::low_water: %s: the waits go on by the count of posted receives",
                     e.what());
        }
    }
}

void srq_state::failed() noexcept {
    error = EIO;
    while (waiter* w = low_water_waiters.pop_front())
        w->fulfil(EIO);
}

void srq_state::mark_cut_off(int err) noexcept {
    if (lost || channel_failed != 0) return;
    channel_failed = err;
    error = err;
    cut_off_owed = true;
    // Every QP on the SRQ (all of this loop: see qp_state's constructor), whichever CQ it uses.
    for (auto& c : recv_cqs)
        for (qp_state* q : c->qps)
            if (q->srq.get() == this) q->mark_cut_off(err, q->recv_cq->channel->error == 0);
}

void srq_state::finish_cut_off() noexcept {
    if (!cut_off_owed) return;
    cut_off_owed = false;
    if (pending_count > 0)
        diagnose("srq: a completion channel of its receive CQs failed (%s): its %zu owed "
                 "receives end now",
                 std::system_category().message(channel_failed).c_str(), pending_count);
    end_everything(channel_failed, channel_failed_vendor_err(channel_failed, true),
                   [](qp_state& q) { q.finish_cut_off(); });
}

} // namespace detail

srq::srq(io_context& ctx, const verbs::protection_domain& pd, srq_options o)
    : state_(std::make_shared<detail::srq_state>(ctx, pd, o.max_wr, o.max_sge)) {}

srq::~srq() {
    // The SRQ lives on while a qp receives from it, but its low_water() waits are this
    // handle's: a refiller resumed later by the device's event would call into a handle that
    // is gone.
    while (detail::waiter* w = state_->low_water_waiters.pop_front())
        w->fulfil(ECANCELED);
}

srq::request srq::recv(local_buffer into) noexcept {
    return {state_.get(), into};
}

void srq::post_recv(local_buffer into, std::uint64_t wr_id) {
    if ((wr_id & detail::wr_tag_ours) != 0)
        throw_system_error(EINVAL, "srq::post_recv: wr_ids with the top bit set are ringverbs'");
    ibv_sge sge{reinterpret_cast<std::uintptr_t>(into.addr), into.length, into.lkey};
    ibv_recv_wr wr{};
    wr.wr_id = wr_id;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    if (state_->lost || state_->channel_failed != 0) [[unlikely]]
        state_->refuse_post();
    ibv_recv_wr* bad = nullptr;
    if (const int rc = verbs::detail::hooks().post_srq_recv(state_->srq.get(), &wr, &bad); rc != 0)
        throw_system_error(verbs::verb_errno(rc), "ibv_post_srq_recv");
    ++state_->posted;
}

srq::low_water_awaitable srq::low_water(std::uint32_t n, wait_options w) noexcept {
    return {state_.get(), n, std::move(w)};
}

srq::request::request(detail::srq_state* state, local_buffer into) noexcept
    : state_(state), ctx_(state->ctx) {
    on_wc = &request::completed;
    sge_ = ibv_sge{reinterpret_cast<std::uintptr_t>(into.addr), into.length, into.lkey};
    wr_.wr_id = detail::wr_id_for(this, true);
    wr_.sg_list = &sge_;
    wr_.num_sge = 1;
}

void srq::request::await_suspend(std::coroutine_handle<> h) {
    if (state_->lost || state_->channel_failed != 0) [[unlikely]]
        state_->refuse_post();
    ibv_recv_wr* bad = nullptr;
    if (const int rc = verbs::detail::hooks().post_srq_recv(state_->srq.get(), &wr_, &bad); rc != 0)
        throw_system_error(verbs::verb_errno(rc), "ibv_post_srq_recv"); // nothing posted
    state_->link(this);
    // No deadline, no stop: a posted SRQ receive cannot be recalled (see srq).
    begin_wait(*ctx_, wait_options{}, false, h, &request::never_interrupted);
}

void srq::request::completed(wr_op* op, const ibv_wc& wc, bool) noexcept {
    auto* self = static_cast<request*>(op);
    self->result_ = wc;
    // Flushed because the device went away or the srq was cut off (its QP reset): reads as
    // that.
    if (wc.status == IBV_WC_WR_FLUSH_ERR) {
        if (self->state_->lost)
            self->result_.vendor_err = detail::device_lost_vendor_err;
        else if (self->state_->channel_failed != 0)
            self->result_.vendor_err =
                detail::channel_failed_vendor_err(self->state_->channel_failed, true);
    }
    self->state_->unlink(self);
    self->state_->consumed();
    self->decide(0);
}

ibv_wc srq::request::await_resume() {
    finish_wait();
    // Not connection_reset: the QP that took the receive, and so its connection, is known
    // only by its number, which a new QP may carry by now.
    if (result_.status != IBV_WC_SUCCESS) {
        std::string what = "the shared receive (ibv_post_srq_recv)";
        if (result_.qp_num != 0) what += " taken by qp " + std::to_string(result_.qp_num);
        detail::throw_failed_completion(result_, what, false);
    }
    return result_;
}

void srq::low_water_awaitable::await_suspend(std::coroutine_handle<> h) {
    // One limit serves every waiter. Not armed (no arm outstanding): armed now for the largest
    // n waiting, this one's included. Armed already: never replaced (see armed_limit); this
    // wait ends by that arm's event when its n is at least the armed limit, else by the count
    // or by the arm made for it after that event.
    if (state_->armed_limit == 0)
        state_->arm(std::max(below, state_->largest_waiting())); // throws: nothing queued
    wait_in(state_->low_water_waiters, *state_->ctx, options_, h);
}

void srq::low_water_awaitable::await_resume() {
    // Decided: the outcome is in this object (the srq may be gone). Not decided: ready at
    // once, because n was 0, the srq had failed, or fewer than asked were posted already.
    if (!decided() && below == 0)
        throw_system_error(EINVAL, "srq::low_water(0): fewer than 0 receives are never posted "
                                   "(n must be at least 1)");
    const int err = decided() ? error() : state_->error;
    if (err != 0) throw_system_error(err, "srq::low_water");
}

} // namespace ringverbs
