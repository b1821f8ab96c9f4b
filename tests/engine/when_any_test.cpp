#include <ringverbs/engine/diagnostics.hpp>
#include <ringverbs/engine/io_context.hpp>
#include <ringverbs/engine/poll.hpp>
#include <ringverbs/engine/timer.hpp>
#include <ringverbs/engine/when_all.hpp>
#include <ringverbs/engine/when_any.hpp>

#include <doctest/doctest.h>

#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <new>
#include <stdexcept>
#include <stop_token>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <variant>
#include <vector>

using namespace std::chrono_literals;
using ringverbs::io_context;
using ringverbs::task;
using ringverbs::when_any;

// Counts every allocation through the global operator new, for the test that when_any
// allocates nothing but frames and the stop source's state.
namespace {
std::size_t allocations = 0;
}

void* operator new(std::size_t size) {
    ++allocations;
    if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
    throw std::bad_alloc();
}
void operator delete(void* p) noexcept {
    std::free(p);
}
void operator delete(void* p, std::size_t) noexcept {
    std::free(p);
}

namespace {

// The public surface: the results are plain aggregates of the tasks' value types.
static_assert(std::is_same_v<decltype(std::declval<ringverbs::when_any_result<int, void>>().value),
                             std::variant<int, std::monostate>>);

std::vector<std::string> diagnostics;

void capture(std::string_view message) noexcept {
    diagnostics.emplace_back(message);
}

struct sink_guard {
    ringverbs::diagnostics_sink previous;
    sink_guard() noexcept : previous(ringverbs::set_diagnostics_sink(&capture)) {
        diagnostics.clear();
    }
    ~sink_guard() { ringverbs::set_diagnostics_sink(previous); }
};

bool is_cancellation(const std::system_error& e) {
    return e.code() == std::errc::operation_canceled;
}

// Sets its flag when the frame that holds it is destroyed.
struct on_destroy {
    bool* flag;
    ~on_destroy() { *flag = true; }
};

// A task that sleeps `d` (observing `st`) and gives `v`; records its events in `log`.
task<int> sleeper(io_context& io, std::chrono::milliseconds d, int v, std::stop_token st,
                  std::vector<std::string>& log, bool& destroyed) {
    on_destroy guard{&destroyed};
    try {
        co_await ringverbs::sleep_for(io, d, st);
    } catch (const std::system_error& e) {
        if (is_cancellation(e)) log.push_back("canceled " + std::to_string(v));
        throw;
    }
    log.push_back("finished " + std::to_string(v));
    co_return v;
}

} // namespace

TEST_CASE("the first task to finish wins; the others are stopped and destroyed before it returns") {
    sink_guard sink;
    io_context io;
    std::vector<std::string> log;
    bool fast_gone = false, slow_gone = false;
    auto t0 = std::chrono::steady_clock::now();
    auto outer = [&]() -> task<void> {
        auto r = co_await when_any(
            io, [&](std::stop_token st) { return sleeper(io, 5s, 1, st, log, slow_gone); },
            [&](std::stop_token st) { return sleeper(io, 10ms, 2, st, log, fast_gone); });
        log.push_back("returned");
        CHECK(r.index == 1);
        CHECK(std::get<1>(r.value) == 2);
        CHECK(fast_gone);
        CHECK(slow_gone);
    };
    io.run(outer());
    CHECK(log == std::vector<std::string>{"finished 2", "canceled 1", "returned"});
    CHECK(std::chrono::steady_clock::now() - t0 < 4s);
    CHECK(diagnostics.empty()); // a loser's cancellation is expected: nothing to say
}

TEST_CASE("the winner's exception is rethrown once the losers ended") {
    sink_guard sink;
    io_context io;
    std::vector<std::string> log;
    bool slow_gone = false;
    auto failing = [&](std::stop_token st) -> task<int> {
        co_await ringverbs::sleep_for(io, 1ms, st);
        throw std::runtime_error("winner failed");
    };
    auto outer = [&]() -> task<void> {
        try {
            (void)co_await when_any(
                io, [&](std::stop_token st) { return sleeper(io, 5s, 1, st, log, slow_gone); },
                failing);
        } catch (const std::runtime_error& e) {
            log.push_back(e.what());
        }
        CHECK(slow_gone);
    };
    io.run(outer());
    CHECK(log == std::vector<std::string>{"canceled 1", "winner failed"});
    CHECK(diagnostics.empty());
}

TEST_CASE("tasks that finish synchronously tie, and the lowest index wins; every one ran") {
    io_context io;
    int started = 0;
    auto value = [&](int v) {
        return [&started, v](std::stop_token) -> task<int> {
            ++started;
            co_return v;
        };
    };
    auto r = io.run(when_any(io, value(7), value(8), value(9)));
    CHECK(r.index == 0);
    CHECK(std::get<0>(r.value) == 7);
    CHECK(started == 3);
}

TEST_CASE("a task that finishes synchronously beats one that waits, whatever their order") {
    io_context io;
    std::vector<std::string> log;
    bool gone = false;
    auto r = io.run(when_any(
        io, [&](std::stop_token st) { return sleeper(io, 5s, 1, st, log, gone); },
        [](std::stop_token) -> task<int> { co_return 2; }));
    CHECK(r.index == 1);
    CHECK(std::get<1>(r.value) == 2);
    CHECK(gone);
    CHECK(log == std::vector<std::string>{"canceled 1"});
}

TEST_CASE("tasks resumed in the same loop turn tie: the lowest index wins, not the first resumed") {
    // Three polls on one pipe complete with one write, in one batch of completions, in an
    // order the kernel chooses.
    io_context io;
    int fds[2];
    REQUIRE(::pipe(fds) == 0);
    std::vector<int> resumed;
    auto reader = [&](int i) {
        return [&, i](std::stop_token st) -> task<int> {
            co_await ringverbs::poll(io, fds[0], POLLIN, st);
            resumed.push_back(i);
            co_return i;
        };
    };
    auto writer = [&]() -> task<void> {
        co_await ringverbs::sleep_for(io, 5ms);
        char c = 'x';
        REQUIRE(::write(fds[1], &c, 1) == 1);
    };
    auto [r, nothing] =
        io.run(ringverbs::when_all(when_any(io, reader(0), reader(1), reader(2)), writer()));
    (void)nothing;
    CHECK(r.index == 0);
    CHECK(std::get<0>(r.value) == 0);
    CHECK(resumed.size() == 3); // all three finished before the decision
    MESSAGE("resumed in the order " << resumed[0] << resumed[1] << resumed[2]);
    ::close(fds[0]);
    ::close(fds[1]);
}

TEST_CASE("void tasks: the index says which one won") {
    io_context io;
    auto wait = [&](std::chrono::milliseconds d) {
        return [&io, d](std::stop_token st) -> task<void> {
            co_await ringverbs::sleep_for(io, d, st);
        };
    };
    auto r = io.run(when_any(io, wait(5s), wait(1ms), wait(5s)));
    static_assert(std::is_same_v<decltype(r.value),
                                 std::variant<std::monostate, std::monostate, std::monostate>>);
    CHECK(r.index == 1);
    CHECK(r.value.index() == 1);

    std::size_t i = io.run(when_any(io, 4, [&](std::size_t k, std::stop_token st) -> task<void> {
        co_await ringverbs::sleep_for(io, k == 2 ? 1ms : 5s, st);
    }));
    CHECK(i == 2);
}

TEST_CASE("n tasks of one type: task i from factory(i, token), the winner's index and value") {
    io_context io;
    int ended = 0;
    auto r = io.run(when_any(io, 5, [&](std::size_t i, std::stop_token st) -> task<std::string> {
        struct counter {
            int& n;
            ~counter() { ++n; }
        } c{ended};
        co_await ringverbs::sleep_for(io, i == 3 ? 2ms : 5s, st);
        co_return "task " + std::to_string(i);
    }));
    static_assert(std::is_same_v<decltype(r), ringverbs::when_any_winner<std::string>>);
    CHECK(r.index == 3);
    CHECK(r.value == "task 3");
    CHECK(ended == 5);
    CHECK_THROWS_AS(
        io.run(when_any(io, 0, [](std::size_t, std::stop_token) -> task<int> { co_return 0; })),
        std::invalid_argument);
}

TEST_CASE("when_any nested in when_all") {
    io_context io;
    std::vector<std::string> log;
    bool a_gone = false, b_gone = false;
    auto race = when_any(
        io, [&](std::stop_token st) { return sleeper(io, 5s, 1, st, log, a_gone); },
        [&](std::stop_token st) { return sleeper(io, 3ms, 2, st, log, b_gone); });
    auto other = [&]() -> task<int> {
        co_await ringverbs::sleep_for(io, 20ms);
        co_return 42;
    };
    auto [r, v] = io.run(ringverbs::when_all(std::move(race), other()));
    CHECK(r.index == 1);
    CHECK(std::get<1>(r.value) == 2);
    CHECK(v == 42);
    CHECK(a_gone);
    CHECK(b_gone);
    CHECK(log == std::vector<std::string>{"finished 2", "canceled 1"});
}

TEST_CASE("nothing is left on the io_context after when_any: run() returns") {
    io_context io;
    bool done = false;
    std::vector<std::string> log;
    bool a_gone = false, b_gone = false;
    io.spawn([&]() -> task<void> {
        auto r = co_await when_any(
            io, [&](std::stop_token st) { return sleeper(io, 5s, 1, st, log, a_gone); },
            [&](std::stop_token st) { return sleeper(io, 2ms, 2, st, log, b_gone); });
        done = r.index == 1;
    }());
    io.run(); // returns only when no operation, waiter or coroutine is left
    CHECK(done);
    CHECK(io.operations_in_flight() == 0);
    CHECK(io.waiters() == 0);
}

TEST_CASE("a loser that fails with something other than a cancellation: one diagnostic line") {
    sink_guard sink;
    io_context io;
    auto stubborn = [&](std::stop_token st) -> task<int> {
        try {
            co_await ringverbs::sleep_for(io, 5s, st);
        } catch (const std::system_error&) {
        }
        throw std::runtime_error("cleanup failed");
    };
    auto quick = [&](std::stop_token st) -> task<int> {
        co_await ringverbs::sleep_for(io, 1ms, st);
        co_return 5;
    };
    auto r = io.run(when_any(io, quick, stubborn));
    CHECK(r.index == 0);
    CHECK(std::get<0>(r.value) == 5);
    REQUIRE(diagnostics.size() == 1);
    CHECK(diagnostics[0] == "when_any: task 1 failed after task 0 won: cleanup failed");
}

TEST_CASE("a loser that ignores its token is still awaited, and its value dropped") {
    io_context io;
    bool ignored_gone = false;
    std::vector<std::string> log;
    auto outer = [&]() -> task<void> {
        auto r = co_await when_any(
            io, [&](std::stop_token) { return sleeper(io, 30ms, 1, {}, log, ignored_gone); },
            [](std::stop_token) -> task<int> { co_return 2; });
        log.push_back("returned");
        CHECK(r.index == 1);
        CHECK(ignored_gone);
    };
    io.run(outer());
    CHECK(log == std::vector<std::string>{"finished 1", "returned"});
}

TEST_CASE("the awaiting coroutine's stop_token stops every task; the cancellation is rethrown") {
    io_context io;
    std::stop_source outer_stop;
    std::vector<std::string> log;
    bool a_gone = false, b_gone = false;
    auto stopper = [&]() -> task<void> {
        co_await ringverbs::sleep_for(io, 5ms);
        outer_stop.request_stop();
    };
    auto race = when_any(
        io, outer_stop.get_token(),
        [&](std::stop_token st) { return sleeper(io, 5s, 1, st, log, a_gone); },
        [&](std::stop_token st) { return sleeper(io, 5s, 2, st, log, b_gone); });
    try {
        (void)io.run(ringverbs::when_all(std::move(race), stopper()));
        FAIL("when_any did not throw");
    } catch (const std::system_error& e) {
        CHECK(is_cancellation(e));
    }
    CHECK(a_gone);
    CHECK(b_gone);
    CHECK(log.size() == 2);

    // Already stopped before it starts: each task's first wait ends at once.
    int started = 0;
    auto stopped = [&](std::size_t, std::stop_token st) -> task<void> {
        ++started;
        co_await ringverbs::sleep_for(io, 5s, st);
    };
    CHECK_THROWS_AS(io.run(when_any(io, outer_stop.get_token(), 3, stopped)), std::system_error);
    CHECK(started == 3);
}

TEST_CASE("a lambda coroutine factory's captures live as long as its task") {
    io_context io;
    std::string text = "a capture long enough to be on the heap, not in the string itself";
    auto r = io.run(when_any(io, [&io, text](std::stop_token st) -> task<std::string> {
        co_await ringverbs::sleep_for(io, 1ms, st);
        co_return text; // read after a suspension: the lambda is when_any's, still alive
    }));
    CHECK(std::get<0>(r.value) == text);
}

TEST_CASE("when_any allocates at most one thing more than when_all: the stop source's state") {
    io_context io;
    auto value = [](int v) -> task<int> { co_return v; };
    auto count_all = [&] {
        std::size_t before = allocations;
        (void)io.run(ringverbs::when_all(value(1), value(2)));
        return allocations - before;
    };
    auto count_any = [&] {
        std::size_t before = allocations;
        (void)io.run(when_any(
            io, [&](std::stop_token) { return value(1); },
            [&](std::stop_token) { return value(2); }));
        return allocations - before;
    };
    for (int warm = 0; warm < 3; ++warm) { // the context's ready queues grow once
        (void)count_all();
        (void)count_any();
    }
    std::size_t all = count_all(), any = count_any();
    MESSAGE("when_all: " << all << " allocations, when_any: " << any);
    CHECK(any <= all + 1);
}
