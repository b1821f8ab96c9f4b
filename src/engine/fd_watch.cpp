#include <ringverbs/engine/detail/fd_watch.hpp>

#include <poll.h>

#include <cerrno>

namespace ringverbs::detail {

namespace {
// Errors with which the kernel may end a poll for a while only (memory, a full CQ).
bool transient(int err) noexcept {
    return err == ENOMEM || err == EAGAIN || err == EINTR || err == ENOBUFS || err == EBUSY;
}
} // namespace

fd_watch* fd_watch::start(io_context& ctx, int fd, std::shared_ptr<void> keep_open, void* owner,
                          ready_fn on_ready, error_fn on_error, unsigned events,
                          bool report_shutdown) {
    static_assert(POLLIN == 0x001);
    std::unique_ptr<fd_watch> w(new fd_watch);
    w->on_cqe = &fd_watch::cqe;
    w->ctx_ = &ctx;
    w->fd_ = fd;
    w->events_ = events;
    w->report_shutdown_ = report_shutdown;
    w->keep_open_ = std::move(keep_open);
    w->owner_ = owner;
    w->on_ready_ = on_ready;
    w->on_error_ = on_error;
    w->retry_.watch = w.get();
    w->retry_.run = &fd_watch::retry;
    w->arm();
    return w.release();
}

void fd_watch::arm() {
    io_uring_sqe* sqe = detail::loop(*ctx_).get_sqe();
    io_uring_prep_poll_multishot(sqe, fd_, events_);
    io_uring_sqe_set_data(sqe, static_cast<operation*>(this));
    in_flight_ = true;
    detail::loop(*ctx_).start_background();
}

void fd_watch::release() noexcept {
    detail::loop(*ctx_).dequeue_poller(&retry_);
    if (!in_flight_) {
        delete this;
        return;
    }
    owner_ = nullptr;
    if (ctx_->shutting_down()) return; // ~io_context's cancel-all reaps the poll
    try {
        detail::loop(*ctx_).cancel(this);
    } catch (...) {
        // The ring is unusable; ~io_context's cancel-all reaps the poll.
    }
}

void fd_watch::fail(int err) noexcept {
    failed_ = true;
    on_error_(owner_, err);
}

// The poll is not armed (its final CQE came) and must be: now, or from the next turn.
void fd_watch::rearm_or_retry() noexcept {
    if (failed_ || ctx_->shutting_down()) return;
    try {
        arm();
        ++rearms_;
        failed_attempts_ = 0;
    } catch (const std::system_error& e) {
        if (++failed_attempts_ >= max_retries) {
            fail(e.code().value());
            return;
        }
        ++retries_;
        detail::loop(*ctx_).queue_poller(&retry_);
    }
}

void fd_watch::retry(poller* p) noexcept {
    fd_watch* w = static_cast<retry_poller*>(p)->watch;
    if (w->in_flight_) return;
    w->rearm_or_retry();
}

void fd_watch::cqe(operation* op, int res, unsigned flags) noexcept {
    auto* w = static_cast<fd_watch*>(op);
    const bool final_cqe = !(flags & IORING_CQE_F_MORE);
    if (final_cqe) {
        w->in_flight_ = false;
        detail::loop(*w->ctx_).finish_background();
    }
    if (w->owner_ == nullptr) { // orphaned: the owner is gone, the fd closes with us
        if (final_cqe) delete w;
        return;
    }
    if (res >= 0) {
        w->on_ready_(w->owner_, static_cast<unsigned>(res));
    } else if (res != -ECANCELED && !transient(-res)) {
        w->fail(-res);
        return;
    }
    if (final_cqe && w->ctx_->shutting_down()) {
        if (w->report_shutdown_) w->fail(ECANCELED);
        return;
    }
    if (final_cqe) w->rearm_or_retry();
}

} // namespace ringverbs::detail
