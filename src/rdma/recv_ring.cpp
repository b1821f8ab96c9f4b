// recv_ring: a qp's receive queue kept stocked from slots of one registered buffer.
#include <ringverbs/rdma/recv_ring.hpp>

#include <ringverbs/rdma/completion_error.hpp>
#include <ringverbs/rdma/detail/outcome.hpp>
#include <ringverbs/verbs/detail/verbs_hooks.hpp>
#include <ringverbs/verbs/verb_error.hpp>

#include <string>
#include <utility>

namespace ringverbs {

namespace detail {

using verbs::detail::hooks;

void recv_ring_state::post(std::uint32_t i) {
    slot& s = slots[i];
    qp->before_post("ibv_post_recv (recv_ring)");
    ibv_recv_wr* bad = nullptr;
    s.wr.next = nullptr;
    if (const int rc = hooks().post_recv(qp->qp.native(), &s.wr, &bad); rc != 0)
        throw_system_error(verbs::verb_errno(rc), "ibv_post_recv (recv_ring)");
    s.posted = true;
    s.done = false;
    qp->link(&s);
    qp->after_post(true);
}

void recv_ring_state::repost_held() {
    if (!waiters.empty())
        throw_system_error(EBUSY, "recv_ring::next (another next() is waiting: a ring has one "
                                  "consumer at a time)");
    // A failure at the head is what the next next() reports; nothing is posted after it.
    if (!holding || (slots[head].done && slots[head].failed())) return;
    post(held); // on failure still held: the next next() tries again
    holding = false;
}

bool recv_ring_state::owed() const noexcept {
    for (std::uint32_t i = 0; i < count; ++i)
        if (slots[i].posted) return true;
    return false;
}

bool recv_ring_state::hand_out(recv_ring_waiter& w) noexcept {
    slot& s = slots[head];
    if (!s.done) return false;
    w.wc = s.wc;
    w.closed = s.closed;
    w.violation = s.violation;
    w.length = s.length;
    w.slot_size = size;
    w.data = memory.get() + std::size_t{head} * size;
    // A failure stays at the head: every later next() reports it too.
    if (!s.failed()) {
        s.done = false;
        held = head;
        holding = true;
        head = head + 1 == count ? 0 : head + 1;
    }
    return true;
}

void recv_ring_state::completed(wr_op* op, const ibv_wc& wc, bool) noexcept {
    auto* s = static_cast<slot*>(op);
    recv_ring_state* r = s->owner;
    s->posted = false;
    s->done = true;
    s->wc = wc;
    // Flushed because its device went away or its channel failed (cut off): reads as that.
    if (wc.status == IBV_WC_WR_FLUSH_ERR)
        if (const std::uint32_t v = r->qp->cut_off_vendor_err(); v != 0) s->wc.vendor_err = v;
    s->closed = wc.status != IBV_WC_SUCCESS && r->qp->flushed_by_closed_connection(wc);
    s->violation = false;
    s->length = 0;
    if (wc.status == IBV_WC_SUCCESS) {
        // The peer chose the length and the opcode: nothing past the slot is handed out.
        if (wc.opcode == IBV_WC_RECV && wc.byte_len <= r->size)
            s->length = wc.byte_len;
        else if (wc.opcode != IBV_WC_RECV_RDMA_WITH_IMM)
            s->violation = true;
    }
    r->qp->unlink(s);
    // The connection cannot be trusted: its QP ends (inside the poll: its flush watch after it).
    if (s->violation) r->qp->to_error_in_poll();
    if (r->orphaned || r->waiters.empty() || !r->slots[r->head].done) return;
    auto* w = static_cast<recv_ring_waiter*>(r->waiters.pop_front());
    r->hand_out(*w);
    w->handed = true;
    r->handed = w;
    w->fulfil(0);
}

} // namespace detail

recv_ring::recv_ring(qp& q, const verbs::protection_domain& pd, std::uint32_t count,
                     std::uint32_t size)
    : qp_(q.state_) {
    if (count == 0 || size == 0)
        throw_system_error(EINVAL, "recv_ring (count and size must not be 0)");
    if (qp_->srq)
        throw_system_error(
            EINVAL, "recv_ring (the qp receives from an srq: its receives are posted there)");
    if (count > qp_->qp.caps().max_recv_wr)
        throw_system_error(EINVAL, "recv_ring (" + std::to_string(count) +
                                       " receives, but the qp's receive queue holds " +
                                       std::to_string(qp_->qp.caps().max_recv_wr) + ")");
    if (qp_->recv_ring) throw_system_error(EBUSY, "recv_ring (the qp already has one)");
    auto s = std::make_shared<detail::recv_ring_state>();
    s->qp = qp_.get();
    s->ctx = qp_->ctx;
    s->count = count;
    s->size = size;
    const std::size_t bytes = std::size_t{count} * size;
    s->memory = std::make_unique<std::byte[]>(bytes);
    s->mr.emplace(pd, std::span<std::byte>(s->memory.get(), bytes));
    s->slots = std::make_unique<detail::recv_ring_state::slot[]>(count);
    for (std::uint32_t i = 0; i < count; ++i) {
        auto& slot = s->slots[i];
        slot.owner = s.get();
        slot.on_wc = &detail::recv_ring_state::completed;
        slot.sge.addr = reinterpret_cast<std::uintptr_t>(s->memory.get() + std::size_t{i} * size);
        slot.sge.length = size;
        slot.sge.lkey = s->mr->native()->lkey;
        slot.wr.wr_id = detail::wr_id_for(&slot, true);
        slot.wr.sg_list = &slot.sge;
        slot.wr.num_sge = 1;
    }
    // Owned by the qp's state before the first post: from then on a completion names a slot.
    qp_->recv_ring = s;
    try {
        for (std::uint32_t i = 0; i < count; ++i)
            s->post(i);
    } catch (...) {
        // What was posted cannot be recalled: the QP goes to the error state, the slots stay
        // with the qp's state until their flushes came. With nothing posted, they go now.
        s->orphaned = true;
        if (s->owed())
            qp_->to_error();
        else
            qp_->recv_ring.reset();
        throw;
    }
    state_ = std::move(s);
}

recv_ring::~recv_ring() {
    state_->orphaned = true;
    if (detail::recv_ring_waiter* w = std::exchange(state_->handed, nullptr))
        w->abandoned = true; // readied with bytes of a slot that may go now: it ends cancelled
    while (detail::waiter* w = state_->waiters.pop_front())
        w->fulfil(ECANCELED);
    if (state_->owed())
        qp_->to_error(); // the slots stay with the qp's state until their flushes came
    else
        qp_->recv_ring.reset(); // nothing names a slot: the qp may have another ring
    // The last owner of the qp's state ends it as ~qp does; otherwise the qp handle will.
    if (qp_.use_count() == 1) detail::qp_state::release(std::move(qp_));
}

std::uint32_t recv_ring::ready() const noexcept {
    std::uint32_t n = 0;
    for (std::uint32_t i = state_->head; n < state_->count && state_->slots[i].done;
         i = i + 1 == state_->count ? 0 : i + 1)
        ++n;
    return n;
}

recv_ring::message recv_ring::next_awaitable::await_resume() {
    const int err = decided() ? error() : 0;
    if (handed) {
        handed = false;
        if (abandoned)
            throw_system_error(ECANCELED, "recv_ring::next (the ring was destroyed before the "
                                          "awaiting coroutine resumed)");
        state_->handed = nullptr;
    }
    if (stopped)
        throw_system_error(ECANCELED, "recv_ring::next (stop requested; messages ready stay in "
                                      "the ring)");
    if (err != 0) throw_system_error(err, "recv_ring::next");
    if (violation)
        throw_system_error(EPROTO, "recv_ring::next: a receive completion the slot cannot hold "
                                   "(byte_len " +
                                       std::to_string(wc.byte_len) + ", opcode " +
                                       std::to_string(static_cast<int>(wc.opcode)) + ", slots of " +
                                       std::to_string(slot_size) +
                                       " bytes): the QP was moved to the error state");
    if (wc.status != IBV_WC_SUCCESS) detail::throw_failed_completion(wc, "recv_ring::next", closed);
    return {std::span<std::byte>(data, length), wc};
}

} // namespace ringverbs
