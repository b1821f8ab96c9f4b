#include <ringverbs/poll.hpp>

namespace ringverbs {

poll_stream::poll_stream(io_context& ctx, int fd, unsigned events)
    : state_(std::make_unique<state>()) {
    state_->on_cqe = &poll_stream::on_cqe;
    state_->ctx = &ctx;
    state_->fd = fd;
    state_->events = events;
    arm(state_.get());
}

poll_stream::~poll_stream() {
    if (!state_) return; // moved from
    state* s = state_.get();
    while (detail::waiter* w = s->waiters.pop_front()) w->fulfil(ECANCELED);
    if (s->in_flight) {
        // The kernel still owes the final CQE: hand the state over to it.
        s->orphaned = true;
        if (!s->ctx->shutting_down()) {
            try {
                s->ctx->cancel(s);
            } catch (...) {
                // The ring is unusable; the io_context destructor's cancel-all reaps it.
            }
        }
        (void)state_.release();
    }
}

void poll_stream::arm(state* s) {
    io_uring_sqe* sqe = s->ctx->get_sqe();
    io_uring_prep_poll_multishot(sqe, s->fd, s->events);
    io_uring_sqe_set_data(sqe, static_cast<detail::operation*>(s));
    s->in_flight = true;
    s->ctx->start_background();
}

void poll_stream::detach(void* source, detail::waiter* w) noexcept {
    static_cast<state*>(source)->waiters.remove(w);
}

void poll_stream::on_cqe(detail::operation* op, int res, unsigned flags) noexcept {
    auto* s = static_cast<state*>(op);
    const bool final_cqe = !(flags & IORING_CQE_F_MORE);
    if (final_cqe) {
        s->in_flight = false;
        s->ctx->finish_background();
    }
    if (s->orphaned) {
        if (final_cqe) delete s;
        return;
    }
    if (res >= 0) {
        ++s->completions;
        s->pending |= static_cast<unsigned>(res);
    } else if (res == -ECANCELED && s->ctx->shutting_down()) {
        s->error = ECANCELED;
    } else if (res != -ECANCELED) {
        s->error = -res;
    }
    if (final_cqe && s->error == 0 && !s->ctx->shutting_down()) {
        try {
            arm(s);
            ++s->rearms;
        } catch (const std::system_error& e) {
            s->error = e.code().value();
        }
    }
    // Hand what arrived to the first waiter; on failure, every waiter learns of it.
    if (s->error != 0) {
        while (detail::waiter* w = s->waiters.pop_front()) w->fulfil(s->error);
    } else if (s->pending != 0) {
        if (detail::waiter* w = s->waiters.pop_front()) {
            static_cast<next_awaiter*>(w)->revents = std::exchange(s->pending, 0u);
            w->fulfil(0);
        }
    }
}

} // namespace ringverbs
