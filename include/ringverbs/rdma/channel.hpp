// channel: a completion channel served by an io_context. Its CQ events are read by reads of
// its fd queued on the io_uring (event_read::ring), or, after a multishot io_uring poll says
// the fd is readable, with ibv_get_cq_event (event_read::syscall); the channel acks them in
// batches, re-arms each CQ and polls it until empty, then hands the completions to the
// coroutines awaiting them.
#pragma once

#include <ringverbs/config.hpp>

#include <ringverbs/engine/io_context.hpp>
#include <ringverbs/rdma/channel_options.hpp>
#include <ringverbs/rdma/counters.hpp>
#include <ringverbs/rdma/detail/rdma_state.hpp>
#include <ringverbs/verbs/context.hpp>

#include <chrono>
#include <cstdint>
#include <memory>

namespace ringverbs {

class cq;

// Owns an ibv_comp_channel (O_NONBLOCK, FD_CLOEXEC) attached to `ctx`. Many CQs may share one
// channel; several channels may serve one device (to route CQs to different threads, each with
// its own io_context, or to give groups of CQs different priorities).
//
// Lifetime: the channel's state lives until its last CQ is gone, so the handles may be
// destroyed in any order. Everything must be destroyed before the io_context, on its thread.
class channel {
  public:
    // Throws std::system_error naming ibv_create_comp_channel (EMFILE: out of file
    // descriptors), fcntl, or io_uring_submit.
    channel(io_context& ctx, const verbs::context& device, channel_options options = {});
    ~channel();
    channel(const channel&) = delete;
    channel& operator=(const channel&) = delete;

    const channel_counters& counters() const noexcept { return state_->counters; }
    polling_mode mode() const noexcept { return state_->options.mode; }
    // How events are read (events and hybrid modes): channel_options::read, or
    // event_read::syscall once the ring path was refused here, or starved (see event_read).
    event_read event_path() const noexcept { return state_->options.read; }
    int priority() const noexcept { return state_->options.priority; }
    io_context& context() const noexcept { return *state_->ctx; }
    int fd() const noexcept { return state_->channel.fd(); }
    // hybrid: the spin window in force (hybrid_spin, or between it and hybrid_spin_max).
    std::chrono::nanoseconds spin_window() const noexcept { return state_->spin_window; }
    // How many times the kernel ended the multishot poll on the fd and it was re-armed
    // (event_read::syscall).
    std::uint64_t rearms() const noexcept { return state_->watch ? state_->watch->rearms() : 0; }
    // 0 while the channel works; else the errno that ended it (the fd's poll or
    // ibv_get_cq_event or a ring read of the fd failed; ring reads short of memory for 1000
    // tries in a row switch to event_read::syscall instead): no event of its CQs is read any
    // more, for good, and their next() waits fail with that errno. The qps on those CQs are
    // reset: what they owe ends now with std::system_error of that errno ("a completion
    // channel of its QP's CQs failed"), and later posts are refused with it. So is an srq one
    // of those CQs receives for, with every qp on it, and a new qp on those CQs or that srq is
    // refused.
    int error() const noexcept { return state_->error; }

  private:
    friend class cq;
    std::shared_ptr<detail::channel_state> state_;
};

} // namespace ringverbs
