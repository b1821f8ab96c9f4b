#include <ringverbs/engine/signal_set.hpp>

#include <pthread.h>
#include <unistd.h>

#include <cerrno>
#include <ctime>
#include <string>
#include <utility>

namespace ringverbs {

namespace {

// Discards what of `set` is pending for this thread (its own or the process's), then unblocks
// `set`: the end of a set's duty for the signals it blocked. (Not skipped for an empty set:
// glibc 2.36's sigisemptyset() calls a set of only real-time signals empty.)
void discard_and_unblock(const sigset_t& set) noexcept {
    const timespec zero{};
    for (;;) {
        if (sigtimedwait(&set, nullptr, &zero) > 0) continue;
        if (errno == EINTR) continue; // a handler of another signal ran
        break;                        // EAGAIN: nothing of the set is pending
    }
    pthread_sigmask(SIG_UNBLOCK, &set, nullptr); // cannot fail with SIG_UNBLOCK and a valid set
}

} // namespace

signal_set::signal_set(io_context& ctx, std::initializer_list<int> signals)
    : signal_set(ctx, std::span<const int>(signals.begin(), signals.size())) {}

signal_set::signal_set(io_context& ctx, std::span<const int> signals) : ctx_(&ctx) {
    sigemptyset(&blocked_);
    if (signals.empty()) throw_system_error(EINVAL, "signal_set: no signal given");
    sigset_t set;
    sigemptyset(&set);
    for (const int signo : signals) {
        if (signo == SIGKILL || signo == SIGSTOP)
            throw_system_error(EINVAL, "signal_set: SIGKILL and SIGSTOP cannot be blocked");
        // glibc also refuses the signals it keeps for itself (32 and 33: thread cancellation).
        if (sigaddset(&set, signo) != 0)
            throw_system_error(errno, "signal_set: " + std::to_string(signo) + " is no signal");
    }
    sigset_t before;
    if (const int err = pthread_sigmask(SIG_BLOCK, &set, &before); err != 0)
        throw_system_error(err, "pthread_sigmask");
    for (const int signo : signals)
        if (sigismember(&before, signo) == 0) sigaddset(&blocked_, signo);
    // SFD_NONBLOCK matters: io_uring then reads by polling the fd and retrying in this thread's
    // context, where the signals sent to this very thread are visible. On a blocking signalfd
    // it would retry in one of its worker threads, which sees only the process's signals.
    fd_ = signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK);
    if (fd_ < 0) {
        const int err = errno;
        discard_and_unblock(blocked_);
        throw_system_error(err, "signalfd");
    }
}

signal_set::signal_set(signal_set&& other) noexcept
    : ctx_(other.ctx_), fd_(std::exchange(other.fd_, -1)), blocked_(other.blocked_) {
    sigemptyset(&other.blocked_);
}

signal_set::~signal_set() {
    if (fd_ < 0) return; // moved from
    ::close(fd_);
    discard_and_unblock(blocked_);
}

} // namespace ringverbs
