// fd_watch: a multishot io_uring poll on a long-lived fd (a completion channel, an rdma_cm
// event channel), as background work of an io_context.
#pragma once

#include <ringverbs/config.hpp>

#include <ringverbs/engine/detail/operation.hpp>
#include <ringverbs/engine/io_context.hpp>

#include <cstdint>
#include <memory>

namespace ringverbs::detail {

// Invariants:
// - Its own heap object, because it may outlive its owner: when the owner goes while the
//   kernel still owes the poll's final CQE, release() cancels the poll and orphans the watch,
//   which frees itself on that CQE. `keep_open` (a share of whatever owns the fd) keeps the
//   fd open until then: the fd is never closed under a live poll.
// - Re-armed whenever the kernel ends the multishot poll (a CQE without IORING_CQE_F_MORE),
//   unless the owner failed or the context is being destroyed. A transient failure (the
//   poll ended with ENOMEM, EAGAIN, EINTR, ENOBUFS or EBUSY, or no SQE could be had to re-arm
//   it) is retried on the next loop turn, from a poller: on_error is for failures that last
//   (EBADF, EINVAL..., or max_retries turns in a row without an SQE).
// - on_ready / on_error run in the CQE loop: they must not resume coroutines inline.
class fd_watch : operation {
  public:
    using ready_fn = void (*)(void* owner, unsigned revents) noexcept;
    using error_fn = void (*)(void* owner, int err) noexcept; // err: a positive errno

    // Arms the poll for `events`. With `report_shutdown`, the poll's end at ~io_context is
    // reported to on_error as ECANCELED (for owners whose waiters must learn of it). Throws
    // std::system_error naming io_uring_submit.
    static fd_watch* start(io_context& ctx, int fd, std::shared_ptr<void> keep_open, void* owner,
                           ready_fn on_ready, error_fn on_error,
                           unsigned events = 0x001 /* POLLIN */, bool report_shutdown = false);
    // For the owner's destructor: cancels the poll and hands the watch over to the kernel's
    // last CQE, or frees it now when none is owed.
    void release() noexcept;

    std::uint64_t rearms() const noexcept { return rearms_; }
    // Re-arms that failed for a while and were retried on a later turn.
    std::uint64_t retries() const noexcept { return retries_; }

    static constexpr unsigned max_retries = 1000;

  private:
    struct retry_poller : poller {
        fd_watch* watch = nullptr;
    };

    fd_watch() = default;
    void arm();
    void rearm_or_retry() noexcept;
    void fail(int err) noexcept;
    static void cqe(operation* op, int res, unsigned flags) noexcept;
    static void retry(poller* p) noexcept;

    io_context* ctx_ = nullptr;
    int fd_ = -1;
    unsigned events_ = 0;
    bool report_shutdown_ = false;
    std::shared_ptr<void> keep_open_;
    void* owner_ = nullptr; // null once orphaned
    ready_fn on_ready_ = nullptr;
    error_fn on_error_ = nullptr;
    bool in_flight_ = false;
    bool failed_ = false;
    std::uint64_t rearms_ = 0;
    std::uint64_t retries_ = 0;
    unsigned failed_attempts_ = 0; // consecutive re-arms that could not get an SQE
    retry_poller retry_;
};

} // namespace ringverbs::detail
