// Signals on the ring: a set of signals, blocked in the thread's mask and read from a signalfd
// through io_uring, so that a coroutine can `co_await` the next one like any other event.
#pragma once

#include <ringverbs/config.hpp>

#include <ringverbs/engine/detail/io_awaiter.hpp>
#include <ringverbs/engine/error.hpp>
#include <ringverbs/engine/io_context.hpp>

#include <signal.h>
#include <sys/signalfd.h>

#include <cerrno>
#include <coroutine>
#include <cstdint>
#include <initializer_list>
#include <span>

namespace ringverbs {

namespace detail {
struct signal_read_prep {
    static constexpr const char* name = "signal_set::wait";
    int fd;
    signalfd_siginfo* info;
    void operator()(io_uring_sqe* sqe) const {
        io_uring_prep_read(sqe, fd, info, sizeof *info, static_cast<std::uint64_t>(-1));
    }
};

// One read of a signalfd_siginfo. The kernel writes into info_, so the awaitable stays in
// place (the awaiting coroutine's frame) from the co_await until the read's CQE arrived.
class signal_read {
  public:
    signal_read(const signal_read&) = delete;
    signal_read& operator=(const signal_read&) = delete;
    bool await_ready() noexcept { return op_.await_ready(); }
    void await_suspend(std::coroutine_handle<> h) { op_.await_suspend(h); }

  protected:
    signal_read(io_context& ctx, int fd, wait_options options) noexcept
        : op_(ctx, signal_read_prep{fd, &info_}, std::move(options)) {}
    // The signal read, or throws std::system_error "signal_set::wait".
    const signalfd_siginfo& result() {
        if (op_.await_resume() != static_cast<int>(sizeof info_))
            throw_system_error(EIO, "signal_set::wait (short read of the signalfd)");
        return info_;
    }

  private:
    signalfd_siginfo info_{};
    io_awaiter<signal_read_prep> op_;
};
} // namespace detail

// A set of signals that coroutines on one io_context await:
//
//   signal_set sigs(io, {SIGINT, SIGTERM});
//   int signo = co_await sigs.wait();                // or sigs.wait(wait_options{5s, stop})
//
// The constructor blocks the signals in the calling thread's mask (pthread_sigmask), so that
// they stay pending instead of running their disposition, and opens a signalfd for them
// (SFD_CLOEXEC | SFD_NONBLOCK). Each wait() reads one signal from it with an IORING_OP_READ.
//
// Threads: the mask is per thread. Construct, await and destroy the set on the thread that
// runs the io_context (its reads run in that thread's context, so a signal sent to that very
// thread, pthread_kill or raise, is read as well as one sent to the process). A signal sent to
// the process (kill, Ctrl-C) goes to any thread that does not block it, and runs its
// disposition there (SIGINT's and SIGTERM's default: terminate): every other thread must block
// the set's signals too. The simplest way is to construct the set before starting any thread,
// which inherits the mask. io_uring's own worker threads block every signal.
//
// Dispositions (handlers) are left alone: a blocked signal is read even when it is SIG_IGN, and
// once the set is gone the disposition applies again. A fault signal (SIGSEGV from a bad
// access) cannot be awaited: the kernel unblocks it and the process dies.
//
// Several sets of one signal on one thread: each signal is read by one of them; destroy them in
// the reverse order of their construction (the first one blocked the signal and unblocks it).
class signal_set {
  public:
    // Blocks `signals` in the calling thread and opens the signalfd. Throws std::system_error:
    // EINVAL "signal_set" for an empty list, SIGKILL or SIGSTOP (which cannot be blocked), or a
    // number that is no signal; otherwise naming the call that failed: "pthread_sigmask" or
    // "signalfd" (EMFILE, ...), after which the mask is as it was.
    signal_set(io_context& ctx, std::initializer_list<int> signals);
    signal_set(io_context& ctx, std::span<const int> signals);

    // Closes the signalfd, then restores the mask of the calling thread for the signals this
    // set blocked: exactly those of the set that were not blocked in the thread when it was
    // constructed are unblocked; a signal that was blocked before stays blocked. Those it
    // unblocks are discarded first when pending (sigtimedwait, zero timeout: they arrived for
    // the set), so destroying a set never runs the disposition of a signal it held. No wait may
    // be pending: a read of the closed signalfd would end only with the io_context's
    // destruction (operation_canceled). Must run on the constructing thread.
    ~signal_set();

    // Moves the signalfd and the duty to restore the mask (on the same thread). The moved-from
    // set restores nothing; waiting on it fails with EBADF.
    signal_set(signal_set&& other) noexcept;
    signal_set& operator=(signal_set&&) = delete;
    signal_set(const signal_set&) = delete;

    // co_await sigs.wait(): the number of the next signal of the set (at once when one is
    // pending). Standard signals sent several times before a read are merged into one by the
    // kernel; real-time signals (SIGRTMIN + n) queue. Errors: std::system_error
    // "signal_set::wait" with errc::timed_out, errc::operation_canceled (stop_token fired, or
    // the io_context is being destroyed), or the errno of the read. A cancelled wait reads no
    // signal; one that had read a signal before the cancellation took effect returns it.
    class wait_awaitable;
    wait_awaitable wait(wait_options options = {}) noexcept;

    // As wait(), but gives the whole record: ssi_signo, ssi_code (SI_USER for kill, SI_TKILL for
    // raise / pthread_kill, SI_QUEUE for sigqueue), ssi_pid and ssi_uid of the sender, ssi_int
    // (sigqueue's value), ... (signalfd(2)).
    class wait_info_awaitable;
    wait_info_awaitable wait_info(wait_options options = {}) noexcept;

    // The signalfd (-1 once moved from). It stays the set's: do not close it.
    int fd() const noexcept { return fd_; }

  private:
    io_context* ctx_;
    int fd_ = -1;
    sigset_t blocked_; // the signals the constructor blocked, unblocked by the destructor
};

// The awaitable signal_set::wait() returns. `co_await` gives the signal number, or throws
// std::system_error "signal_set::wait" (see wait()). Await it once, in place: the kernel writes
// into it, so it is neither copyable nor movable. The set must outlive the co_await.
class [[nodiscard]] signal_set::wait_awaitable : detail::signal_read {
  public:
    using signal_read::await_ready;
    using signal_read::await_suspend;
    int await_resume() { return static_cast<int>(result().ssi_signo); }

  private:
    friend class signal_set;
    wait_awaitable(io_context& ctx, int fd, wait_options options) noexcept
        : signal_read(ctx, fd, std::move(options)) {}
};

// The awaitable signal_set::wait_info() returns: as wait_awaitable, giving the signalfd_siginfo.
class [[nodiscard]] signal_set::wait_info_awaitable : detail::signal_read {
  public:
    using signal_read::await_ready;
    using signal_read::await_suspend;
    signalfd_siginfo await_resume() { return result(); }

  private:
    friend class signal_set;
    wait_info_awaitable(io_context& ctx, int fd, wait_options options) noexcept
        : signal_read(ctx, fd, std::move(options)) {}
};

inline signal_set::wait_awaitable signal_set::wait(wait_options options) noexcept {
    return {*ctx_, fd_, std::move(options)};
}

inline signal_set::wait_info_awaitable signal_set::wait_info(wait_options options) noexcept {
    return {*ctx_, fd_, std::move(options)};
}

} // namespace ringverbs
