#include <ringverbs/engine/io_context.hpp>
#include <ringverbs/engine/signal_set.hpp>
#include <ringverbs/engine/timer.hpp>

#include <doctest/doctest.h>

#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <set>
#include <stop_token>
#include <string>
#include <system_error>
#include <thread>
#include <type_traits>
#include <utility>

using namespace std::chrono_literals;
using ringverbs::io_context;
using ringverbs::signal_set;
using ringverbs::task;
using ringverbs::wait_options;

// The public surface: wait() returns a named awaitable that only the library builds, and that
// stays in place (the kernel writes the signal into it).
static_assert(
    std::is_same_v<decltype(std::declval<signal_set&>().wait()), signal_set::wait_awaitable>);
static_assert(!std::is_move_constructible_v<signal_set::wait_awaitable>);
static_assert(!std::is_constructible_v<signal_set::wait_awaitable, io_context&, int, wait_options>);
static_assert(std::is_nothrow_move_constructible_v<signal_set>);
static_assert(!std::is_copy_constructible_v<signal_set>);

namespace {

bool blocked(int signo) {
    sigset_t mask;
    pthread_sigmask(SIG_BLOCK, nullptr, &mask);
    return sigismember(&mask, signo) == 1;
}

bool pending(int signo) {
    sigset_t set;
    sigpending(&set);
    return sigismember(&set, signo) == 1;
}

void set_blocked(int signo, bool block) {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, signo);
    pthread_sigmask(block ? SIG_BLOCK : SIG_UNBLOCK, &set, nullptr);
}

std::errc error_of(const std::system_error& e) {
    return static_cast<std::errc>(e.code().value());
}

// What an await of a wait gave: the signal, or the error.
struct outcome {
    int signo = 0;
    std::errc error{};
    std::string what;
};

task<outcome> wait_for_signal(signal_set& sigs, wait_options options = {}) {
    outcome o;
    try {
        o.signo = co_await sigs.wait(std::move(options));
    } catch (const std::system_error& e) {
        o.error = error_of(e);
        o.what = e.what();
    }
    co_return o;
}

// Every test leaves the thread as it found it: nothing of ours blocked or pending.
void check_clean() {
    CHECK(!blocked(SIGUSR1));
    CHECK(!blocked(SIGUSR2));
    CHECK(!pending(SIGUSR1));
    CHECK(!pending(SIGUSR2));
}

} // namespace

TEST_CASE("a signal raised before the wait is given at once") {
    {
        io_context ctx;
        signal_set sigs(ctx, {SIGUSR1, SIGUSR2});
        CHECK(sigs.fd() >= 0);
        REQUIRE(raise(SIGUSR1) == 0);
        CHECK(pending(SIGUSR1)); // blocked: it waits for the set instead of killing us
        CHECK(ctx.run(wait_for_signal(sigs)).signo == SIGUSR1);
        CHECK(!pending(SIGUSR1));
    }
    check_clean();
}

TEST_CASE("a signal sent to the process wakes the awaiting coroutine") {
    {
        io_context ctx;
        signal_set sigs(ctx, {SIGUSR1});
        bool sent = false;
        auto sender = [&]() -> task<void> {
            co_await ringverbs::sleep_for(ctx, 5ms);
            sent = true;
            REQUIRE(kill(getpid(), SIGUSR1) == 0);
        };
        auto waiter = [&]() -> task<bool> {
            const int signo = co_await sigs.wait();
            co_return signo == SIGUSR1&& sent;
        };
        ctx.spawn(sender());
        CHECK(ctx.run(waiter()));
        CHECK(ctx.operations_in_flight() == 0);
    }
    check_clean();
}

TEST_CASE("two signals queued are read by two waits") {
    {
        io_context ctx;
        signal_set sigs(ctx, {SIGUSR1, SIGUSR2});
        REQUIRE(raise(SIGUSR2) == 0);
        REQUIRE(raise(SIGUSR1) == 0);
        auto both = [&]() -> task<std::set<int>> {
            std::set<int> got;
            got.insert(co_await sigs.wait());
            got.insert(co_await sigs.wait());
            co_return got;
        };
        CHECK(ctx.run(both()) == std::set<int>{SIGUSR1, SIGUSR2});
        // Nothing left: a third wait times out.
        CHECK(ctx.run(wait_for_signal(sigs, wait_options(5ms))).error == std::errc::timed_out);
    }
    check_clean();
}

TEST_CASE("real-time signals queue, and wait_info gives each one's value and sender") {
    const int rt = SIGRTMIN + 1;
    {
        io_context ctx;
        signal_set sigs(ctx, {rt});
        REQUIRE(sigqueue(getpid(), rt, sigval{.sival_int = 1}) == 0);
        REQUIRE(sigqueue(getpid(), rt, sigval{.sival_int = 2}) == 0);
        auto two = [&]() -> task<void> {
            for (int value = 1; value <= 2; ++value) {
                const signalfd_siginfo info = co_await sigs.wait_info(wait_options(5s));
                CHECK(static_cast<int>(info.ssi_signo) == rt);
                CHECK(info.ssi_code == SI_QUEUE);
                CHECK(info.ssi_int == value);
                CHECK(info.ssi_pid == static_cast<std::uint32_t>(getpid()));
                CHECK(info.ssi_uid == static_cast<std::uint32_t>(getuid()));
            }
        };
        ctx.run(two());
    }
    CHECK(!blocked(SIGRTMIN + 1));
    check_clean();
}

TEST_CASE("a wait with a timeout ends with timed_out and reads nothing") {
    {
        io_context ctx;
        signal_set sigs(ctx, {SIGUSR1});
        const outcome o = ctx.run(wait_for_signal(sigs, wait_options(5ms)));
        CHECK(o.error == std::errc::timed_out);
        CHECK(o.what.find("signal_set::wait") != std::string::npos);
        CHECK(ctx.operations_in_flight() == 0);
        // The set works on: a signal after the timeout is read by the next wait.
        REQUIRE(raise(SIGUSR1) == 0);
        CHECK(ctx.run(wait_for_signal(sigs, wait_options(5s))).signo == SIGUSR1);
    }
    check_clean();
}

TEST_CASE("a stop_token cancels a wait, which leaves a pending signal to the next wait") {
    {
        io_context ctx;
        signal_set sigs(ctx, {SIGUSR1});
        std::stop_source stop;
        auto stopper = [&]() -> task<void> {
            co_await ringverbs::sleep_for(ctx, 5ms);
            stop.request_stop();
        };
        ctx.spawn(stopper());
        const outcome o = ctx.run(wait_for_signal(sigs, wait_options(10s, stop.get_token())));
        CHECK(o.error == std::errc::operation_canceled);
        CHECK(o.what.find("signal_set::wait") != std::string::npos);
        CHECK(ctx.operations_in_flight() == 0);

        // Already stopped: cancelled without reading the signal that is pending.
        REQUIRE(raise(SIGUSR1) == 0);
        CHECK(ctx.run(wait_for_signal(sigs, stop.get_token())).error ==
              std::errc::operation_canceled);
        CHECK(pending(SIGUSR1));
        CHECK(ctx.run(wait_for_signal(sigs)).signo == SIGUSR1);
    }
    check_clean();
}

TEST_CASE("the destructor unblocks exactly the signals the set blocked") {
    set_blocked(SIGUSR2, true); // blocked by someone else before the set
    {
        io_context ctx;
        signal_set sigs(ctx, {SIGUSR1, SIGUSR2});
        CHECK(blocked(SIGUSR1));
        CHECK(blocked(SIGUSR2));
    }
    CHECK(!blocked(SIGUSR1)); // blocked by the set: unblocked
    CHECK(blocked(SIGUSR2));  // blocked before: still blocked
    set_blocked(SIGUSR2, false);
    check_clean();
}

namespace {
volatile std::sig_atomic_t handled = 0;
void count_signal(int) {
    handled = handled + 1;
}
} // namespace

TEST_CASE("a signal still pending at destruction is discarded, not delivered") {
    struct sigaction counting {
    }, before{};
    counting.sa_handler = &count_signal;
    sigemptyset(&counting.sa_mask);
    REQUIRE(sigaction(SIGUSR1, &counting, &before) == 0);
    handled = 0;
    {
        io_context ctx;
        signal_set sigs(ctx, {SIGUSR1});
        REQUIRE(raise(SIGUSR1) == 0);
        CHECK(pending(SIGUSR1));
    }
    CHECK(handled == 0);
    CHECK(!pending(SIGUSR1));
    // And the disposition applies again once the set is gone.
    REQUIRE(raise(SIGUSR1) == 0);
    CHECK(handled == 1);
    sigaction(SIGUSR1, &before, nullptr);
    check_clean();
}

TEST_CASE("a blocked signal is read even when its disposition is SIG_IGN") {
    struct sigaction ignore {
    }, before{};
    ignore.sa_handler = SIG_IGN;
    sigemptyset(&ignore.sa_mask);
    REQUIRE(sigaction(SIGUSR1, &ignore, &before) == 0);
    {
        io_context ctx;
        signal_set sigs(ctx, {SIGUSR1});
        REQUIRE(kill(getpid(), SIGUSR1) == 0);
        CHECK(ctx.run(wait_for_signal(sigs, wait_options(5s))).signo == SIGUSR1);
    }
    sigaction(SIGUSR1, &before, nullptr);
    check_clean();
}

TEST_CASE("nested sets of one signal: the outer one restores the mask") {
    {
        io_context ctx;
        signal_set outer(ctx, {SIGUSR1});
        {
            signal_set inner(ctx, {SIGUSR1});
            REQUIRE(raise(SIGUSR1) == 0);
            CHECK(ctx.run(wait_for_signal(inner)).signo == SIGUSR1);
        }
        CHECK(blocked(SIGUSR1)); // the inner set did not block it: it leaves it blocked
    }
    check_clean();
}

TEST_CASE("a moved set keeps the fd and the duty to restore the mask") {
    {
        io_context ctx;
        signal_set first(ctx, {SIGUSR1});
        const int fd = first.fd();
        signal_set second(std::move(first));
        CHECK(first.fd() == -1);
        CHECK(second.fd() == fd);
        REQUIRE(raise(SIGUSR1) == 0);
        CHECK(ctx.run(wait_for_signal(second)).signo == SIGUSR1);
        CHECK(ctx.run(wait_for_signal(first)).error == std::errc::bad_file_descriptor);
        CHECK(blocked(SIGUSR1));
    }
    check_clean();
}

TEST_CASE("bad signal lists throw EINVAL and leave the mask alone") {
    io_context ctx;
    auto error_for = [&](std::initializer_list<int> signals) {
        try {
            signal_set sigs(ctx, signals);
        } catch (const std::system_error& e) {
            CHECK(std::string(e.what()).find("signal_set") != std::string::npos);
            return error_of(e);
        }
        return std::errc{};
    };
    CHECK(error_for({}) == std::errc::invalid_argument);
    CHECK(error_for({SIGUSR1, SIGKILL}) == std::errc::invalid_argument);
    CHECK(error_for({SIGSTOP}) == std::errc::invalid_argument);
    CHECK(error_for({SIGUSR1, 0}) == std::errc::invalid_argument);
    CHECK(error_for({SIGUSR1, 1000}) == std::errc::invalid_argument);
    check_clean();
}

TEST_CASE("a failing signalfd names the call and restores the mask") {
    io_context ctx;
    rlimit before{};
    REQUIRE(getrlimit(RLIMIT_NOFILE, &before) == 0);
    const int lowest_free = dup(0);
    REQUIRE(lowest_free >= 0);
    close(lowest_free);
    rlimit tight = before;
    tight.rlim_cur = static_cast<rlim_t>(lowest_free); // no new fd fits
    REQUIRE(setrlimit(RLIMIT_NOFILE, &tight) == 0);
    std::string what;
    std::errc error{};
    try {
        signal_set sigs(ctx, {SIGUSR1});
    } catch (const std::system_error& e) {
        what = e.what();
        error = error_of(e);
    }
    setrlimit(RLIMIT_NOFILE, &before);
    CHECK(error == std::errc::too_many_files_open);
    CHECK(what.find("signalfd") != std::string::npos);
    check_clean();
}

TEST_CASE("a signal sent by another thread to the owning thread is read") {
    {
        io_context ctx;
        signal_set sigs(ctx, {SIGUSR1});
        const pthread_t owner = pthread_self();
        std::thread sender([owner] {
            std::this_thread::sleep_for(20ms); // most likely while the coroutine waits
            pthread_kill(owner, SIGUSR1);
        });
        auto waiter = [&]() -> task<signalfd_siginfo> {
            co_return co_await sigs.wait_info(wait_options(10s));
        };
        const signalfd_siginfo info = ctx.run(waiter());
        sender.join();
        CHECK(static_cast<int>(info.ssi_signo) == SIGUSR1);
        CHECK(info.ssi_code == SI_TKILL);
    }
    check_clean();
}

TEST_CASE("a signal sent to the process by a thread that blocks it too is read") {
    {
        io_context ctx;
        signal_set sigs(ctx, {SIGUSR2});
        // Started after the set: the thread inherits the mask, so the kernel cannot deliver
        // the signal to it.
        std::atomic<bool> sender_blocks{false};
        std::thread sender([&sender_blocks] {
            sender_blocks = blocked(SIGUSR2);
            std::this_thread::sleep_for(20ms);
            kill(getpid(), SIGUSR2);
        });
        const outcome o = ctx.run(wait_for_signal(sigs, wait_options(10s)));
        sender.join();
        CHECK(sender_blocks);
        CHECK(o.signo == SIGUSR2);
    }
    check_clean();
}
