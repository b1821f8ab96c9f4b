#include <ringverbs/verbs/completion_queue.hpp>
#include <ringverbs/verbs/detail/mmap_keys.hpp>

#include <string>

namespace ringverbs::verbs {

namespace detail {

owned_cq::~owned_cq() {
    if (cq == nullptr) return;
    if (const std::uint32_t n = unacked.exchange(0); n != 0) ibv_ack_cq_events(cq, n);
    // EBUSY is impossible here: QPs hold a share of this state, so none can still use the CQ.
    ibv_destroy_cq(cq);
}

void throw_poll_error(int ret) {
    throw_system_error(EIO, "ibv_poll_cq (the provider returned " + std::to_string(ret) + ")");
}

} // namespace detail

completion_queue::completion_queue(const context& ctx, int entries,
                                   const completion_channel* channel, int comp_vector,
                                   void* user_context) {
    const std::string what = "ibv_create_cq(entries " + std::to_string(entries) + ", comp_vector " +
                             std::to_string(comp_vector) + ")";
    if (comp_vector < 0 || comp_vector >= ctx.num_comp_vectors())
        throw_system_error(EINVAL, what + ": comp_vector is out of range, the device has " +
                                       std::to_string(ctx.num_comp_vectors()) +
                                       " completion vectors (0 .. num_comp_vectors() - 1)");

    auto state = std::make_shared<detail::owned_cq>();
    state->user_context = user_context;
    state->comp_vector = comp_vector;
    state->ctx = ctx.handle();
    if (channel != nullptr) state->channel = channel->handle();

    detail::prepare_for_queues(ctx.native());
    errno = 0;
    // cq_context is the state, not the user's pointer: completion_channel::get_event() needs it
    // to count unacked events, and its address does not move with the wrapper.
    state->cq = ibv_create_cq(ctx.native(), entries, state.get(),
                              channel != nullptr ? channel->native() : nullptr, comp_vector);
    if (state->cq == nullptr) {
        const int err = errno;
        throw_system_error(errno_or_eio(err),
                           what + detail::create_failure_note(ctx.native(), err));
    }
    state_ = std::move(state);
}

void completion_queue::ack_events(std::uint32_t n) {
    std::uint32_t have = state_->unacked.load(std::memory_order_relaxed);
    do {
        if (n > have)
            throw_system_error(EINVAL, "ibv_ack_cq_events: acking " + std::to_string(n) +
                                           " events but only " + std::to_string(have) +
                                           " are unacked");
    } while (!state_->unacked.compare_exchange_weak(have, have - n, std::memory_order_relaxed));
    if (n != 0) ibv_ack_cq_events(state_->cq, n);
}

} // namespace ringverbs::verbs
