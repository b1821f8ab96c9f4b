// verbs_hooks: the verbs calls of the completion path (completion_channel in this layer; the
// rdma layer's channel, cq, qp, srq and recv_ring), made through a table of function pointers
// so that a test can put a fault injector between the runtime and the real device.
#pragma once

#include <ringverbs/config.hpp>

#include <infiniband/verbs.h>

namespace ringverbs::verbs::detail {

// Every entry defaults to the real verb. A test replaces entries with functions that call the
// saved originals and then hide, delay or fail what the device did (a completion that never
// comes, a post that fails at the k-th request): faults between us and a real device, never a
// mock of it. Change the table only while no io_context runs a channel or a qp.
struct verbs_hooks {
    int (*poll_cq)(ibv_cq* cq, int n, ibv_wc* wc) noexcept;
    int (*post_send)(ibv_qp* qp, ibv_send_wr* wr, ibv_send_wr** bad) noexcept;
    int (*post_recv)(ibv_qp* qp, ibv_recv_wr* wr, ibv_recv_wr** bad) noexcept;
    int (*post_srq_recv)(ibv_srq* srq, ibv_recv_wr* wr, ibv_recv_wr** bad) noexcept;
    int (*req_notify_cq)(ibv_cq* cq, int solicited_only) noexcept;
    // 0, or -1 with errno set, like ibv_get_cq_event.
    int (*get_cq_event)(ibv_comp_channel* channel, ibv_cq** cq, void** cq_context) noexcept;
    // The ring path's counterpart of get_cq_event (channel_options::read = event_read::ring),
    // asked each time a read of the channel's fd is about to be queued on the io_uring: 0
    // queues it; a negative errno ends that read at once with this result instead, before it
    // read anything, as the kernel ends an interrupted one (-EINTR). The real one returns 0.
    int (*start_event_read)(ibv_comp_channel* channel) noexcept;
    // The qp's own state changes (to ERR, to RESET); 0 or an errno, like ibv_modify_qp.
    int (*modify_qp)(ibv_qp* qp, ibv_qp_attr* attr, int attr_mask) noexcept;
};

// The real start_event_read: nothing to fail, returns 0. Named so that the read path can skip
// the call while no test replaced it (start_event_read() below).
int no_event_read_fault(ibv_comp_channel* channel) noexcept;

// The table in force (one per process), constant-initialized to the real verbs. Reached
// inline: the completion path reads it on every poll, arm, post and event read.
extern verbs_hooks hooks_table;
inline verbs_hooks& hooks() noexcept {
    return hooks_table;
}

// hooks().start_event_read(channel), without the call while it is the real one.
inline int start_event_read(ibv_comp_channel* channel) noexcept {
    const auto f = hooks_table.start_event_read;
    return f == &no_event_read_fault ? 0 : f(channel);
}
// The real verbs, to restore the table or to call from a hook.
const verbs_hooks& real_verbs() noexcept;

} // namespace ringverbs::verbs::detail
