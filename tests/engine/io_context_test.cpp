#include "fd.hpp"
#include "uring_faults.hpp"

#include <ringverbs/engine/detail/stop_gate.hpp>
#include <ringverbs/engine/detail/uring_hooks.hpp>
#include <ringverbs/engine/diagnostics.hpp>
#include <ringverbs/engine/file_io.hpp>
#include <ringverbs/engine/io_context.hpp>
#include <ringverbs/engine/poll.hpp>
#include <ringverbs/engine/timer.hpp>

#include <doctest/doctest.h>

#include <atomic>
#include <barrier>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <stop_token>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

using namespace std::chrono_literals;
using ringverbs::io_context;
using ringverbs::task;

// The public surface: schedule() returns a named awaitable that only the context builds; while
// it waits it is a node of the context's cross-thread queue, so it stays in place.
static_assert(std::is_same_v<decltype(std::declval<io_context&>().schedule()),
                             io_context::schedule_awaitable>);
static_assert(!std::is_constructible_v<io_context::schedule_awaitable, io_context*>);
static_assert(!std::is_move_constructible_v<io_context::schedule_awaitable>);

TEST_CASE("io_context reports what the kernel granted") {
    io_context ctx;
    // On Linux >= 6.1 the preferred flags are granted; older kernels fall back.
    MESSAGE("setup flags: " << ctx.setup_flags());
    CHECK((ctx.setup_flags() & IORING_SETUP_CQSIZE) != 0);
    io_context plain(ringverbs::io_context_options{.single_issuer = false});
    CHECK((plain.setup_flags() & IORING_SETUP_SINGLE_ISSUER) == 0);
}

TEST_CASE("run() returns when there is no work left") {
    io_context ctx;
    ctx.run(); // nothing at all
    int done = 0;
    auto work = [&]() -> task<void> {
        co_await ringverbs::sleep_for(ctx, 1ms);
        ++done;
    };
    ctx.spawn(work());
    ctx.spawn(work());
    ctx.run();
    CHECK(done == 2);
}

TEST_CASE("spawn runs detached work and an escaping exception is rethrown from run()") {
    io_context ctx;
    bool after = false;
    auto bad = [&]() -> task<void> {
        co_await ringverbs::sleep_for(ctx, 1ms);
        throw std::runtime_error("spawned failure");
    };
    auto good = [&]() -> task<void> {
        co_await ringverbs::sleep_for(ctx, 5ms);
        after = true;
    };
    ctx.spawn(bad());
    ctx.spawn(good());
    CHECK_THROWS_WITH_AS(ctx.run(), "spawned failure", std::runtime_error);
    ctx.run(); // the rest of the work goes on
    CHECK(after);
}

TEST_CASE("a custom exception handler receives exceptions of spawned tasks") {
    io_context ctx;
    int seen = 0;
    ctx.set_exception_handler([&](std::exception_ptr e) {
        CHECK_THROWS_AS(std::rethrow_exception(e), std::logic_error);
        ++seen;
    });
    auto bad = []() -> task<void> {
        throw std::logic_error("x");
        co_return;
    };
    ctx.spawn(bad());
    ctx.spawn(bad());
    ctx.run();
    CHECK(seen == 2);
}

TEST_CASE("post() runs a function on the context's thread, from another thread") {
    io_context ctx;
    std::atomic<int> ran{0};
    std::thread::id loop_thread;
    io_context::work_guard guard(ctx);
    std::thread producer([&] {
        for (int i = 0; i < 1000; ++i)
            ctx.post([&] {
                loop_thread = std::this_thread::get_id();
                ran.fetch_add(1);
            });
        ctx.post([&] { guard.reset(); });
    });
    ctx.run();
    producer.join();
    CHECK(ran.load() == 1000);
    CHECK(loop_thread == std::this_thread::get_id());
}

TEST_CASE("co_await schedule() moves a coroutine onto the context's thread") {
    io_context a;
    io_context* b = nullptr;
    std::optional<io_context::work_guard> guard;
    std::thread::id b_thread;
    std::thread::id resumed_on;
    std::barrier ready(2);
    std::thread t([&] {
        io_context own; // built, run and destroyed on its own thread
        guard.emplace(own);
        b = &own;
        b_thread = std::this_thread::get_id();
        ready.arrive_and_wait();
        own.run();
    });
    ready.arrive_and_wait();
    int hops = 0;
    auto hop = [&]() -> task<void> {
        for (int i = 0; i < 100; ++i) {
            co_await b->schedule();
            if (std::this_thread::get_id() == b_thread) ++hops;
            resumed_on = std::this_thread::get_id();
            co_await a.schedule(); // back home
        }
        b->post([&] { guard.reset(); });
    };
    a.run(hop());
    t.join();
    CHECK(hops == 100);
    CHECK(resumed_on == b_thread);
    CHECK(resumed_on != std::this_thread::get_id());
}

TEST_CASE("co_await yield() lets the coroutines ready before it run first, then continues") {
    io_context io;
    std::string order;
    auto spinner = [&](char name, int turns) -> task<void> {
        for (int i = 0; i < turns; ++i) {
            order += name;
            co_await io.yield();
        }
    };
    io.spawn(spinner('a', 3));
    io.spawn(spinner('b', 2));
    io.run();
    // Each yield puts its coroutine behind the other one: they take turns, none runs twice
    // in a row while the other is ready.
    CHECK(order == "ababa");
    CHECK(io.waiters() == 0);
}

TEST_CASE("a coroutine spinning on yield() ends with operation_canceled when its io_context "
          "is destroyed, instead of keeping the destructor turning") {
    int spins = 0;
    std::string what;
    {
        io_context io;
        auto spinner = [&]() -> task<void> {
            try {
                while (spins < 1000) { // bounded: without the fix the destructor spun for ever
                    ++spins;
                    co_await io.yield();
                }
            } catch (const std::system_error& e) {
                what = e.what();
                CHECK(e.code() == std::errc::operation_canceled);
            }
        };
        io.spawn(spinner());
        for (int i = 0; i < 5; ++i)
            io.run_once(false);
        CHECK(spins == 5);
    }                  // ~io_context: returns (it used to resume the spinner for ever)
    CHECK(spins == 5); // resumed once more by the destructor: its pending yield threw
    CHECK(what.find("io_context::yield") != std::string::npos);
}

TEST_CASE("stop() from another thread ends run()") {
    io_context ctx;
    io_context::work_guard guard(ctx);
    std::thread t([&] {
        std::this_thread::sleep_for(20ms);
        ctx.stop();
    });
    ctx.run();
    t.join();
    CHECK(ctx.stopped());
    ctx.restart();
    CHECK_FALSE(ctx.stopped());
}

TEST_CASE("destroying an io_context cancels and reaps operations in flight") {
    test::pipe_pair p;
    std::vector<std::byte> buffer(64, std::byte{0x5a});
    std::error_code seen;
    bool resumed = false;
    {
        io_context ctx;
        auto reader = [&]() -> task<void> {
            try {
                co_await ringverbs::read(ctx, p.rd.get(), buffer);
            } catch (const std::system_error& e) {
                seen = e.code();
            }
            resumed = true;
        };
        ctx.spawn(reader());
        ctx.run_once(false); // starts the read
        REQUIRE(ctx.operations_in_flight() == 1);
    }
    CHECK(resumed);
    CHECK(seen == std::errc::operation_canceled);
    // The kernel is done with the buffer: data written now is not read into it.
    char c = 'x';
    REQUIRE(::write(p.wr.get(), &c, 1) == 1);
    CHECK(buffer[0] == std::byte{0x5a});
}

TEST_CASE("destroying an io_context destroys spawned tasks that can never resume") {
    static int destroyed = 0;
    struct sentinel {
        ~sentinel() { ++destroyed; }
    };
    {
        io_context ctx;
        auto stuck = []() -> task<void> {
            sentinel s;
            struct forever {
                bool await_ready() { return false; }
                void await_suspend(std::coroutine_handle<>) {}
                void await_resume() {}
            };
            co_await forever{};
        };
        ctx.spawn(stuck());
        ctx.run();
        CHECK(destroyed == 0);
    }
    CHECK(destroyed == 1);
}

TEST_CASE("a loop that never sleeps still collects CQEs the kernel kept in its overflow list") {
    // Both setups a kernel may grant: DEFER_TASKRUN, and COOP_TASKRUN (single_issuer = false),
    // where completions need the loop to enter the kernel.
    for (bool single_issuer : {true, false}) {
        CAPTURE(single_issuer);
        // A completion ring of 8 for 64 timers that expire together: most of their CQEs go
        // to the kernel's overflow list.
        io_context io(ringverbs::io_context_options{
            .sq_entries = 4, .cq_entries = 8, .single_issuer = single_issuer});
        constexpr int timers = 64;
        int fired = 0;
        auto sleeper = [&]() -> task<void> {
            co_await sleep_for(io, 20ms);
            ++fired;
        };
        for (int i = 0; i < timers; ++i)
            io.spawn(sleeper());
        // Ready again every turn: the loop never takes a blocking wait, so only an explicit
        // look at the overflow list (and at task work) collects the timers.
        long turns = 0;
        auto spinner = [&]() -> task<void> {
            while (fired < timers && turns < 3'000'000) {
                ++turns;
                co_await io.schedule();
            }
        };
        io.run(spinner());
        CHECK(fired == timers);
        MESSAGE("setup flags " << io.setup_flags() << ": " << turns << " turns");
    }
}

TEST_CASE(
    "the cross-thread wakeup is re-armed on a later turn when the CQE loop gets no SQE for it") {
    io_context io;
    io.run_once(false); // the ring is enabled, the wakeup read armed
    // A request whose CQE, reaped just before the wakeup's, leaves the submission ring full
    // and makes submitting fail: the wakeup's re-arm then finds no SQE inside the CQE loop.
    struct filler : ringverbs::detail::operation {
        io_context* ctx = nullptr;
    } op;
    op.ctx = &io;
    op.on_cqe = [](ringverbs::detail::operation* self, int, unsigned) noexcept {
        io_uring* ring = ringverbs::detail::loop(*static_cast<filler*>(self)->ctx).native_ring();
        while (io_uring_sq_space_left(ring) > 0) {
            io_uring_sqe* s = io_uring_get_sqe(ring);
            io_uring_prep_nop(s);
            io_uring_sqe_set_data64(s, 0);
        }
        ringverbs::detail::io_uring_hooks().submit = [](io_uring*) noexcept { return -EBUSY; };
    };
    const auto real_submit = ringverbs::detail::io_uring_hooks().submit;
    io_uring_sqe* sqe = ringverbs::detail::loop(io).get_sqe();
    io_uring_prep_nop(sqe);
    io_uring_sqe_set_data(sqe, static_cast<ringverbs::detail::operation*>(&op));
    std::atomic<int> posted{0};
    std::thread([&] { io.post([&] { ++posted; }); }).join(); // completes the wakeup read
    io.run_once(false); // reaps the NOP's CQE, then the wakeup's: no terminate
    ringverbs::detail::io_uring_hooks().submit = real_submit;
    CHECK(posted.load() == 1);
    // A loop that blocks is still woken by the next cross-thread post.
    std::atomic<bool> finished{false};
    std::thread guard([&] {
        for (int i = 0; i < 600 && !finished.load(); ++i)
            std::this_thread::sleep_for(50ms);
        if (!finished.load()) {
            std::fprintf(stderr, "the wakeup was not re-armed: run_once(true) never returned\n");
            std::abort();
        }
    });
    std::thread later([&] {
        std::this_thread::sleep_for(50ms);
        io.post([&] { ++posted; });
    });
    while (posted.load() < 2)
        io.run_once(true);
    finished = true;
    later.join();
    guard.join();
    CHECK(posted.load() == 2);
}

TEST_CASE("~io_context when the cancel of what is in flight gets no SQE: a diagnostics line, "
          "no terminate") {
    static std::vector<std::string> lines;
    lines.clear();
    const ringverbs::diagnostics_sink before = ringverbs::set_diagnostics_sink(
        [](std::string_view line) noexcept { lines.emplace_back(line); });
    const auto real_submit = ringverbs::detail::io_uring_hooks().submit;
    {
        io_context io;
        io.run_once(false); // the ring is enabled, the wakeup read in flight
        io_uring* ring = ringverbs::detail::loop(io).native_ring();
        while (io_uring_sq_space_left(ring) > 0) {
            io_uring_sqe* s = io_uring_get_sqe(ring);
            io_uring_prep_nop(s);
            io_uring_sqe_set_data64(s, 0);
        }
        // Not a shortage that passes: every submission fails.
        ringverbs::detail::io_uring_hooks().submit = [](io_uring*) noexcept { return -EIO; };
    } // before: get_sqe() threw out of the destructor (std::terminate)
    ringverbs::detail::io_uring_hooks().submit = real_submit;
    ringverbs::set_diagnostics_sink(before);
    bool said = false;
    for (const std::string& line : lines) {
        MESSAGE(line);
        said = said || line.find("~io_context: the cancel of what is in flight could not be "
                                 "queued") != std::string::npos;
    }
    CHECK(said);
}

// get_sqe() is called from inside awaiters, pollers and CQE handlers, with their objects on
// the stack. When the submission ring is full and submitting is refused (EBUSY: the
// completion ring has no room), it must make room without running any CQE's handler there: a
// handler may end the life of what the caller is in the middle of (a qp's flush timer
// releasing the cq a poller is draining), or run a second time. The CQEs it takes out of the
// ring are handled on the loop's next reap, once each, in their order.
TEST_CASE("get_sqe() under a refused submission sets CQEs aside; their handlers run on the next "
          "reap, once each, in order") {
    io_context io;
    io.run_once(false); // the ring is enabled, the wakeup read armed
    bool inside_get_sqe = false;
    int handled_inside = 0;
    std::vector<int> order;
    struct recorder : ringverbs::detail::operation {
        std::vector<int>* order = nullptr;
        const bool* inside = nullptr;
        int* during = nullptr;
        int id = 0;
    };
    recorder ops[3];
    io_uring* ring = ringverbs::detail::loop(io).native_ring();
    for (int i = 0; i < 3; ++i) {
        ops[i].order = &order;
        ops[i].inside = &inside_get_sqe;
        ops[i].during = &handled_inside;
        ops[i].id = i;
        ops[i].on_cqe = [](ringverbs::detail::operation* self, int, unsigned) noexcept {
            auto* r = static_cast<recorder*>(self);
            r->order->push_back(r->id);
            if (*r->inside) ++*r->during;
        };
        io_uring_sqe* sqe = ringverbs::detail::loop(io).get_sqe();
        io_uring_prep_nop(sqe);
        io_uring_sqe_set_data(sqe, static_cast<ringverbs::detail::operation*>(&ops[i]));
    }
    REQUIRE(io_uring_submit(ring) == 3); // a NOP completes at once: 3 CQEs wait in the ring
    REQUIRE(io_uring_cq_ready(ring) >= 3);
    while (io_uring_sq_space_left(ring) > 0) { // a full submission ring
        io_uring_sqe* s = io_uring_get_sqe(ring);
        io_uring_prep_nop(s);
        io_uring_sqe_set_data64(s, ringverbs::detail::ignored_user_data);
    }
    static int refusals = 0;
    refusals = 1;
    static decltype(ringverbs::detail::io_uring_hooks().submit) real = nullptr;
    struct restore_submit {
        decltype(real) saved = ringverbs::detail::io_uring_hooks().submit;
        ~restore_submit() { ringverbs::detail::io_uring_hooks().submit = saved; }
    } restore;
    real = restore.saved;
    ringverbs::detail::io_uring_hooks().submit = [](io_uring* r) noexcept {
        return refusals-- > 0 ? -EBUSY : real(r);
    };
    inside_get_sqe = true;
    io_uring_sqe* sqe = ringverbs::detail::loop(io).get_sqe();
    inside_get_sqe = false;
    io_uring_prep_nop(sqe);
    io_uring_sqe_set_data64(sqe, ringverbs::detail::ignored_user_data);
    CHECK(handled_inside == 0);
    CHECK(order.empty());
    // Nothing else will complete: the fillers' CQEs (nobody's) are consumed here, the wakeup
    // read waits. A loop that blocked now would wait for ever with three CQEs in hand: a
    // guard thread posts after 5 s to unblock it, and says so.
    io_uring_sqe* last = io_uring_get_sqe(ring);
    io_uring_prep_nop(last);
    io_uring_sqe_set_data64(last, ringverbs::detail::ignored_user_data);
    REQUIRE(io_uring_submit(ring) >= 1);
    io_uring_cq_advance(ring, io_uring_cq_ready(ring));
    std::atomic<bool> returned{false}, guard_posted{false};
    std::thread guard([&] {
        for (int i = 0; i < 100 && !returned.load(); ++i)
            std::this_thread::sleep_for(50ms);
        if (!returned.load()) {
            guard_posted = true;
            io.post([] {});
        }
    });
    io.run_once(true);
    returned = true;
    guard.join();
    CHECK_FALSE(guard_posted.load());
    CHECK(order == std::vector<int>{0, 1, 2});
    io.run_once(false);
    CHECK(order.size() == 3);
}

TEST_CASE("a handler whose get_sqe() sets the ring's other CQEs aside: they run in the same "
          "reap, after it, once each, in order") {
    io_context io;
    io.run_once(false); // the ring is enabled, the wakeup read armed
    struct recorder : ringverbs::detail::operation {
        io_context* io = nullptr;
        std::vector<int>* order = nullptr;
        bool* inside = nullptr;
        int* during = nullptr;
        int id = 0;
    };
    std::vector<int> order;
    bool inside_first = false;
    int handled_inside = 0;
    recorder ops[3];
    io_uring* ring = ringverbs::detail::loop(io).native_ring();
    for (int i = 0; i < 3; ++i) {
        ops[i].io = &io;
        ops[i].order = &order;
        ops[i].inside = &inside_first;
        ops[i].during = &handled_inside;
        ops[i].id = i;
        ops[i].on_cqe = [](ringverbs::detail::operation* self, int, unsigned) noexcept {
            auto* r = static_cast<recorder*>(self);
            if (*r->inside) ++*r->during;
            r->order->push_back(r->id);
            if (r->id != 0) return;
            // The first handler needs an SQE from a full ring whose submission is refused
            // once: get_sqe() sets the ring's CQEs aside (the other two) and tries again.
            test::fill_sq(*r->io, 0);
            const test::refuse_submits refuse(1);
            *r->inside = true;
            io_uring_sqe* sqe = ringverbs::detail::loop(*r->io).get_sqe();
            *r->inside = false;
            io_uring_prep_nop(sqe);
            io_uring_sqe_set_data64(sqe, ringverbs::detail::ignored_user_data);
        };
        io_uring_sqe* sqe = ringverbs::detail::loop(io).get_sqe();
        io_uring_prep_nop(sqe);
        io_uring_sqe_set_data(sqe, static_cast<ringverbs::detail::operation*>(&ops[i]));
    }
    REQUIRE(io_uring_submit(ring) == 3); // a NOP completes at once: 3 CQEs wait in the ring
    REQUIRE(io_uring_cq_ready(ring) == 3);
    // One turn: its reap runs the first handler, whose get_sqe() takes the other two CQEs out
    // of the ring; the same reap runs them after it (none inside get_sqe), in order.
    const std::uint64_t full_before = io.counters().sq_full;
    io.run_once(false);
    CHECK(io.counters().sq_full == full_before + 1); // the handler's get_sqe() found no room
    CHECK(handled_inside == 0);
    CHECK(order == std::vector<int>{0, 1, 2});
    io.run_once(false);
    CHECK(order.size() == 3);
}

TEST_CASE("a handler whose get_sqe() empties the ring of ignored CQEs only: the pass stops at the "
          "empty ring (review of the common reap pass)") {
    io_context io;
    io.run_once(false); // the ring is enabled, the wakeup read armed
    struct recorder : ringverbs::detail::operation {
        io_context* io = nullptr;
        int calls = 0;
    };
    static __kernel_timespec later{60, 0}; // fillers that do not complete within the pass
                                           // (~io_context cancels them)
    recorder first;
    first.io = &io;
    first.on_cqe = [](ringverbs::detail::operation* self, int, unsigned) noexcept {
        auto* r = static_cast<recorder*>(self);
        ++r->calls;
        io_uring* q = ringverbs::detail::loop(*r->io).native_ring();
        while (io_uring_sq_space_left(q) > 0) { // not fill_sq: NOPs would complete at once
            io_uring_sqe* s = io_uring_get_sqe(q);
            io_uring_prep_timeout(s, &later, 0, 0);
            io_uring_sqe_set_data64(s, ringverbs::detail::ignored_user_data);
        }
        // Refused once: get_sqe() takes the ring's CQEs out (the ignored one behind this
        // handler is dropped, nothing is set aside) and submits again.
        const test::refuse_submits refuse(1);
        io_uring_sqe* sqe = ringverbs::detail::loop(*r->io).get_sqe();
        io_uring_prep_timeout(sqe, &later, 0, 0);
        io_uring_sqe_set_data64(sqe, ringverbs::detail::ignored_user_data);
    };
    io_uring* ring = ringverbs::detail::loop(io).native_ring();
    io_uring_sqe* sqe = ringverbs::detail::loop(io).get_sqe();
    io_uring_prep_nop(sqe);
    io_uring_sqe_set_data(sqe, static_cast<ringverbs::detail::operation*>(&first));
    sqe = ringverbs::detail::loop(io).get_sqe();
    io_uring_prep_nop(sqe); // an ignored CQE behind it, as a cancel's is
    io_uring_sqe_set_data64(sqe, ringverbs::detail::ignored_user_data);
    REQUIRE(io_uring_submit(ring) == 2);
    REQUIRE(io_uring_cq_ready(ring) == 2);
    io.run_once(false);
    CHECK(first.calls == 1);
    // The pass took no CQE from the empty ring: its head did not pass its tail.
    CHECK(*ring->cq.khead == io_uring_smp_load_acquire(ring->cq.ktail));
    CHECK(io_uring_cq_ready(ring) == 0);
    io.run_once(false);
    CHECK(first.calls == 1);
}

TEST_CASE("a held-back SQE slot is taken only when prepared: a submission that makes room for "
          "others never sends it stale") {
    io_context io;
    io.run_once(false); // the ring enabled
    struct counted : ringverbs::detail::operation {
        int cqes = 0;
    } held;
    held.on_cqe = [](ringverbs::detail::operation* self, int, unsigned) noexcept {
        ++static_cast<counted*>(self)->cqes;
    };
    // One free slot left, holding a NOP that names `stale` (a slot used before is not cleared).
    test::one_stale_sqe stale(io);
    auto l = ringverbs::detail::loop(io);
    l.reserve_sqe(); // the last slot, held back
    const auto full_before = io.counters().sq_full;
    io_uring_sqe* other = l.get_sqe(); // no room besides it: submits the fillers first
    CHECK(io.counters().sq_full == full_before + 1);
    io_uring_prep_nop(other);
    io_uring_sqe_set_data64(other, ringverbs::detail::ignored_user_data);
    io_uring_sqe* mine = l.take_reserved_sqe();
    REQUIRE(mine != nullptr);
    CHECK(mine != other);
    io_uring_prep_nop(mine);
    io_uring_sqe_set_data(mine, static_cast<ringverbs::detail::operation*>(&held));
    for (int i = 0; i < 100 && held.cqes == 0; ++i)
        io.run_once(false);
    CHECK(held.cqes == 1);
    CHECK(stale.submitted_stale == 0);
}

TEST_CASE("get_sqe hands out a reused slot that a prep helper leaves without the flags of the "
          "request that held it before (a timed request's IOSQE_IO_LINK)") {
    io_context io({.sq_entries = 4});
    test::pipe_pair p;
    std::byte b[8];
    REQUIRE(::write(p.wr.get(), "x", 1) == 1);
    // A timed read: its SQE is linked (IOSQE_IO_LINK) to the timeout's that follows it.
    io.run([&]() -> task<void> {
        co_await ringverbs::read(io, p.rd.get(), b, ringverbs::current_position,
                                 ringverbs::wait_options(5s));
    }());
    // Every slot of the 4-slot ring reused twice, by NOPs: prepared as a request would be,
    // each must carry no flag. (From liburing 2.6 the prep helpers leave flags, ioprio,
    // rw_flags... to io_uring_get_sqe, which get_sqe's fast path then has to do itself.)
    for (int round = 0; round < 2; ++round) {
        for (int i = 0; i < 4; ++i) {
            io_uring_sqe* sqe = ringverbs::detail::loop(io).get_sqe();
            io_uring_prep_nop(sqe);
            io_uring_sqe_set_data64(sqe, ringverbs::detail::ignored_user_data);
            CHECK(sqe->flags == 0);
            CHECK(sqe->rw_flags == 0);
        }
        io.run_once(false); // submits them: the kernel ends each at once
    }
}

// stop_gate (detail), under every wait with a stop_token: a gate armed again after a stop won
// its first wait starts clean. A stop request for the second wait reaches its owner, and the
// second wait is not taken as stopped before any request (before: state_ stayed stop_queued,
// so the second request's compare-exchange failed and was lost, and stop_won() said true).
TEST_CASE("stop_gate: armed again after a stop won, the new wait's stop request reaches its "
          "owner and nothing of the first wait's outcome is left") {
    io_context io;
    struct owner {
        int stops = 0;
        int resumes = 0;
    } o;
    const auto on_stop = [](void* p) noexcept {
        ++static_cast<owner*>(p)->stops;
        return true; // finished by the stop (a waiter taken off its queue)
    };
    const auto on_resume = [](void* p) noexcept { ++static_cast<owner*>(p)->resumes; };
    ringverbs::detail::stop_gate gate;
    for (int round = 1; round <= 2; ++round) {
        CAPTURE(round);
        std::stop_source source;
        gate.arm(io, source.get_token(), &o, on_stop, on_resume);
        CHECK_FALSE(gate.stop_won());
        source.request_stop();
        CHECK(gate.stop_won());
        io.run_once(false); // the stop's node runs on the context's thread
        CHECK(o.stops == round);
        CHECK(o.resumes == round);
        gate.disarm();
    }
    // A wait without a stop_token after one a stop won: not taken as stopped.
    gate.arm(io, std::stop_token{}, &o, on_stop, on_resume);
    CHECK(gate.finish());
    CHECK_FALSE(gate.stop_won());
    gate.disarm();
    // A wait that finishes first: it may resume at once, and a late request does nothing.
    {
        std::stop_source source;
        gate.arm(io, source.get_token(), &o, on_stop, on_resume);
        CHECK(gate.finish());
        CHECK_FALSE(gate.stop_won());
        source.request_stop(); // too late: nothing runs
        io.run_once(false);
        CHECK(o.stops == 2);
        gate.disarm();
    }
    // Armed again while the last stop's node is still queued (a misuse): the node is not
    // queued twice (before: the loop's list would point at itself), and it runs once.
    std::stop_source first, second;
    gate.arm(io, first.get_token(), &o, on_stop, on_resume);
    first.request_stop();
    gate.arm(io, second.get_token(), &o, on_stop, on_resume);
    second.request_stop();
    io.run_once(false);
    CHECK(o.stops == 3);
    CHECK(o.resumes == 3);
    gate.disarm();
}
