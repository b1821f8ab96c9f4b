#include <ringverbs/engine/diagnostics.hpp>
#include <ringverbs/rdma/cq.hpp>

#include <ringverbs/rdma/detail/object_registry.hpp>
#include <ringverbs/rdma/detail/srq_state.hpp>
#include <ringverbs/verbs/detail/provider.hpp>
#include <ringverbs/verbs/detail/verbs_hooks.hpp>

#include <algorithm>
#include <bit>
#include <cstdio>
#include <string>

namespace ringverbs {

namespace detail {

void throw_cq_failure(const char* op, int err) {
    if (err == EOVERFLOW)
        throw_system_error(err, std::string(op) + ": IBV_EVENT_CQ_ERR (the CQ overran)");
    if (err == ENODEV)
        throw_system_error(err, std::string(op) +
                                    ": the RDMA device is gone (removed, or failed for good)");
    throw_system_error(err, op);
}

using verbs::detail::hooks;

namespace {

// siw (Linux 6.1 at least) completes every receive with SIW_WQE_SIGNALLED instead of the
// receive's own flags (siw_rqe_complete), so a CQ armed solicited-only never raises an event for
// a solicited receive.

bool raises_solicited_events(channel_state& ch) noexcept {
    if (ch.solicited_events < 0) {
        const bool siw = verbs::detail::is_siw(ch.device.native());
        ch.solicited_events = siw ? 0 : 1;
        if (siw)
            diagnose("%s: the device never raises an event for a solicited receive (siw): CQs "
                     "asked to be armed solicited-only are armed for every completion",
                     ibv_get_device_name(ch.device.native()->device));
    }
    return ch.solicited_events == 1;
}

} // namespace

cq_state::cq_state(std::shared_ptr<channel_state> ch, int entries, int comp_vector, bool solicited)
    : channel(std::move(ch)), cq(channel->device, entries, &channel->channel, comp_vector, this),
      solicited_only(solicited), arm_solicited(solicited && raises_solicited_events(*channel)) {
    unsignaled.owner = this;
    unsignaled.on_wc = [](wr_op* op, const ibv_wc& wc, bool) noexcept {
        if (wc.status == IBV_WC_SUCCESS) return; // a QP made with sq_sig_all
        cq_state* self = static_cast<unsignaled_sink*>(op)->owner;
        for (qp_state* q : self->qps) {
            if (q->qp.qp_num() == wc.qp_num) {
                q->note_unsignaled(wc);
                return;
            }
        }
        // The qp is gone (a flush after its teardown found nothing owed): nothing to tell.
    };
    // A power of two, so that the ring's index wraps with a mask, not a division.
    buffer.resize(std::bit_ceil(static_cast<std::size_t>(cq.capacity()) + 1));
    // Reserved first: a bad_alloc then leaves nothing of this CQ listed in the channel.
    channel->fired.reserve(channel->cqs.size() + 1); // no allocation in a service pass
    channel->servicing.reserve(channel->cqs.size() + 1);
    channel->cqs.push_back(this);
    if (channel->options.mode != polling_mode::busy && !channel->spinning) {
        try {
            cq.req_notify(arm_solicited);
            set_armed(true);
            ++counters.arms;
            ++channel->counters.arms;
        } catch (...) {
            std::erase(channel->cqs, this);
            throw;
        }
    }
    try {
        register_object(cq.native(), this); // for device_events' routing
    } catch (...) {
        set_armed(false);
        std::erase(channel->cqs, this);
        throw;
    }
}

cq_state::~cq_state() {
    // The CQ may outlive this state (a QP or a handle() shares it); an event it raises later
    // must not lead here (channel_counters::gone_cq_events).
    cq.set_user_context(nullptr);
    unregister_object(cq.native());
    const bool may_have_event = armed; // each arm raises at most one event
    set_armed(false);
    std::erase(channel->cqs, this);
    std::erase(channel->fired, this);
    // Nulled, not erased: a service pass may be walking it (handle_wakeup skips nulls).
    std::replace(channel->servicing.begin(), channel->servicing.end(), this,
                 static_cast<cq_state*>(nullptr));
    // The verbs completion_queue acks every event still unacked before ibv_destroy_cq.
    counters.acked_events += cq.unacked_events();
    // The ring path: a read in flight may have taken this CQ's event, its CQE not handled yet,
    // so that the event is not counted: ibv_destroy_cq would wait for its ack for ever. The
    // reader destroys the CQ once no read is in flight (event_reader).
    if (may_have_event && channel->reader != nullptr && channel->reader->in_flight > 0)
        channel->reader->retire(std::move(cq));
}

void cq_state::arm_failed(int rc) noexcept {
    const int err = verbs::verb_errno(rc);
    if (err == EAGAIN || err == EINTR || err == ENOMEM || err == EBUSY) {
        // For a while only: unarmed, the CQ would raise no event. Its channel arms it again
        // (and polls it) on the next turn.
        ++channel->counters.arm_retries;
        channel->rearm_due = true;
        detail::loop(*channel->ctx).queue_poller(&channel->service);
        return;
    }
    const std::system_error e = make_system_error(err, "ibv_req_notify_cq");
    diagnose("%s", e.what());
    fail_waiters(e.code().value());
}

void cq_state::note_srq_receive(const ibv_wc& wc) noexcept {
    const auto it = srq_qps.find(wc.qp_num);
    if (it == srq_qps.end()) return;
    const bool receive =
        wc.status == IBV_WC_SUCCESS ? (wc.opcode & IBV_WC_RECV) != 0 : it->second.receives_only;
    if (receive) it->second.srq->consumed();
}

// Consumers fell behind by more than the CQ holds: grow (the only allocation here). Out of
// line, like note_srq_receive: inlined into the flattened dispatch(), their registers were
// saved and restored for every completion.
void cq_state::grow() noexcept {
    std::vector<ibv_wc> bigger(buffer.size() * 2);
    for (std::size_t i = 0; i < count; ++i)
        bigger[i] = buffer[(head + i) & (buffer.size() - 1)];
    buffer = std::move(bigger);
    head = 0;
}

void cq_state::fail_waiters(int err) noexcept {
    while (waiter* w = waiters.pop_front())
        w->fulfil(err);
}

} // namespace detail

cq::cq(channel& ch, cq_options o) {
    detail::channel_state& c = *ch.state_;
    int vector = o.comp_vector;
    if (vector < 0) {
        const int n = std::max(1, c.device.num_comp_vectors());
        vector = c.next_vector++ % n;
    }
    state_ = std::make_shared<detail::cq_state>(ch.state_, o.entries, vector, o.solicited_only);
}

cq::~cq() {
    if (!state_) return;
    state_->closed = true;
    state_->fail_waiters(ECANCELED);
    state_->count = 0;
}

} // namespace ringverbs
