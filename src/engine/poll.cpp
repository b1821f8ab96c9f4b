#include <ringverbs/engine/poll.hpp>

namespace ringverbs {

poll_stream::poll_stream(io_context& ctx, int fd, unsigned events)
    : state_(std::make_unique<state>()) {
    state_->ctx = &ctx;
    state_->fd = fd;
    // The fd is the caller's (open until the stream is gone): nothing to keep open. At
    // ~io_context the watch's end reaches the waiters as ECANCELED.
    state_->watch = detail::fd_watch::start(ctx, fd, nullptr, state_.get(), &poll_stream::ready,
                                            &poll_stream::failed, events, true);
}

poll_stream::~poll_stream() {
    if (!state_) return; // moved from
    state* s = state_.get();
    while (detail::waiter* w = s->waiters.pop_front())
        w->fulfil(ECANCELED);
    s->watch->release(); // cancelled; the watch frees itself on the kernel's last CQE
}

// What arrived goes to the first waiter (or waits in `pending` for the next one).
void poll_stream::ready(void* owner, unsigned revents) noexcept {
    auto* s = static_cast<state*>(owner);
    ++s->completions;
    s->pending |= revents;
    if (detail::waiter* w = s->waiters.pop_front()) {
        static_cast<next_awaitable*>(w)->revents_ = std::exchange(s->pending, 0u);
        w->fulfil(0);
    }
}

// A lasting failure (or the io_context's end): every waiter learns of it, and so will later ones.
void poll_stream::failed(void* owner, int err) noexcept {
    auto* s = static_cast<state*>(owner);
    s->error = err;
    while (detail::waiter* w = s->waiters.pop_front())
        w->fulfil(err);
}

} // namespace ringverbs
