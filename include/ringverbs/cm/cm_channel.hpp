// cm_channel: an rdma_cm event channel on an io_context. Its event fd is watched by a multishot
// io_uring poll, like a completion channel; its events resume the coroutines awaiting address
// and route resolution, connect, accept and disconnect of the cm_ids created on it.
#pragma once

#include <ringverbs/config.hpp>

#include <ringverbs/cm/detail/cm_state.hpp>
#include <ringverbs/engine/io_context.hpp>

#include <chrono>
#include <cstdint>
#include <memory>

namespace ringverbs {

class cm_id;

struct cm_channel_options {
    // The bound of every rdma_cm step of the ids on this channel (resolve_addr, resolve_route,
    // connect, accept_connection) awaited without a timeout of its own: the await then ends
    // with std::system_error(errc::timed_out) naming the call. Without it, connecting to an
    // address where nothing answers waits as long as the IB CM retries its request (minutes).
    // A timeout in the call's wait_options replaces it; wait_options::no_timeout here removes
    // it. accept(), disconnect() and disconnected() wait for the peer and are not bounded.
    std::chrono::nanoseconds step_timeout = std::chrono::seconds(15);
};

// Owns an rdma_event_channel (O_NONBLOCK, FD_CLOEXEC) attached to `ctx`. One channel serves
// any number of ids, listening and connecting ones at once. Events are read, routed to their
// id and acked (rdma_ack_cm_event) in the same loop turn the fd turns readable.
//
// Lifetime: the channel's state lives until its last id is gone (rdma_destroy_event_channel
// only after every rdma_destroy_id), so the handles may be destroyed in any order. Everything
// must be destroyed before the io_context, on its thread.
class cm_channel {
  public:
    // Throws std::system_error naming rdma_create_event_channel (ENODEV: no rdma_cm support;
    // EMFILE), fcntl, or io_uring_submit.
    explicit cm_channel(io_context& ctx, cm_channel_options options = {});
    ~cm_channel();
    cm_channel(const cm_channel&) = delete;
    cm_channel& operator=(const cm_channel&) = delete;

    io_context& context() const noexcept { return *state_->ctx; }
    int fd() const noexcept { return state_->channel->fd; }
    // 0 while the channel works; else the errno that ended it (its fd's poll or
    // rdma_get_cm_event failed): no event of its ids is read any more, for good. Every id on
    // it then fails with that errno (its waits end, later steps throw at once), ids made on it
    // afterwards too.
    int error() const noexcept { return state_->error; }
    // rdma_cm events read so far.
    std::uint64_t events() const noexcept { return state_->events; }
    // How many times the kernel ended the multishot poll on the fd and it was re-armed.
    std::uint64_t rearms() const noexcept { return state_->watch ? state_->watch->rearms() : 0; }

  private:
    friend class cm_id;
    std::shared_ptr<detail::cm_channel_state> state_;
};

} // namespace ringverbs
