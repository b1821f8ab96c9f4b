#include <ringverbs/rdma/detail/device_loss.hpp>

#include <ringverbs/engine/diagnostics.hpp>
#include <ringverbs/rdma/detail/object_registry.hpp>
#include <ringverbs/rdma/detail/rdma_state.hpp>
#include <ringverbs/rdma/detail/srq_state.hpp>
#include <ringverbs/verbs/detail/mmap_keys.hpp>

#include <cerrno>

namespace ringverbs::detail {

namespace {

void lose_cq(cq_state& c, const char* cause) noexcept;

void lose_qp(qp_state& q, const char* cause) noexcept {
    if (q.lost) return;
    q.lost = cause;
    if (q.pending_count > 0)
        diagnose("qp %u: the RDMA device is gone (%s): its %zu owed requests end now",
                 q.qp.qp_num(), cause, q.pending_count);
    // The device may still run the QP (a removal waits for every user to close the device):
    // RESET makes sure nothing it holds completes after the made-up ends.
    q.reset(device_lost_vendor_err);
    q.in_error = true; // posts take the slow path, which refuses them
    // Its CQs too, now (of this thread, as a QP's CQs always are): whoever resumes next finds
    // them all marked.
    lose_cq(*q.send_cq, cause);
    lose_cq(*q.recv_cq, cause);
}

void lose_cq(cq_state& c, const char* cause) noexcept {
    if (c.lost) return;
    c.lost = cause;
    for (qp_state* q : c.qps)
        lose_qp(*q, cause); // of this thread: a QP's CQs belong to one io_context
    c.error = ENODEV;
    c.fail_waiters(ENODEV);
}

void lose_srq(srq_state& s, const char* cause) noexcept {
    if (s.lost) return;
    s.lost = cause;
    s.error = ENODEV;
    // Its qps are of this thread (the qp_state constructor refuses an srq of another).
    s.end_everything(ENODEV, device_lost_vendor_err, [cause](qp_state& q) { lose_qp(q, cause); });
}

// Posts `lose` for one object to `owner`; it runs there only if the object is still the one
// registered as `generation` (it may be gone, and its address reused, by then).
template <typename Object, typename State, typename Lose>
bool tell(io_context& owner, Object* object, std::uint64_t generation, const char* cause,
          Lose lose) noexcept {
    try {
        owner.post([object, generation, cause, lose] {
            with_object_of(object, generation, [&](State& s) { lose(s, cause); });
        });
        return true;
    } catch (...) {
        diagnose("device_lost: an object was not told that its device is gone (out of memory)");
        return false;
    }
}

} // namespace

std::size_t device_lost(ibv_context* device, const char* cause) noexcept {
    if (device == nullptr) return 0;
    std::size_t told = 0;
    lock_registry();
    try {
        device_objects on;
        objects_on(device->device->name, on);
        // In this order on each io_context (post() keeps it): the QPs stop producing
        // completions before an srq makes up the ends of its receives.
        // Each object is told once: rdma_cm reports DEVICE_REMOVAL on every id of the device,
        // usually all in one turn, before any loss posted here has run (`lost` is set only
        // there); re-posting for each would make N ids cost N times every object.
        for (auto& r : on.qps)
            if (!r.state->loss_told && !r.state->lost &&
                tell<ibv_qp, qp_state>(*r.state->ctx, r.object, r.generation, cause, lose_qp)) {
                r.state->loss_told = true;
                ++told;
            }
        for (auto& r : on.srqs)
            if (!r.state->loss_told && !r.state->lost &&
                tell<ibv_srq, srq_state>(*r.state->ctx, r.object, r.generation, cause, lose_srq)) {
                r.state->loss_told = true;
                ++told;
            }
        for (auto& r : on.cqs)
            if (!r.state->loss_told && !r.state->lost &&
                tell<ibv_cq, cq_state>(*r.state->channel->ctx, r.object, r.generation, cause,
                                       lose_cq)) {
                r.state->loss_told = true;
                ++told;
            }
    } catch (...) {
        diagnose("device_lost: out of memory: the device's objects were not told it is gone");
    }
    unlock_registry();
    verbs::detail::forget_device(device->device->name);
    return told + device_events_lost(device, cause);
}

} // namespace ringverbs::detail
