// A reliable-connected queue pair (ibv_qp of type IBV_QPT_RC) and its state machine
// RESET -> INIT -> RTR -> RTS.
#pragma once

#include <ringverbs/config.hpp>

#include <ringverbs/verbs/access.hpp>
#include <ringverbs/verbs/completion_queue.hpp>
#include <ringverbs/verbs/protection_domain.hpp>
#include <ringverbs/verbs/verb_error.hpp>

#include <infiniband/verbs.h>

#include <cstdint>
#include <memory>

namespace ringverbs::verbs {

// Queue sizes asked for at creation. The device may round up; queue_pair::caps() has the result.
struct qp_caps {
    std::uint32_t max_send_wr = 64;
    std::uint32_t max_recv_wr = 64;
    std::uint32_t max_send_sge = 1;
    std::uint32_t max_recv_sge = 1;
    // Bytes a send may carry inline (copied at post time, no MR needed); 0 disables.
    std::uint32_t max_inline_data = 0;
};

// INIT -> RTR: where the remote QP is and how to talk to it.
struct rtr_params {
    // Local port the QP uses (1-based).
    std::uint8_t port = 1;
    std::uint32_t remote_qpn = 0;
    // The first PSN the remote sends (its rts_params::sq_psn); 24 bits.
    std::uint32_t remote_psn = 0;
    // Remote GID; RoCE always routes by GID, so it is always sent in a GRH.
    ibv_gid remote_gid{};
    // Local GID index that selects source address and RoCE version.
    std::uint8_t sgid_index = 0;
    // Remote LID; InfiniBand only, ignored on RoCE (leave 0).
    std::uint16_t remote_lid = 0;
    // Path MTU: at most the port's active_mtu on both sides.
    ibv_mtu mtu = IBV_MTU_1024;
    // RDMA reads/atomics the remote may have outstanding against us; <= device max_qp_rd_atom.
    std::uint8_t max_dest_rd_atomic = 1;
    // RNR NAK timer code sent when a send finds no posted receive (12 = 0.64 ms).
    std::uint8_t min_rnr_timer = 12;
    std::uint8_t hop_limit = 64;
    std::uint8_t traffic_class = 0;
    std::uint32_t flow_label = 0;
    std::uint8_t service_level = 0;
};

// RTR -> RTS: retransmission behaviour of the send side.
struct rts_params {
    // First PSN this QP sends; 24 bits.
    std::uint32_t sq_psn = 0;
    // Ack timeout code: 4.096 us * 2^timeout (14 = 67 ms).
    std::uint8_t timeout = 14;
    // Retries on timeout before the QP errors out (max 7).
    std::uint8_t retry_cnt = 7;
    // Retries after an RNR NAK (the peer had no receive posted), each after the peer's
    // min_rnr_timer; then the send fails with IBV_WC_RNR_RETRY_EXC_ERR and the QP errors out.
    // 6 (the largest finite count): a peer that never posts receives ends the connection instead
    // of stalling its sends for ever. 7 means retry forever.
    std::uint8_t rnr_retry = 6;
    // RDMA reads/atomics this QP may have outstanding; <= device max_qp_init_rd_atom.
    std::uint8_t max_rd_atomic = 1;
};

// The ibv_qp_init_attr of an RC QP on these CQs with `caps` (and, with `srq`, its receives
// from that shared receive queue: the caps' receive sizes are then 0), as queue_pair and
// cm_id::create_qp (rdma_create_qp) both create it.
ibv_qp_init_attr rc_init_attr(ibv_cq* send_cq, ibv_cq* recv_cq, const qp_caps& caps,
                              ibv_srq* srq = nullptr) noexcept;

// RAII, move-only owner of an RC ibv_qp.
//
// Ownership: holds shares of its PD and both CQs, so those stay alive while the QP exists. Memory
// regions named in posted work requests are not tracked: keep them alive until their
// completions are polled.
class queue_pair {
  public:
    // Creates an RC QP in RESET state. With sq_sig_all every send produces a completion;
    // otherwise only sends flagged IBV_SEND_SIGNALED do. Throws std::system_error naming
    // ibv_create_qp (EINVAL for caps beyond the device limits, ENOMEM when out of QPs).
    // With `srq`, receives come from that shared receive queue (the caps' receive sizes are
    // then ignored) and the QP takes no ibv_post_recv.
    queue_pair(const protection_domain& pd, const completion_queue& send_cq,
               const completion_queue& recv_cq, const qp_caps& caps = {}, bool sq_sig_all = false,
               ibv_srq* srq = nullptr);

    // Adopts an RC QP created elsewhere (rdma_create_qp, whose QP must be destroyed with
    // rdma_destroy_qp): `owned`'s deleter destroys it and holds whatever the QP needs alive (its
    // PD, CQs, cm id). `granted` are the caps the creator wrote back. The QP may already be past
    // RESET (rdma_cm moves it to INIT).
    queue_pair(std::shared_ptr<ibv_qp> owned, const qp_caps& granted) noexcept
        : qp_(std::move(owned)), caps_(granted) {}

    // Destroys the QP at once (nothing else holds it): work still queued is dropped without
    // completions. Then drops the shares of the PD and CQs.
    ~queue_pair() = default;
    // Moving transfers ownership; the moved-from object is empty (operator bool is false) and
    // may only be assigned to or destroyed. Move assignment releases the target's previous share.
    queue_pair(queue_pair&&) noexcept = default;
    queue_pair& operator=(queue_pair&&) noexcept = default;
    queue_pair(const queue_pair&) = delete;
    queue_pair& operator=(const queue_pair&) = delete;

    // The raw QP (null after a move). Owned by this object: do not destroy.
    [[nodiscard]] ibv_qp* native() const noexcept { return qp_.get(); }
    [[nodiscard]] ibv_qp* get() const noexcept { return qp_.get(); }

    // False only for a moved-from object.
    explicit operator bool() const noexcept { return qp_ != nullptr; }

    // The QP number a peer needs to connect (rtr_params::remote_qpn).
    [[nodiscard]] std::uint32_t qp_num() const noexcept { return qp_->qp_num; }

    // The queue sizes the device granted.
    [[nodiscard]] const qp_caps& caps() const noexcept { return caps_; }

    // The current state as the device reports it. Throws std::system_error naming ibv_query_qp.
    [[nodiscard]] ibv_qp_state state() const;

    // RESET -> INIT on `port`, granting peers `remote_rights` (remote_write, remote_read,
    // remote_atomic; none by default) through this QP. Throws std::system_error naming
    // ibv_modify_qp and the transition.
    void to_init(std::uint8_t port, access remote_rights = access::none,
                 std::uint16_t pkey_index = 0);

    // INIT -> RTR: ready to receive from the QP described by `p`. Throws as to_init().
    void to_rtr(const rtr_params& p);

    // RTR -> RTS: ready to send. Throws as to_init().
    void to_rts(const rts_params& p);

    // Any state -> ERROR: outstanding work requests complete with IBV_WC_WR_FLUSH_ERR. Throws as
    // to_init().
    void to_error();

    // Any state -> RESET: drops outstanding work (no completions) so the QP can be connected
    // again. Poll its CQs first if their completions matter. Throws as to_init().
    void reset();

    // Posts a chain of send work requests. Throws std::system_error naming ibv_post_send
    // (ENOMEM: send queue full; EINVAL: bad request or wrong state). On failure, the requests
    // before the offending one were posted. A failure that names no request bad does not
    // throw: the provider queued every request and only its doorbell failed (siw and rxe ring
    // it with a system call: siw refuses it with ENOTCONN in any state but RTS and ERROR, e.g.
    // while its connection ends, and flushes what its queue holds once the QP is in ERROR; rxe
    // with EINVAL before RTS). Those requests complete like any posted one (flushed, or sent
    // once in RTS), so a caller that counts what it posted counts them. After such a refusal
    // siw's provider does not ring again while that request sits unprocessed, so the send
    // queue stalls: to_error() ends what it holds.
    void post_send(ibv_send_wr& wr) {
        ibv_send_wr* bad = nullptr;
        if (const int rc = ibv_post_send(qp_.get(), &wr, &bad); rc != 0 && bad != nullptr)
            verb_check(rc, "ibv_post_send");
    }

    // Posts a chain of receive work requests. Throws as post_send(), naming ibv_post_recv (a
    // receive has no doorbell on siw and rxe: a failure names its request, or none was queued).
    void post_recv(ibv_recv_wr& wr) {
        ibv_recv_wr* bad = nullptr;
        verb_check(ibv_post_recv(qp_.get(), &wr, &bad), "ibv_post_recv");
    }

  private:
    std::shared_ptr<ibv_qp> qp_;
    qp_caps caps_;
};

// Connects two QPs of the same device to each other through `port` and local GID `gid_index`
// (RoCE: traffic loops back inside the device). Uses the port's active MTU, the device's largest
// RDMA read depth (capped at 16), and distinct PSNs; both QPs end in RTS granting
// `remote_rights`. The QPs must be in RESET. Throws std::system_error naming the verb that failed
// (ibv_query_port, ibv_query_gid_ex, ibv_modify_qp); EOPNOTSUPP on an iWARP device, whose QPs only
// the iWARP connection manager connects (rdma_cm: connect(), listener, cm_id).
// `send_side` gives the retransmission behaviour (timeout, retry_cnt, rnr_retry); its sq_psn
// and max_rd_atomic are replaced as above.
void connect_loopback(queue_pair& a, queue_pair& b, std::uint8_t port, std::uint32_t gid_index,
                      access remote_rights = access::none, const rts_params& send_side = {});

} // namespace ringverbs::verbs
