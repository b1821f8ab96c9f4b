// A completion channel (ibv_comp_channel): the file descriptor through which armed completion
// queues announce "there are new completions". The runtime polls this fd with io_uring.
#pragma once

#include <ringverbs/config.hpp>

#include <ringverbs/verbs/context.hpp>

#include <infiniband/verbs.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>

namespace ringverbs::verbs {

// One completion event read from a channel: which CQ fired.
struct cq_event {
    // The raw CQ that fired.
    ibv_cq* cq = nullptr;
    // The user_context given to that completion_queue's constructor (to find the owner).
    void* user_context = nullptr;
};

// RAII, move-only owner of an ibv_comp_channel whose fd is non-blocking and close-on-exec.
//
// Non-blocking, because the fd is meant to be polled (io_uring, poll(2)) and then drained: a
// blocking read on a drained channel would stall the thread that runs the event loop.
//
// Ownership: holds a share of its context; every completion_queue attached to it holds a share
// of it, so it is destroyed only after its last CQ (verbs would refuse with EBUSY otherwise).
//
// Every CQ attached to a channel must be a completion_queue: get_event() reads the CQ's
// cq_context as ringverbs' own bookkeeping, which is how completion_queue knows how many events
// it must ack before it can be destroyed.
class completion_channel {
  public:
    // Creates the channel and makes its fd O_NONBLOCK and FD_CLOEXEC. Throws std::system_error
    // naming ibv_create_comp_channel (EMFILE: the process is out of file descriptors) or the
    // fcntl that failed.
    explicit completion_channel(const context& ctx);

    // Drops this object's share; the object itself goes when its last holder does.
    ~completion_channel() = default;
    // Moving transfers ownership; the moved-from object is empty (operator bool is false) and
    // may only be assigned to or destroyed. Move assignment releases the target's previous share.
    completion_channel(completion_channel&&) noexcept = default;
    completion_channel& operator=(completion_channel&&) noexcept = default;
    completion_channel(const completion_channel&) = delete;
    completion_channel& operator=(const completion_channel&) = delete;

    // The raw channel (null after a move). Owned by this object and its CQs: do not destroy.
    // Events read directly with ibv_get_cq_event must be acked directly with ibv_ack_cq_events;
    // completion_queue::ack_events() only acks events that came through get_event().
    [[nodiscard]] ibv_comp_channel* native() const noexcept { return ch_.get(); }
    [[nodiscard]] ibv_comp_channel* get() const noexcept { return ch_.get(); }

    // A share of the raw channel that keeps it (and its context) alive.
    [[nodiscard]] const std::shared_ptr<ibv_comp_channel>& handle() const noexcept { return ch_; }

    // False only for a moved-from object.
    explicit operator bool() const noexcept { return ch_ != nullptr; }

    // The fd to poll for readability; it stays owned by the channel.
    [[nodiscard]] int fd() const noexcept { return ch_->fd; }

    // Reads one pending event without blocking, or returns nullopt when none is pending. The
    // event counts as unacked on its completion_queue until completion_queue::ack_events(); the
    // CQ is disarmed by the event and must be re-armed (req_notify) for the next one. Throws
    // std::system_error naming ibv_get_cq_event for any error other than EAGAIN.
    [[nodiscard]] std::optional<cq_event> get_event();

    // Takes an event that was read from fd() by other means (an io_uring read of one
    // struct ib_uverbs_comp_event_desc, whose cq_handle is given here) and does what
    // ibv_get_cq_event does after its read(): runs the provider's cq_event hook (mlx4, mlx5,
    // hns... count arms there; see docs/design.md) and counts the event as unacked on its
    // completion_queue, exactly as get_event() does. Every event read from the fd must come
    // through here or get_event(): ibv_destroy_cq waits for each one to be acked. Never throws.
    [[nodiscard]] static cq_event take_event(std::uint64_t cq_handle) noexcept;

    // Waits up to `timeout` for an event with poll(2), then reads it as get_event() does;
    // nullopt on timeout. For tests and simple threads; an event loop polls fd() instead.
    // Throws std::system_error naming poll or ibv_get_cq_event.
    [[nodiscard]] std::optional<cq_event> wait_event(std::chrono::milliseconds timeout);

  private:
    std::shared_ptr<ibv_comp_channel> ch_;
};

} // namespace ringverbs::verbs
