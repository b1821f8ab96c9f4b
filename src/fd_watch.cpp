#include <ringverbs/detail/fd_watch.hpp>

#include <poll.h>

#include <cerrno>

namespace ringverbs::detail {

fd_watch* fd_watch::start(io_context& ctx, int fd, std::shared_ptr<void> keep_open, void* owner,
                          ready_fn on_ready, error_fn on_error) {
    std::unique_ptr<fd_watch> w(new fd_watch);
    w->on_cqe = &fd_watch::cqe;
    w->ctx_ = &ctx;
    w->fd_ = fd;
    w->keep_open_ = std::move(keep_open);
    w->owner_ = owner;
    w->on_ready_ = on_ready;
    w->on_error_ = on_error;
    w->arm();
    return w.release();
}

void fd_watch::arm() {
    io_uring_sqe* sqe = ctx_->get_sqe();
    io_uring_prep_poll_multishot(sqe, fd_, POLLIN);
    io_uring_sqe_set_data(sqe, static_cast<operation*>(this));
    in_flight_ = true;
    ctx_->start_background();
}

void fd_watch::release() noexcept {
    if (!in_flight_) {
        delete this;
        return;
    }
    owner_ = nullptr;
    if (ctx_->shutting_down()) return; // ~io_context's cancel-all reaps the poll
    try {
        ctx_->cancel(this);
    } catch (...) {
        // The ring is unusable; ~io_context's cancel-all reaps the poll.
    }
}

void fd_watch::cqe(operation* op, int res, unsigned flags) noexcept {
    auto* w = static_cast<fd_watch*>(op);
    const bool final_cqe = !(flags & IORING_CQE_F_MORE);
    if (final_cqe) {
        w->in_flight_ = false;
        w->ctx_->finish_background();
    }
    if (w->owner_ == nullptr) { // orphaned: the owner is gone, the fd closes with us
        if (final_cqe) delete w;
        return;
    }
    if (res >= 0) {
        w->on_ready_(w->owner_);
    } else if (res != -ECANCELED) {
        w->failed_ = true;
        w->on_error_(w->owner_, -res);
        return;
    }
    if (final_cqe && !w->failed_ && !w->ctx_->shutting_down()) {
        try {
            w->arm();
            ++w->rearms_;
        } catch (const std::system_error& e) {
            w->failed_ = true;
            w->on_error_(w->owner_, e.code().value());
        }
    }
}

} // namespace ringverbs::detail
