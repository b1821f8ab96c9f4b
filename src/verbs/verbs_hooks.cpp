#include <ringverbs/verbs/detail/verbs_hooks.hpp>

namespace ringverbs::verbs::detail {

int no_event_read_fault(ibv_comp_channel*) noexcept {
    return 0;
}

namespace {
// ibv_poll_cq, ibv_post_* and ibv_req_notify_cq are inline functions of verbs.h: each entry
// is a plain function that calls the verb.
constexpr verbs_hooks real{
    [](ibv_cq* cq, int n, ibv_wc* wc) noexcept { return ibv_poll_cq(cq, n, wc); },
    [](ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad) noexcept {
        return ibv_post_send(qp, wr, bad);
    },
    [](ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad) noexcept {
        return ibv_post_recv(qp, wr, bad);
    },
    [](ibv_srq* srq, ibv_recv_wr* wr, ibv_recv_wr** bad) noexcept {
        return ibv_post_srq_recv(srq, wr, bad);
    },
    [](ibv_cq* cq, int solicited_only) noexcept { return ibv_req_notify_cq(cq, solicited_only); },
    [](ibv_comp_channel* ch, ibv_cq** cq, void** ctx) noexcept {
        return ibv_get_cq_event(ch, cq, ctx);
    },
    &no_event_read_fault,
    [](ibv_qp* qp, ibv_qp_attr* attr, int mask) noexcept { return ibv_modify_qp(qp, attr, mask); },
};
} // namespace

// Nothing in this file reads it: here a read could be bound to this library's own copy
// (-fno-semantic-interposition), not to the process's (a test program's copy relocation moves
// it). Everything else reads it through hooks() (verbs_hooks.hpp).
constinit verbs_hooks hooks_table = real;

const verbs_hooks& real_verbs() noexcept {
    return real;
}

} // namespace ringverbs::verbs::detail
