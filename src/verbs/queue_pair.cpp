#include <ringverbs/verbs/detail/mmap_keys.hpp>
#include <ringverbs/verbs/queue_pair.hpp>
#include <ringverbs/verbs/verb_error.hpp>

#include <algorithm>
#include <string>

namespace ringverbs::verbs {

namespace {

const char* state_name(ibv_qp_state s) noexcept {
    switch (s) {
    case IBV_QPS_RESET:
        return "RESET";
    case IBV_QPS_INIT:
        return "INIT";
    case IBV_QPS_RTR:
        return "RTR";
    case IBV_QPS_RTS:
        return "RTS";
    case IBV_QPS_SQD:
        return "SQD";
    case IBV_QPS_SQE:
        return "SQE";
    case IBV_QPS_ERR:
        return "ERROR";
    default:
        return "UNKNOWN";
    }
}

void modify(ibv_qp* qp, ibv_qp_attr& attr, int mask) {
    const int ret = ibv_modify_qp(qp, &attr, mask);
    if (ret != 0)
        throw_system_error(verb_errno(ret), "ibv_modify_qp(qp " + std::to_string(qp->qp_num) +
                                                " to " + state_name(attr.qp_state) + ")");
}

// PSNs only need to differ between the two directions and from a stale connection's; a hash of
// the QP number is deterministic (reproducible tests) and does both.
std::uint32_t initial_psn(std::uint32_t qpn) noexcept {
    return (qpn * 0x9E3779B1u) & 0xFFFFFFu;
}

} // namespace

ibv_qp_init_attr rc_init_attr(ibv_cq* send_cq, ibv_cq* recv_cq, const qp_caps& caps,
                              ibv_srq* srq) noexcept {
    ibv_qp_init_attr init{};
    init.send_cq = send_cq;
    init.recv_cq = recv_cq;
    init.qp_type = IBV_QPT_RC;
    init.cap.max_send_wr = caps.max_send_wr;
    init.cap.max_recv_wr = srq != nullptr ? 0 : caps.max_recv_wr;
    init.cap.max_send_sge = caps.max_send_sge;
    init.cap.max_recv_sge = srq != nullptr ? 0 : caps.max_recv_sge;
    init.cap.max_inline_data = caps.max_inline_data;
    init.srq = srq;
    return init;
}

queue_pair::queue_pair(const protection_domain& pd, const completion_queue& send_cq,
                       const completion_queue& recv_cq, const qp_caps& caps, bool sq_sig_all,
                       ibv_srq* srq) {
    ibv_qp_init_attr init = rc_init_attr(send_cq.native(), recv_cq.native(), caps, srq);
    init.sq_sig_all = sq_sig_all ? 1 : 0;

    detail::prepare_for_queues(pd.native()->context);
    errno = 0;
    ibv_qp* raw = ibv_create_qp(pd.native(), &init);
    const int err = errno;
    if (raw == nullptr)
        throw_system_error(errno_or_eio(err),
                           "ibv_create_qp(RC, send_wr " + std::to_string(caps.max_send_wr) +
                               ", recv_wr " + std::to_string(caps.max_recv_wr) + ", send_sge " +
                               std::to_string(caps.max_send_sge) + ", recv_sge " +
                               std::to_string(caps.max_recv_sge) + ", inline " +
                               std::to_string(caps.max_inline_data) + ")" +
                               detail::create_failure_note(pd.native()->context, err));
    // The shares keep the PD and both CQs alive as long as the QP: verbs would refuse to destroy
    // them under a live QP (EBUSY) and the QP would be left pointing at nothing.
    qp_ = std::shared_ptr<ibv_qp>(raw, [pd_keep = pd.handle(), scq = send_cq.handle(),
                                        rcq = recv_cq.handle()](ibv_qp* q) { ibv_destroy_qp(q); });
    // ibv_create_qp writes back what the device granted.
    caps_ = qp_caps{init.cap.max_send_wr, init.cap.max_recv_wr, init.cap.max_send_sge,
                    init.cap.max_recv_sge, init.cap.max_inline_data};
}

ibv_qp_state queue_pair::state() const {
    ibv_qp_attr attr{};
    ibv_qp_init_attr init{};
    const int ret = ibv_query_qp(qp_.get(), &attr, IBV_QP_STATE, &init);
    if (ret != 0)
        throw_system_error(verb_errno(ret), "ibv_query_qp(qp " + std::to_string(qp_num()) + ")");
    return attr.qp_state;
}

void queue_pair::to_init(std::uint8_t port, access remote_rights, std::uint16_t pkey_index) {
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_INIT;
    attr.pkey_index = pkey_index;
    attr.port_num = port;
    attr.qp_access_flags = static_cast<unsigned>(to_ibv(remote_rights));
    modify(qp_.get(), attr, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
}

void queue_pair::to_rtr(const rtr_params& p) {
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_RTR;
    attr.path_mtu = p.mtu;
    attr.dest_qp_num = p.remote_qpn;
    attr.rq_psn = p.remote_psn & 0xFFFFFFu;
    attr.max_dest_rd_atomic = p.max_dest_rd_atomic;
    attr.min_rnr_timer = p.min_rnr_timer;
    // RoCE has no LIDs: the GRH carries the route, so it is always present. On InfiniBand a GRH
    // within one subnet is allowed too, and dlid routes.
    attr.ah_attr.is_global = 1;
    attr.ah_attr.grh.dgid = p.remote_gid;
    attr.ah_attr.grh.sgid_index = p.sgid_index;
    attr.ah_attr.grh.hop_limit = p.hop_limit;
    attr.ah_attr.grh.traffic_class = p.traffic_class;
    attr.ah_attr.grh.flow_label = p.flow_label;
    attr.ah_attr.dlid = p.remote_lid;
    attr.ah_attr.sl = p.service_level;
    attr.ah_attr.src_path_bits = 0;
    attr.ah_attr.port_num = p.port;
    modify(qp_.get(), attr,
           IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
               IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
}

void queue_pair::to_rts(const rts_params& p) {
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_RTS;
    attr.sq_psn = p.sq_psn & 0xFFFFFFu;
    attr.timeout = p.timeout;
    attr.retry_cnt = p.retry_cnt;
    attr.rnr_retry = p.rnr_retry;
    attr.max_rd_atomic = p.max_rd_atomic;
    modify(qp_.get(), attr,
           IBV_QP_STATE | IBV_QP_SQ_PSN | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
               IBV_QP_MAX_QP_RD_ATOMIC);
}

void queue_pair::to_error() {
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_ERR;
    modify(qp_.get(), attr, IBV_QP_STATE);
}

void queue_pair::reset() {
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_RESET;
    modify(qp_.get(), attr, IBV_QP_STATE);
}

void connect_loopback(queue_pair& a, queue_pair& b, std::uint8_t port, std::uint32_t gid_index,
                      access remote_rights, const rts_params& send_side) {
    ibv_context* ctx = a.native()->context;
    if (ctx->device != b.native()->context->device)
        throw_system_error(EINVAL, "connect_loopback: the two QPs belong to different devices");
    if (ctx->device->transport_type == IBV_TRANSPORT_IWARP)
        throw_system_error(EOPNOTSUPP,
                           std::string("connect_loopback: ") + ibv_get_device_name(ctx->device) +
                               " is an iWARP device, whose QPs are connected only by the iWARP "
                               "connection manager (connect(), listener, cm_id)");

    ibv_port_attr port_attr{};
    if (const int ret = ibv_query_port(ctx, port, &port_attr); ret != 0)
        throw_system_error(verb_errno(ret), "ibv_query_port(port " + std::to_string(port) + ")");
    ibv_gid_entry gid{};
    if (const int ret = ibv_query_gid_ex(ctx, port, gid_index, &gid, 0); ret != 0)
        throw_system_error(verb_errno(ret), "ibv_query_gid_ex(port " + std::to_string(port) +
                                                ", index " + std::to_string(gid_index) + ")");
    ibv_device_attr dev{};
    verb_check(ibv_query_device(ctx, &dev), "ibv_query_device");
    if (gid_index > 0xFF)
        throw_system_error(EINVAL, "connect_loopback: GID index " + std::to_string(gid_index) +
                                       " does not fit the 8-bit sgid_index of an address vector");

    // Deeper RDMA read pipelines cost device memory; 16 is plenty and every device of note has
    // at least that many or reports fewer, which then wins.
    const auto rd_in = static_cast<std::uint8_t>(std::clamp(dev.max_qp_rd_atom, 1, 16));
    const auto rd_out = static_cast<std::uint8_t>(std::clamp(dev.max_qp_init_rd_atom, 1, 16));

    auto connect_one = [&](queue_pair& self, const queue_pair& peer) {
        rtr_params rtr;
        rtr.port = port;
        rtr.remote_qpn = peer.qp_num();
        rtr.remote_psn = initial_psn(peer.qp_num());
        rtr.remote_gid = gid.gid;
        rtr.sgid_index = static_cast<std::uint8_t>(gid_index);
        rtr.remote_lid = port_attr.lid;
        rtr.mtu = port_attr.active_mtu;
        rtr.max_dest_rd_atomic = rd_in;
        self.to_rtr(rtr);
    };
    a.to_init(port, remote_rights);
    b.to_init(port, remote_rights);
    connect_one(a, b);
    connect_one(b, a);
    rts_params rts = send_side;
    rts.max_rd_atomic = rd_out;
    rts.sq_psn = initial_psn(a.qp_num());
    a.to_rts(rts);
    rts.sq_psn = initial_psn(b.qp_num());
    b.to_rts(rts);
}

} // namespace ringverbs::verbs
