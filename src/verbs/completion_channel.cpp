#include <ringverbs/verbs/completion_channel.hpp>

#include <ringverbs/verbs/completion_queue.hpp>
#include <ringverbs/verbs/detail/verbs_hooks.hpp>
#include <ringverbs/verbs/verb_error.hpp>

#include <fcntl.h>
#include <poll.h>

#include <algorithm>
#include <cstdint>

namespace ringverbs::verbs {

completion_channel::completion_channel(const context& ctx) {
    errno = 0;
    ibv_comp_channel* raw = ibv_create_comp_channel(ctx.native());
    if (raw == nullptr) throw_system_error(errno_or_eio(errno), "ibv_create_comp_channel");
    // ibv_destroy_comp_channel fails only with EBUSY while CQs use the channel; completion_queue
    // holds a share of it, so that cannot happen through ringverbs.
    ch_ = std::shared_ptr<ibv_comp_channel>(
        raw, [keep = ctx.handle()](ibv_comp_channel* c) { ibv_destroy_comp_channel(c); });

    const int fl = fcntl(raw->fd, F_GETFL);
    if (fl == -1) throw_system_error(errno, "fcntl(F_GETFL) on the completion channel");
    if ((fl & O_NONBLOCK) == 0 && fcntl(raw->fd, F_SETFL, fl | O_NONBLOCK) == -1)
        throw_system_error(errno, "fcntl(F_SETFL, O_NONBLOCK) on the completion channel");
    // Linux's uverbs already hands the fd out close-on-exec; other kernels or old ones may not,
    // and a leaked event fd in a child would keep the channel (and its CQs) alive.
    const int fdfl = fcntl(raw->fd, F_GETFD);
    if (fdfl == -1) throw_system_error(errno, "fcntl(F_GETFD) on the completion channel");
    if ((fdfl & FD_CLOEXEC) == 0 && fcntl(raw->fd, F_SETFD, fdfl | FD_CLOEXEC) == -1)
        throw_system_error(errno, "fcntl(F_SETFD, FD_CLOEXEC) on the completion channel");
}

std::optional<cq_event> completion_channel::get_event() {
    ibv_cq* cq = nullptr;
    void* cq_context = nullptr;
    errno = 0;
    // Through the runtime's hook table (a test may put a fault injector there).
    if (ringverbs::verbs::detail::hooks().get_cq_event(ch_.get(), &cq, &cq_context) != 0) {
        const int err = errno;
        if (err == EAGAIN || err == EWOULDBLOCK) return std::nullopt;
        throw_system_error(errno_or_eio(err), "ibv_get_cq_event");
    }
    auto* state = static_cast<detail::owned_cq*>(cq_context);
    state->unacked.fetch_add(1, std::memory_order_relaxed);
    return cq_event{cq, state->user_context};
}

cq_event completion_channel::take_event(std::uint64_t cq_handle) noexcept {
    return detail::take_cq_event(cq_handle); // inline there for the runtime's read path
}

std::optional<cq_event> completion_channel::wait_event(std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
        // Another reader may drain the fd between poll and read, so readiness is only a hint.
        if (auto ev = get_event()) return ev;
        const auto now = std::chrono::steady_clock::now();
        if (now >= deadline) return std::nullopt;
        // Rounded up: a truncated wait would end a fraction of a millisecond early.
        const auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - now);
        pollfd pfd{.fd = ch_->fd, .events = POLLIN, .revents = 0};
        const int n = ::poll(&pfd, 1, static_cast<int>(std::min<long long>(left.count(), 1 << 30)));
        if (n == -1 && errno != EINTR) throw_system_error(errno, "poll on the completion channel");
    }
}

} // namespace ringverbs::verbs
