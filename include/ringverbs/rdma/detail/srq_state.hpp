// The runtime's state behind srq. Shared by the srq handle and every qp_state receiving from
// it, so that the handles may go in any order: the SRQ is destroyed (ibv_destroy_srq refuses
// while a QP uses it) when the last of them is gone.
#pragma once

#include <ringverbs/config.hpp>

#include <ringverbs/engine/detail/waiter.hpp>
#include <ringverbs/engine/io_context.hpp>
#include <ringverbs/rdma/detail/rdma_state.hpp>
#include <ringverbs/verbs/protection_domain.hpp>

#include <infiniband/verbs.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace ringverbs::detail {

// A waiter of srq::low_water(n): resumed once fewer than `below` receives are posted.
struct srq_low_water_waiter : waiter {
    std::uint32_t below = 0;
};

struct srq_state {
    io_context* ctx;
    std::shared_ptr<ibv_srq> srq; // ibv_destroy_srq; keeps its PD
    std::uint32_t max_wr = 0;     // as granted by the device
    // Per-request receives (srq::recv) owed a completion. A posted SRQ receive cannot be
    // recalled, and a QP error flushes only what its QP had taken: they end by their
    // completion, or when the state goes (made-up IBV_WC_WR_FLUSH_ERR).
    wr_op* pending = nullptr;
    std::size_t pending_count = 0;
    // The receive CQs of the QPs that used this SRQ: polled once more when the state goes, so
    // that a completion the device delivered before its QP was destroyed still reaches its
    // awaiter and none arrives after the made-up flush.
    std::vector<std::shared_ptr<cq_state>> recv_cqs;
    // Receives posted through the srq (both kinds) whose completion has not been polled yet:
    // at least what the device still holds, since it takes a receive before its completion
    // can be polled. srq::low_water() decides from it, because the device's limit event
    // comes only when it takes a receive (never for a limit armed below what it holds).
    std::size_t posted = 0;
    waiter_queue low_water_waiters; // of srq_low_water_waiter
    // The SRQ limit armed (ibv_modify_srq) whose IBV_EVENT_SRQ_LIMIT_REACHED has not come yet;
    // 0: none. At most one arm is outstanding: it is never replaced while armed (the device
    // disarms the SRQ as it raises the event, so a replaced arm's event may already be on its
    // way and would be taken for the new one's). So the next limit event is this arm's and
    // proves that the device held fewer than `armed_limit` receives.
    std::uint32_t armed_limit = 0;
    std::uint64_t limit_events = 0;
    // EIO after IBV_EVENT_SRQ_ERR: receives can no longer be relied on; ENODEV when lost;
    // the channel's errno when cut off (channel_failed).
    int error = 0;
    // What said that the device went away (detail::device_lost), or null: error is ENODEV,
    // what was owed ended (made up, device_lost_vendor_err), posts are refused.
    const char* lost = nullptr;
    // detail::device_lost posted this srq's loss to its thread already (registry's lock only).
    bool loss_told = false;
    // The errno with which a completion channel of one of its receive CQs failed, or 0. A
    // receive the device holds may be taken by any QP on the SRQ, and what a QP on that CQ
    // takes could never be read: so every QP on the SRQ is cut off (qp_state::mark_cut_off),
    // what was owed ends (made up, channel_failed_vendor_err), posts and new QPs are refused.
    int channel_failed = 0;
    bool cut_off_owed = false; // marked by channel_state::fail, finish_cut_off not run yet

    srq_state(io_context& c, const verbs::protection_domain& pd, std::uint32_t max_wr,
              std::uint32_t max_sge);
    ~srq_state();
    srq_state(const srq_state&) = delete;
    srq_state& operator=(const srq_state&) = delete;

    // Ends every receive still owed with a made-up IBV_WC_WR_FLUSH_ERR carrying `vendor_err`
    // (0, device_lost_vendor_err or channel_failed_vendor_err). Only once nothing can
    // complete them any more.
    void end_owed(std::uint32_t vendor_err) noexcept;
    // Throws std::system_error for a post once lost (ENODEV) or cut off (channel_failed).
    [[noreturn]] void refuse_post() const;
    void link(wr_op* op) noexcept;
    void unlink(wr_op* op) noexcept;
    // The completion of a receive of this SRQ was polled: one fewer posted, which resumes the
    // low_water() waiters whose limit that crosses.
    void consumed() noexcept;
    // Arms the SRQ limit at `limit` (throws std::system_error naming ibv_modify_srq).
    void arm(std::uint32_t limit);
    // The largest n of the low_water() waiters (0: none waits).
    std::uint32_t largest_waiting() const noexcept;
    // A QP receiving from this SRQ was made with `recv_cq`.
    void attach(const std::shared_ptr<cq_state>& recv_cq);
    // From device_events (the async event's routing). IBV_EVENT_SRQ_LIMIT_REACHED: resumes the
    // waiters whose n the armed limit proves crossed, or posted() does, and arms the SRQ again
    // for the largest n still waiting.
    void limit_reached() noexcept;
    void failed() noexcept;
    // A completion channel of one of its receive CQs failed (channel_state::fail): marks the
    // SRQ and every QP on it (not when lost or marked already); finish_cut_off then ends
    // those QPs' requests, polls the receive CQs and ends the receives still owed.
    void mark_cut_off(int err) noexcept;
    void finish_cut_off() noexcept;
    // What a lost device (lose_srq) and a cut off share: the low_water() waits end with `err`;
    // the QPs on the SRQ end first (`end_qp`: a reset, nothing of theirs completes after it),
    // then what their receive CQs still hold is polled, then the receives still owed end made
    // up with `vendor_err`: each exactly once.
    template <typename EndQp>
    void end_everything(int err, std::uint32_t vendor_err, EndQp end_qp) noexcept {
        while (waiter* w = low_water_waiters.pop_front())
            w->fulfil(err);
        for (auto& c : recv_cqs) {
            for (qp_state* q : c->qps)
                if (q->srq.get() == this) end_qp(*q);
            c->channel->drain_cq(*c);
            c->channel->run_deferred_watches_if_any(); // a recv_ring's violation on another QP
        }
        end_owed(vendor_err);
    }
};

} // namespace ringverbs::detail
