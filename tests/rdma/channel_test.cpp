#include "fault_injection.hpp"
#include "rdma_fixture.hpp"

#include <ringverbs/engine/diagnostics.hpp>
#include <ringverbs/engine/timer.hpp>
#include <ringverbs/engine/when_all.hpp>
#include <ringverbs/rdma/recv_ring.hpp>
#include <ringverbs/rdma/srq.hpp>

#include <doctest/doctest.h>

#include <poll.h>

#include <array>
#include <barrier>
#include <chrono>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

using namespace rt;
using namespace std::chrono_literals;

namespace {

// Collects the diagnostics lines into `lines` while it lives; the sink before it is put back
// when it goes (also when a constructor or a REQUIRE throws).
class captured_diagnostics {
  public:
    explicit captured_diagnostics(std::vector<std::string>& lines) noexcept {
        into_ = &lines;
        before_ =
            set_diagnostics_sink([](std::string_view line) noexcept { into_->emplace_back(line); });
    }
    ~captured_diagnostics() { set_diagnostics_sink(before_); }
    captured_diagnostics(const captured_diagnostics&) = delete;
    captured_diagnostics& operator=(const captured_diagnostics&) = delete;

  private:
    static inline std::vector<std::string>* into_ = nullptr;
    diagnostics_sink before_ = nullptr;
};

// One send/recv exchange a -> b, both awaited; true when the payload arrived intact.
task<bool> exchange(qp& a, qp& b, region& out, region& in, std::size_t off, std::size_t size,
                    std::uint32_t seed) {
    fill(std::span(out.bytes).subspan(off, size), seed);
    auto r = [&]() -> task<ibv_wc> { co_return co_await b.recv(in.local(off, size)); };
    auto s = [&]() -> task<ibv_wc> { co_return co_await a.send(out.local(off, size)); };
    auto [rwc, swc] = co_await when_all(r(), s());
    co_return rwc.status == IBV_WC_SUCCESS&& swc.status == IBV_WC_SUCCESS&& rwc.byte_len ==
        size&& std::memcmp(in.bytes.data() + off, out.bytes.data() + off, size) == 0;
}

// `n` exchanges one after another from lp.a to lp.b (`size` bytes at the start of `out` and
// `in`, seeds from `seed` on): how many were verified.
task<int> in_turn(loopback& lp, region& out, region& in, int n, std::size_t size,
                  std::uint32_t seed = 0) {
    int ok = 0;
    for (int i = 0; i < n; ++i)
        ok += co_await exchange(lp.a, lp.b, out, in, 0, size, seed + static_cast<std::uint32_t>(i))
                  ? 1
                  : 0;
    co_return ok;
}

// `n` exchanges at once from lp.a to lp.b (48 bytes each, in slots of 64 of `out` and `in`):
// how many were verified.
task<int> burst(loopback& lp, region& out, region& in, int n, std::uint32_t seed) {
    std::vector<task<bool>> ex;
    for (int i = 0; i < n; ++i)
        ex.push_back(exchange(lp.a, lp.b, out, in, static_cast<std::size_t>(i) * 64, 48,
                              seed + static_cast<std::uint32_t>(i)));
    int ok = 0;
    for (bool done : co_await when_all(std::move(ex)))
        ok += done ? 1 : 0;
    co_return ok;
}

// After `quiet` with no traffic, 50 ms more: the channel did not poll once (it armed and sleeps).
// The spin ends on a turn that reads the clock (every 32nd empty one): a guest descheduled
// through `quiet` may not have had that turn yet, so 1 ms naps follow until one sees no poll;
// the spin must have ended within 3 s of the traffic (many times any window these cases set,
// and room for a slow guest's turns).
void check_stops_polling(io_context& io, loopback& lp, std::chrono::milliseconds quiet) {
    auto nap = [&](std::chrono::milliseconds d) -> task<void> { co_await sleep_for(io, d); };
    const auto t0 = std::chrono::steady_clock::now();
    io.run(nap(quiet));
    for (int i = 0; i < 5000; ++i) {
        const auto polls = lp.ch.counters().polls;
        io.run(nap(1ms));
        if (lp.ch.counters().polls == polls) break;
    }
    const auto spun = std::chrono::steady_clock::now() - t0;
    MESSAGE("polling stopped within "
            << std::chrono::duration_cast<std::chrono::microseconds>(spun).count() << " us");
    CHECK(spun < 3s);
    const auto polls_before = lp.ch.counters().polls;
    io.run(nap(50ms));
    CHECK(lp.ch.counters().polls == polls_before);
}

} // namespace

// polling_mode's names, one parser for every command line (checked when this file compiles).
static_assert(std::string_view(to_string(polling_mode::events)) == "events");
static_assert(std::string_view(to_string(polling_mode::busy)) == "busy");
static_assert(std::string_view(to_string(polling_mode::hybrid)) == "hybrid");
static_assert(parse_polling_mode("busy") == polling_mode::busy);
static_assert(parse_polling_mode("hybrid") == polling_mode::hybrid);
static_assert(parse_polling_mode("events") == polling_mode::events);
static_assert(!parse_polling_mode("Busy").has_value() && !parse_polling_mode("").has_value());
static_assert(std::string_view(to_string(event_read::ring)) == "ring");
static_assert(std::string_view(to_string(event_read::syscall)) == "syscall");
static_assert(parse_event_read("ring") == event_read::ring);
static_assert(parse_event_read("syscall") == event_read::syscall);
static_assert(!parse_event_read("Ring").has_value() && !parse_event_read("").has_value());

TEST_CASE("64 CQs on one channel with interleaved traffic: every completion accounted for") {
    for (event_read path : event_paths) {
        const std::string path_name = to_string(path);
        CAPTURE(path_name);
        device dev;
        io_context io;
        channel ch(io, dev.ctx, channel_options{.read = path});
        constexpr int pairs = 32; // 32 pairs of QPs, each QP with its own CQ: 64 CQs
        constexpr int rounds = 50;
        std::vector<std::unique_ptr<cq>> cqs;
        std::vector<std::unique_ptr<qp>> qps;
        // Each CQ holds what its QP's queues can flush at once (64 + 64 by default).
        for (int i = 0; i < 2 * pairs; ++i)
            cqs.push_back(std::make_unique<cq>(ch, cq_options{.entries = 128}));
        for (int i = 0; i < 2 * pairs; ++i)
            qps.push_back(std::make_unique<qp>(dev.pd, *cqs[static_cast<std::size_t>(i)],
                                               *cqs[static_cast<std::size_t>(i)]));
        std::vector<pair_link> links;
        for (int p = 0; p < pairs; ++p)
            links.push_back(connect_pair(qps[static_cast<std::size_t>(2 * p)]->native_qp(),
                                         qps[static_cast<std::size_t>(2 * p + 1)]->native_qp()));
        region out(dev.pd, pairs * 256), in(dev.pd, pairs * 256);
        int ok = 0;
        auto pair_traffic = [&](int p) -> task<void> {
            for (int r = 0; r < rounds; ++r) {
                bool good = co_await exchange(*qps[static_cast<std::size_t>(2 * p)],
                                              *qps[static_cast<std::size_t>(2 * p + 1)], out, in,
                                              static_cast<std::size_t>(p) * 256,
                                              static_cast<std::size_t>(1 + (p * 7 + r) % 256),
                                              static_cast<std::uint32_t>(p * 1000 + r));
                if (good) ++ok;
            }
        };
        std::vector<task<void>> all;
        for (int p = 0; p < pairs; ++p)
            all.push_back(pair_traffic(p));
        io.run(when_all(std::move(all)));
        CHECK(ok == pairs * rounds);
        std::uint64_t completions = 0;
        for (auto& c : cqs)
            completions += c->counters().completions;
        CHECK(completions == 2u * pairs * rounds); // one send + one recv per exchange, none lost
        CHECK(ch.counters().completions == completions);
        MESSAGE("64 CQs: " << ch.counters().wakeups << " wakeups, " << ch.counters().events
                           << " events");
    }
}

TEST_CASE("when two channels are ready in the same pass, the higher priority resumes first") {
    device dev;
    io_context io;
    channel low(io, dev.ctx, channel_options{.priority = 1});
    channel high(io, dev.ctx, channel_options{.priority = 9});
    cq cq_low(low), cq_high(high), cq_send(low);
    qp src_low(dev.pd, cq_send, cq_send), dst_low(dev.pd, cq_low, cq_low);
    qp src_high(dev.pd, cq_send, cq_send), dst_high(dev.pd, cq_high, cq_high);
    auto link_low = connect_pair(src_low.native_qp(), dst_low.native_qp());
    auto link_high = connect_pair(src_high.native_qp(), dst_high.native_qp());
    region buf(dev.pd, 4096);
    int both_in_one_pass = 0;
    for (int round = 0; round < 20; ++round) {
        std::vector<char> order;
        auto wait_low = [&]() -> task<void> {
            co_await dst_low.recv(buf.local(0, 64));
            order.push_back('L');
        };
        auto wait_high = [&]() -> task<void> {
            co_await dst_high.recv(buf.local(64, 64));
            order.push_back('H');
        };
        io.spawn(wait_low());
        io.spawn(wait_high());
        io.run_once(false); // both receives posted
        // Send to the low-priority one first, then let both land before the loop looks.
        auto s1 = [&]() -> task<void> { co_await src_low.send(buf.local(1024, 8)); };
        auto s2 = [&]() -> task<void> { co_await src_high.send(buf.local(1032, 8)); };
        io.spawn(s1());
        io.spawn(s2());
        io.run_once(false); // posts both sends
        // Until both receive completions landed and both channels fired: each fd readable
        // (the ring's reads take an event only when the loop enters the kernel: DEFER_TASKRUN).
        // Bounded: a slow device makes a round of two passes, which checks nothing.
        pollfd fds[2] = {{low.fd(), POLLIN, 0}, {high.fd(), POLLIN, 0}};
        for (int i = 0; i < 500 && !((fds[0].revents & POLLIN) && (fds[1].revents & POLLIN)); ++i) {
            std::this_thread::sleep_for(10ms);
            fds[0].revents = fds[1].revents = 0;
            (void)::poll(fds, 2, 0);
        }
        int passes = 0;
        while (order.size() < 2) {
            io.run_once(true);
            ++passes;
        }
        if (passes == 1) { // both were ready in the same pass: the case named
            ++both_in_one_pass;
            CHECK(order[0] == 'H');
        }
        io.run();
    }
    MESSAGE("rounds where both channels fired in one pass: " << both_in_one_pass);
    CHECK(both_in_one_pass > 0);
}

TEST_CASE("arm/poll race stress: bursts with random gaps, every request completes exactly once") {
    for (event_read path : event_paths) {
        const std::string path_name = to_string(path);
        CAPTURE(path_name);
        device dev;
        io_context io;
        loopback lp(dev, io, channel_options{.ack_batch = 3, .read = path});
        region out(dev.pd, 64 * 64), in(dev.pd, 64 * 64);
        std::mt19937 rng(12345);
        int completed = 0;
        int bursts = 0;
        int expected = 0;
        for (int b = 0; b < 300; ++b) {
            int n = 1 + static_cast<int>(rng() % 48);
            expected += n;
            completed += io.run(burst(lp, out, in, n, static_cast<std::uint32_t>(b) * 100));
            ++bursts;
            // A gap of 0 to 300 us: sometimes the next burst races the arm, sometimes not.
            std::this_thread::sleep_for(std::chrono::microseconds(rng() % 300));
        }
        CHECK(completed == expected);
        CHECK(lp.a.pending() == 0);
        CHECK(lp.b.pending() == 0);
        CHECK(lp.cq_a.counters().completions + lp.cq_b.counters().completions ==
              2u * static_cast<unsigned>(expected));
        MESSAGE(bursts << " bursts, " << expected << " exchanges, " << lp.ch.counters().events
                       << " events, " << lp.ch.counters().empty_polls << " empty polls");
    }
}

TEST_CASE("busy and hybrid channels deliver; idle events and hybrid channels stop polling") {
    for (auto [mode, path] : {std::pair{polling_mode::events, event_read::ring},
                              std::pair{polling_mode::events, event_read::syscall},
                              std::pair{polling_mode::busy, event_read::ring},
                              std::pair{polling_mode::hybrid, event_read::ring},
                              std::pair{polling_mode::hybrid, event_read::syscall}}) {
        const std::string mode_name = to_string(mode);
        CAPTURE(mode_name);
        const std::string path_name = to_string(path);
        CAPTURE(path_name);
        device dev;
        io_context io;
        loopback lp(dev, io, channel_options{.mode = mode, .hybrid_spin = 200us, .read = path});
        region out(dev.pd, 256), in(dev.pd, 256);
        CHECK(io.run(in_turn(lp, out, in, 200, 32)) == 200);
        if (mode == polling_mode::busy) {
            CHECK(lp.ch.counters().arms == 0);
            CHECK(lp.ch.counters().events == 0);
            continue;
        }
        // Idle: let a hybrid spin window pass, then check that nothing polls any more.
        check_stops_polling(io, lp, 5ms);
        if (mode == polling_mode::hybrid) CHECK(lp.ch.counters().empty_polls > 0);
    }
}

TEST_CASE("adaptive hybrid: bursts with random gaps all complete, the window stays in bounds, "
          "idle stops polling") {
    for (event_read path : event_paths) {
        const std::string path_name = to_string(path);
        CAPTURE(path_name);
        device dev;
        io_context io;
        loopback lp(dev, io,
                    channel_options{.mode = polling_mode::hybrid,
                                    .hybrid_spin = 10us,
                                    .hybrid_spin_max = 2ms,
                                    .read = path});
        region out(dev.pd, 16 * 64), in(dev.pd, 16 * 64);
        std::mt19937 rng(777);
        int completed = 0;
        int expected = 0;
        for (int b = 0; b < 200; ++b) {
            int n = 1 + static_cast<int>(rng() % 16);
            expected += n;
            completed += io.run(burst(lp, out, in, n, static_cast<std::uint32_t>(b) * 100));
            // Gaps below and above the window: it widens, and sleeps still find every completion.
            std::this_thread::sleep_for(std::chrono::microseconds(rng() % 400));
            CHECK(lp.ch.spin_window() >= 10us);
            CHECK(lp.ch.spin_window() <= 2ms);
        }
        CHECK(completed == expected);
        CHECK(lp.a.pending() == 0);
        CHECK(lp.b.pending() == 0);
        // Idle for longer than hybrid_spin_max: the channel arms and stops polling.
        check_stops_polling(io, lp, 10ms);
        MESSAGE("window after the bursts: " << lp.ch.spin_window().count() << " ns, "
                                            << lp.ch.counters().wakeups << " wakeups");
    }
}

TEST_CASE("two threads, each with its own io_context, channel and CQs" *
          doctest::test_suite(ringverbs::test::threads)) {
    device dev;
    constexpr int per_thread = 2000;
    int ok[2] = {0, 0};
    std::barrier start(2);
    auto worker = [&](int id) {
        io_context io;
        loopback lp(dev, io);
        region out(dev.pd, 1024), in(dev.pd, 1024);
        start.arrive_and_wait();
        ok[id] =
            io.run(in_turn(lp, out, in, per_thread, 100, static_cast<std::uint32_t>(id) * 100000));
    };
    std::thread t0(worker, 0), t1(worker, 1);
    t0.join();
    t1.join();
    CHECK(ok[0] == per_thread);
    CHECK(ok[1] == per_thread);
}

TEST_CASE("teardown in any order: no hang, pending awaiters resume with an error") {
    for (event_read path : event_paths) {
        const std::string path_name = to_string(path);
        CAPTURE(path_name);
        // Each order destroys channel (C), cq (Q) and qp (P) handles while a receive is pending
        // and an event is unacked; ibv_destroy_cq would hang on an unacked event.
        const char* orders[] = {"PQC", "PCQ", "QPC", "QCP", "CPQ", "CQP"};
        for (const char* order : orders) {
            CAPTURE(order);
            device dev;
            io_context io;
            auto ch = std::make_unique<channel>(io, dev.ctx,
                                                channel_options{.ack_batch = 1000, .read = path});
            auto c = std::make_unique<cq>(*ch);
            auto a = std::make_unique<qp>(dev.pd, *c, *c);
            auto b = std::make_unique<qp>(dev.pd, *c, *c);
            auto link = connect_pair(a->native_qp(), b->native_qp());
            region buf(dev.pd, 256);
            // One exchange so that the CQ has an unacked event (ack_batch is large).
            auto first = [&]() -> task<bool> {
                region& r = buf;
                co_return co_await exchange(*a, *b, r, r, 0, 16, 1);
            };
            CHECK(io.run(first()));
            CHECK(c->native() != nullptr);
            bool resumed = false;
            auto pending = [&]() -> task<void> {
                try {
                    co_await b->recv(buf.local(128, 64));
                } catch (const std::system_error&) {
                    resumed = true;
                }
            };
            io.spawn(pending());
            io.run_once(false);
            for (const char* o = order; *o; ++o) {
                if (*o == 'P') {
                    a.reset();
                    b.reset();
                } else if (*o == 'Q') {
                    c.reset();
                } else {
                    ch.reset();
                }
            }
            io.run();
            CHECK(resumed);
            CHECK(io.waiters() == 0);
        }
    }
}

TEST_CASE("interrupted event reads (ibv_get_cq_event, ring reads) and refused "
          "ibv_req_notify_cq: read and armed again on a later turn, nothing lost") {
    for (event_read path : event_paths) {
        const std::string path_name = to_string(path);
        CAPTURE(path_name);
        watchdog wd(60s, "interrupted events");
        device dev;
        io_context io;
        loopback lp(dev, io, channel_options{.read = path});
        region out(dev.pd, 64), in(dev.pd, 64);
        interrupt_events faults(6); // the first 6 reads interrupted, the first 6 arms refused
        int exchanged = 0;
        auto t = [&]() -> task<void> {
            for (int i = 0; i < 50; ++i) {
                auto r = [&]() -> task<ibv_wc> { co_return co_await lp.b.recv(in.all()); };
                auto s = [&]() -> task<ibv_wc> { co_return co_await lp.a.send(out.all()); };
                co_await when_all(r(), s());
                ++exchanged;
            }
        };
        io.run(t());
        CHECK(exchanged == 50);
        CHECK(interrupt_events::interrupted() == 6);
        CHECK(interrupt_events::refused() == 6);
        CHECK(lp.ch.counters().arm_retries >= 1);
    }
}

TEST_CASE("4096 CQs on one channel: a burst that completes on every one is delivered exactly "
          "once, many events per wakeup") {
    for (event_read path : event_paths) {
        const std::string path_name = to_string(path);
        CAPTURE(path_name);
        device dev;
        io_context io;
        channel ch(io, dev.ctx, channel_options{.read = path});
        constexpr int cq_count = 4096;
        constexpr int pairs = cq_count / 2; // a sends to b: a send completion and a receive, each
                                            // QP on its own CQ
        const verbs::qp_caps caps{.max_send_wr = 2,
                                  .max_recv_wr = 2,
                                  .max_send_sge = 1,
                                  .max_recv_sge = 1,
                                  .max_inline_data = 16};
        std::vector<std::unique_ptr<cq>> cqs;
        std::vector<std::unique_ptr<qp>> qps;
        cqs.reserve(cq_count);
        qps.reserve(cq_count);
        for (int i = 0; i < cq_count; ++i) {
            cqs.push_back(std::make_unique<cq>(ch, cq_options{.entries = 4}));
            qps.push_back(std::make_unique<qp>(dev.pd, *cqs.back(), *cqs.back(), caps));
        }
        std::vector<pair_link> links;
        for (int p = 0; p < pairs; ++p)
            links.push_back(connect_pair(qps[static_cast<std::size_t>(2 * p)]->native_qp(),
                                         qps[static_cast<std::size_t>(2 * p + 1)]->native_qp()));
        region in(dev.pd, pairs * 8);
        std::vector<std::uint64_t> out(pairs);
        int delivered = 0;
        // Every pair's receive is posted and its send awaited in the first turn, before the loop
        // looks at the channel: one burst over all 4096 CQs.
        auto pair_traffic = [&](int p) -> task<void> {
            const auto at = static_cast<std::size_t>(p) * 8;
            auto r = qps[static_cast<std::size_t>(2 * p + 1)]->recv(in.local(at, 8));
            r.post();
            out[static_cast<std::size_t>(p)] = 0x5eed'0000'0000ull + static_cast<std::uint64_t>(p);
            const auto bytes =
                std::as_bytes(std::span(out).subspan(static_cast<std::size_t>(p), 1));
            ibv_wc swc = co_await qps[static_cast<std::size_t>(2 * p)]->send(
                local_buffer::inline_data(bytes), send_options{.inline_data = true});
            ibv_wc rwc = co_await r;
            std::uint64_t got = 0;
            std::memcpy(&got, in.bytes.data() + at, 8);
            if (swc.status == IBV_WC_SUCCESS && rwc.status == IBV_WC_SUCCESS && rwc.byte_len == 8 &&
                got == out[static_cast<std::size_t>(p)])
                ++delivered;
        };
        std::vector<task<void>> all;
        for (int p = 0; p < pairs; ++p)
            all.push_back(pair_traffic(p));
        const auto before = ch.counters();
        const auto t0 = std::chrono::steady_clock::now();
        io.run(when_all(std::move(all)));
        const auto ms =
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0);
        CHECK(delivered == pairs); // each to its own awaiter, with its own payload
        int with_one = 0;
        for (auto& c : cqs)
            with_one += c->counters().completions == 1 ? 1 : 0;
        CHECK(with_one == cq_count); // every CQ had exactly its one completion
        const std::uint64_t completions = ch.counters().completions - before.completions;
        const std::uint64_t events = ch.counters().events - before.events;
        const std::uint64_t wakeups = ch.counters().wakeups - before.wakeups;
        CHECK(completions == cq_count);
        CHECK(events == cq_count); // one event per armed CQ, none lost, none twice
        CHECK(wakeups <= events);
        MESSAGE("4096 CQs, one burst: "
                << completions << " completions, " << events << " events in " << wakeups
                << " wakeups (" << static_cast<double>(wakeups) / static_cast<double>(completions)
                << " per completion), drained in " << ms.count() << " ms");
    }
}

TEST_CASE("a CQ destroyed while a ring read may hold its event: destroyed once the read is "
          "handled, the event acked, no hang") {
    watchdog wd(120s, "CQ destroyed after ring events");
    // single_issuer = false: no DEFER_TASKRUN, so the kernel runs the read as soon as the
    // thread returns from any system call (the QPs' destroy), before the loop sees its CQE.
    for (bool single_issuer : {true, false}) {
        CAPTURE(single_issuer);
        device dev;
        io_context io(io_context_options{.single_issuer = single_issuer});
        channel ch(io, dev.ctx, channel_options{.ack_batch = 1000});
        REQUIRE(ch.event_path() == event_read::ring);
        for (int round = 0; round < 30; ++round) {
            CAPTURE(round);
            auto c = std::make_unique<cq>(ch);
            auto a = std::make_unique<qp>(dev.pd, *c, *c);
            auto b = std::make_unique<qp>(dev.pd, *c, *c);
            auto link = std::make_unique<pair_link>(connect_pair(a->native_qp(), b->native_qp()));
            region buf(dev.pd, 256);
            auto first = [&]() -> task<bool> {
                region& r = buf;
                co_return co_await exchange(*a, *b, r, r, 0, 16, static_cast<std::uint32_t>(round));
            };
            CHECK(io.run(first())); // events read and handled, unacked (ack_batch)
            // The CQ is armed again: this completion raises an event that a read in flight
            // takes, while the loop does not run.
            raw_recv(*b, buf.local(128, 64), 7);
            raw_send(*a, buf.local(0, 16), 8);
            std::this_thread::sleep_for(std::chrono::microseconds(100 * (round % 10)));
            link.reset();
            a.reset();
            b.reset();
            c.reset(); // hangs in ibv_destroy_cq if an event read is not acked
            for (int i = 0; i < 100 && io.operations_in_flight() > 1; ++i)
                io.run_once(false);
        }
        // Reading goes on: a new CQ on the channel gets its events.
        cq c(ch);
        qp a(dev.pd, c, c), b(dev.pd, c, c);
        auto link = connect_pair(a.native_qp(), b.native_qp());
        region buf(dev.pd, 256);
        const auto events_before = ch.counters().events;
        auto again = [&]() -> task<bool> {
            region& r = buf;
            co_return co_await exchange(a, b, r, r, 0, 16, 99);
        };
        CHECK(io.run(again()));
        CHECK(ch.counters().events > events_before);
    }
}

TEST_CASE("a channel destroyed with ring reads in flight: the reads are cancelled and their "
          "state freed when their CQEs come") {
    device dev;
    io_context io;
    const std::size_t base = io.operations_in_flight();
    {
        channel ch(io, dev.ctx);
        CHECK(ch.event_path() == event_read::ring);
        CHECK(io.operations_in_flight() == base + 1); // its read
        loopback lp(dev, io); // a second channel, with traffic: reads come back and go out
        region out(dev.pd, 64), in(dev.pd, 64);
        CHECK(io.run(exchange(lp.a, lp.b, out, in, 0, 32, 5)));
    }
    for (int i = 0; i < 100 && io.operations_in_flight() > base; ++i)
        io.run_once(false);
    CHECK(io.operations_in_flight() == base);
    // And one destroyed together with its io_context, reads still in flight: ~io_context's
    // cancel-all ends them (ASan: nothing leaks).
    {
        io_context io2;
        auto ch = std::make_unique<channel>(io2, dev.ctx);
        ch.reset();
    }
}

TEST_CASE("event_read::syscall is kept when asked for, and a refused ring read falls back to it "
          "with a diagnostics line; both deliver") {
    device dev;
    io_context io;
    region out(dev.pd, 64), in(dev.pd, 64);
    {
        loopback lp(dev, io, channel_options{.read = event_read::syscall});
        CHECK(lp.ch.event_path() == event_read::syscall);
        CHECK(io.run(exchange(lp.a, lp.b, out, in, 0, 32, 1)));
        CHECK(lp.ch.counters().events > 0);
    }
    std::vector<std::string> lines;
    {
        const captured_diagnostics capture(lines);
        fail_ring_reads refused(EINVAL);
        loopback lp(dev, io);
        CHECK(lp.ch.event_path() == event_read::syscall);
        CHECK(lp.ch.error() == 0);
        for (int i = 0; i < 20; ++i)
            CHECK(io.run(exchange(lp.a, lp.b, out, in, 0, 32, static_cast<std::uint32_t>(i))));
        CHECK(lp.ch.counters().events > 0);
    }
    bool said = false;
    for (const std::string& line : lines) {
        MESSAGE(line);
        said =
            said || line.find("refused to read its events through io_uring") != std::string::npos;
    }
    CHECK(said);
}

TEST_CASE("ring reads short of memory for a while fall back to ibv_get_cq_event, with a "
          "diagnostics line, instead of failing the channel") {
    device dev;
    io_context io;
    region out(dev.pd, 64), in(dev.pd, 64);
    std::vector<std::string> lines;
    {
        const captured_diagnostics capture(lines);
        loopback lp(dev, io);
        CHECK(lp.ch.event_path() == event_read::ring);
        CHECK(io.run(exchange(lp.a, lp.b, out, in, 0, 32, 1))); // reads worked
        {
            fail_ring_reads starved(ENOMEM);
            for (int i = 0; i < 5; ++i)
                CHECK(io.run(exchange(lp.a, lp.b, out, in, 0, 32, static_cast<std::uint32_t>(i))));
            CHECK(fail_ring_reads::calls() ==
                  static_cast<int>(ringverbs::detail::fd_watch::max_retries));
        }
        CHECK(lp.ch.event_path() == event_read::syscall);
        CHECK(lp.ch.error() == 0);
        const std::uint64_t events = lp.ch.counters().events;
        for (int i = 0; i < 5; ++i)
            CHECK(io.run(exchange(lp.a, lp.b, out, in, 0, 32, static_cast<std::uint32_t>(i))));
        CHECK(lp.ch.counters().events > events);
    }
    bool said = false;
    for (const std::string& line : lines) {
        MESSAGE(line);
        said = said || line.find("failed 1000 times in a row (Cannot allocate memory)") !=
                           std::string::npos;
    }
    CHECK(said);
}

TEST_CASE("a failed channel ends what the QPs and the srq on its CQs owe with its errno, "
          "each once, and refuses their posts and new QPs") {
    device dev;
    io_context io;
    region out(dev.pd, 64), in(dev.pd, 256);
    std::vector<std::string> lines;
    const captured_diagnostics capture(lines);
    const watchdog guard(60s, "a failed channel's owed requests");
    loopback lp(dev, io);
    REQUIRE(lp.ch.event_path() == event_read::ring);
    // A receive ring on a; an srq with one (unconnected) qp receiving on cq_a and one on a CQ
    // of another channel, which the failure spares; a second srq whose qp only sends on the
    // failing channel (its receives complete elsewhere: not cut off).
    recv_ring ring(lp.a, dev.pd, 4, 64);
    channel elsewhere(io, dev.ctx);
    cq elsewhere_cq(elsewhere);
    srq shared(io, dev.pd);
    qp on_srq(dev.pd, lp.cq_a, lp.cq_a, {}, qp_options{.shared_receive_queue = &shared});
    qp on_srq_elsewhere(dev.pd, elsewhere_cq, elsewhere_cq, {},
                        qp_options{.shared_receive_queue = &shared});
    srq spared(io, dev.pd);
    qp sends_here(dev.pd, lp.cq_b, elsewhere_cq, {}, qp_options{.shared_receive_queue = &spared});
    // An RDMA WRITE completes on cq_a only: its event is read through the ring, so reads
    // worked and a failure from here on is fatal.
    CHECK(io.run([&]() -> task<bool> {
        const ibv_wc wc = co_await lp.a.write(out.local(0, 8), in.remote(0));
        co_return wc.status == IBV_WC_SUCCESS;
    }()));
    struct ended {
        int resumed = 0; // how many times the await came back (once)
        int error = 0;
        std::string what;
    };
    ended owed_recv, ring_next, srq_recv, low_water, trigger;
    const auto record = [](ended& e, const std::system_error& x) {
        e.error = x.code().value();
        e.what = x.what();
    };
    // Each suspended when the channel fails; none is ever sent to.
    auto on_b = [&]() -> task<void> {
        try {
            (void)co_await lp.b.recv(in.local(32, 32));
        } catch (const std::system_error& e) {
            record(owed_recv, e);
        }
        ++owed_recv.resumed;
    };
    auto on_ring = [&]() -> task<void> {
        try {
            (void)co_await ring.next();
        } catch (const std::system_error& e) {
            record(ring_next, e);
        }
        ++ring_next.resumed;
    };
    auto on_srq_recv = [&]() -> task<void> {
        try {
            (void)co_await shared.recv(in.local(64, 64));
        } catch (const std::system_error& e) {
            record(srq_recv, e);
        }
        ++srq_recv.resumed;
    };
    auto on_low_water = [&]() -> task<void> {
        try {
            co_await shared.low_water(1); // one receive posted (on_srq_recv's): waits
        } catch (const std::system_error& e) {
            record(low_water, e);
        }
        ++low_water.resumed;
    };
    // Once they wait: WRITEs (each completes on cq_a only), until the channel fails. Their
    // events are taken by the reads already in flight (one or more); the first read queued
    // after that is refused (EIO), which fails the channel.
    int delivered = 0;
    auto fail_it = [&]() -> task<void> {
        co_await io.schedule();
        try {
            for (int i = 0; i < 64 && lp.ch.error() == 0; ++i) {
                const ibv_wc wc = co_await lp.a.write(out.local(0, 8), in.remote(8));
                if (wc.status == IBV_WC_SUCCESS) ++delivered;
            }
            // The channel failed while no WRITE was posted: the next post is refused.
            (void)co_await lp.a.write(out.local(0, 8), in.remote(8));
        } catch (const std::system_error& e) {
            record(trigger, e);
        }
        ++trigger.resumed;
    };
    {
        fail_ring_reads broken(EIO);
        io.run(when_all(on_b(), on_ring(), on_srq_recv(), on_low_water(), fail_it()));
    }
    CHECK(lp.ch.error() == EIO);
    CHECK(trigger.resumed == 1);
    CHECK(delivered >= 1); // WRITEs whose events were read before the failure
    CHECK(trigger.error == EIO);
    for (const ended* e : {&owed_recv, &ring_next, &srq_recv, &low_water}) {
        MESSAGE(e->what);
        CHECK(e->resumed == 1);
        CHECK(e->error == EIO);
    }
    for (const ended* e : {&owed_recv, &ring_next, &srq_recv})
        CHECK(e->what.find("a completion channel of") != std::string::npos);
    CHECK(low_water.what.find("srq::low_water") != std::string::npos);
    CHECK(owed_recv.what.find("the receive (ibv_post_recv) on qp") != std::string::npos);
    CHECK(srq_recv.what.find("the shared receive (ibv_post_srq_recv)") != std::string::npos);
    // Nothing more arrives for them (the QPs were reset): the loop runs on a while. A late
    // completion would reach a request whose frame is gone: the ASan run of this suite sees it.
    io.run([&]() -> task<void> { co_await sleep_for(io, 50ms); }());
    // Later posts, a new QP on the failed CQs or on the srq: refused with the errno.
    const auto refused_eio = [](auto&& f, const char* what) {
        try {
            f();
            FAIL_CHECK(what << ": not refused");
        } catch (const std::system_error& e) {
            MESSAGE(std::string(e.what()));
            CHECK(e.code().value() == EIO);
            CHECK(std::string(e.what()).find("a completion channel of") != std::string::npos);
        }
    };
    ended later_send;
    io.run([&]() -> task<void> {
        try {
            (void)co_await lp.a.send(out.local(0, 8));
        } catch (const std::system_error& e) {
            record(later_send, e);
        }
    }());
    CHECK(later_send.error == EIO);
    CHECK(later_send.what.find("a completion channel of its CQs failed") != std::string::npos);
    // The srq's qp on a healthy channel: cut off with it, and told why.
    ended elsewhere_send;
    io.run([&]() -> task<void> {
        try {
            (void)co_await on_srq_elsewhere.send(out.local(0, 8));
        } catch (const std::system_error& e) {
            record(elsewhere_send, e);
        }
    }());
    MESSAGE(elsewhere_send.what);
    CHECK(elsewhere_send.error == EIO);
    CHECK(elsewhere_send.what.find("its srq's receive CQs failed") != std::string::npos);
    CHECK(on_srq_elsewhere.in_error());
    // The srq whose qp only sends on the failed channel goes on.
    CHECK(elsewhere.error() == 0);
    CHECK_NOTHROW(spared.post_recv(in.local(192, 64), 8));
    refused_eio([&] { shared.post_recv(in.local(128, 64), 7); }, "a post to the srq");
    refused_eio([&] { qp q(dev.pd, lp.cq_b, lp.cq_b, {}); }, "a qp on a failed channel's CQ");
    refused_eio(
        [&] {
            qp q(dev.pd, elsewhere_cq, elsewhere_cq, {},
                 qp_options{.shared_receive_queue = &shared});
        },
        "a qp on the cut-off srq");
    int said_qp = 0, said_srq = 0;
    for (const std::string& line : lines) {
        MESSAGE(line);
        if (line.find("owed requests end now") != std::string::npos) ++said_qp;
        if (line.find("owed receives end now") != std::string::npos) ++said_srq;
    }
    CHECK(said_qp == 2); // a (the ring's slots) and b (the receive); on_srq owes nothing
    CHECK(said_srq == 1);
}

TEST_CASE("the ring path serves the event of a channel's only armed CQ at once, in the CQE "
          "loop; never while a channel of the io_context has a priority, nor on the syscall "
          "path") {
    struct variant {
        event_read path;
        int priority;
        bool at_once;
        int faults; // reads interrupted and arms refused (interrupt_events), the first ones
    };
    for (const variant v :
         {variant{event_read::ring, 0, true, 0}, variant{event_read::ring, 3, false, 0},
          variant{event_read::syscall, 0, false, 0}, variant{event_read::ring, 0, true, 12}}) {
        const std::string path_name = to_string(v.path);
        CAPTURE(path_name);
        CAPTURE(v.priority);
        CAPTURE(v.faults);
        watchdog wd(60s, "served at once");
        device dev;
        io_context io;
        // One CQ per channel: a's sends complete on ch_a's, b's receives on ch_b's.
        channel ch_a(io, dev.ctx, channel_options{.priority = v.priority, .read = v.path});
        channel ch_b(io, dev.ctx, channel_options{.read = v.path});
        cq cq_a(ch_a), cq_b(ch_b);
        qp a(dev.pd, cq_a, cq_a), b(dev.pd, cq_b, cq_b);
        auto link = connect_pair(a.native_qp(), b.native_qp(), all_remote);
        region out(dev.pd, 64), in(dev.pd, 64);
        // With faults (from here on, the CQs armed and the first reads queued): every wakeup
        // being served at once without them, the first arm refused and the first next read
        // interrupted are the at-once service's own. A refused arm is left to the pass (armed
        // again, polled after), an interrupted read too (read again).
        std::optional<interrupt_events> faults;
        if (v.faults > 0) faults.emplace(v.faults);
        auto exchanges = [&]() -> task<int> {
            int ok = 0;
            for (std::uint32_t i = 0; i < 200; ++i)
                ok += co_await exchange(a, b, out, in, 0, 32, i) ? 1 : 0;
            co_return ok;
        };
        CHECK(io.run(exchanges()) == 200);
        if (v.faults > 0) {
            CHECK(interrupt_events::interrupted() == v.faults);
            CHECK(interrupt_events::refused() == v.faults);
        }
        for (const channel* c : {&ch_a, &ch_b}) {
            const channel_counters& k = c->counters();
            CHECK(k.completions == 200);
            CHECK(k.events > 0);
            CHECK(k.wakeups > 0);
            // Each event re-arms (and the first arm); a refused arm is tried again.
            CHECK(k.arms == k.events + 1 + k.arm_retries);
            if (v.faults > 0) {
                CHECK(k.served_at_once > 0);
                CHECK(k.served_at_once <= k.wakeups);
            } else if (v.at_once) {
                CHECK(k.served_at_once == k.wakeups);
            } else {
                CHECK(k.served_at_once == 0);
            }
            MESSAGE(k.wakeups << " wakeups, " << k.served_at_once << " served at once");
        }
    }
}

namespace {
// Two channels of one CQ each (a's sends on ch_a's, b's receives on ch_b's): on the ring path
// every wakeup of either is served at once, in the CQE loop (the case above).
struct at_once_pair {
    channel ch_a, ch_b;
    cq cq_a, cq_b;
    qp a, b;
    pair_link link;
    region out, in;
    at_once_pair(device& dev, io_context& io)
        : ch_a(io, dev.ctx), ch_b(io, dev.ctx), cq_a(ch_a), cq_b(ch_b), a(dev.pd, cq_a, cq_a),
          b(dev.pd, cq_b, cq_b), out(dev.pd, 64), in(dev.pd, 64) {
        link = connect_pair(a.native_qp(), b.native_qp(), all_remote);
    }
    task<int> exchanges(int n, std::uint32_t seed) {
        int ok = 0;
        for (int i = 0; i < n; ++i)
            ok += co_await exchange(a, b, out, in, 0, 32, seed + static_cast<std::uint32_t>(i)) ? 1
                                                                                                : 0;
        co_return ok;
    }
};
} // namespace

TEST_CASE("a next read that finds no SQE, at once or in the pass, is queued on a later turn: "
          "nothing lost, the channel stays on the ring") {
    watchdog wd(60s, "reads without an SQE");
    device dev;
    io_context io;
    at_once_pair p(dev, io);
    REQUIRE(p.ch_a.event_path() == event_read::ring);
    CHECK(io.run(p.exchanges(5, 0)) == 5); // reads worked; each channel has its one in flight
    // What each channel's counters said at each of its starved reads.
    struct sample {
        int fd;
        std::uint64_t served_at_once, wakeups;
    };
    static std::array<sample, 16> samples;
    static std::size_t n_samples = 0;
    static at_once_pair* pair = nullptr;
    n_samples = 0;
    pair = &p;
    const auto at_once_before = [&](const channel& c) { return c.counters().served_at_once; };
    const std::uint64_t base_a = at_once_before(p.ch_a), base_b = at_once_before(p.ch_b);
    CHECK(p.ch_a.counters().wakeups == base_a); // every wakeup so far served at once
    CHECK(p.ch_b.counters().wakeups == base_b);
    {
        // Three starved reads a channel. From here a read is only queued after its channel's
        // event (one read in flight, none after it starves): the first starved one of each
        // channel is queued by the at-once service of that event (served_at_once one more than
        // before); the next two by the pass's refill on later turns (no event in between).
        starve_event_reads starved(io, 3, [](int fd) noexcept {
            const channel& c = fd == pair->ch_a.fd() ? pair->ch_a : pair->ch_b;
            if (n_samples < samples.size())
                samples[n_samples++] = {fd, c.counters().served_at_once, c.counters().wakeups};
        });
        CHECK(io.run(p.exchanges(100, 5)) == 100);
        CHECK(starve_event_reads::starved(p.ch_a.fd()) == 3);
        CHECK(starve_event_reads::starved(p.ch_b.fd()) == 3);
        CHECK(starve_event_reads::refusals_left() == 0); // each starved get_sqe gave up
    }
    REQUIRE(n_samples == 6);
    for (const auto& [c, base] : {std::pair{&p.ch_a, base_a}, std::pair{&p.ch_b, base_b}}) {
        std::vector<sample> mine;
        for (std::size_t i = 0; i < n_samples; ++i)
            if (samples[i].fd == c->fd()) mine.push_back(samples[i]);
        REQUIRE(mine.size() == 3);
        CHECK(mine[0].served_at_once == base + 1); // at once
        CHECK(mine[0].wakeups == base + 1);
        for (std::size_t i = 1; i < mine.size(); ++i) { // in the pass, no event since
            CHECK(mine[i].served_at_once == mine[0].served_at_once);
            CHECK(mine[i].wakeups == mine[0].wakeups);
        }
    }
    CHECK(io.run(p.exchanges(20, 105)) == 20);
    for (const channel* c : {&p.ch_a, &p.ch_b}) {
        CHECK(c->error() == 0);
        CHECK(c->event_path() == event_read::ring);
        CHECK(c->counters().completions == 125);
        CHECK(c->counters().events > 0);
    }
}

TEST_CASE("reads that find no SQE max_retries turns in a row fail the channel with EBUSY, with a "
          "diagnostics line; what its QPs owe ends once, their posts are refused") {
    watchdog wd(120s, "reads without an SQE, for good");
    device dev;
    io_context io;
    std::vector<std::string> lines;
    const captured_diagnostics capture(lines);
    at_once_pair p(dev, io);
    CHECK(io.run(p.exchanges(5, 0)) == 5);
    constexpr int max_retries = static_cast<int>(ringverbs::detail::fd_watch::max_retries);
    struct ended {
        int resumed = 0, ok = -1, error = 0;
        std::string what;
    };
    ended owed, later;
    {
        starve_event_reads starved(io, 1 << 30);
        // The exchange whose events bring each channel's first starved read completes (its
        // completions were dispatched before the next read was queued).
        CHECK(io.run(p.exchanges(1, 5)) == 1);
        // The next one is owed when the channels fail, max_retries turns later: it ends once,
        // with the completions the device made (polled when the failure resets the QP) or with
        // the failure.
        auto owe = [&]() -> task<void> {
            try {
                owed.ok = co_await p.exchanges(1, 6);
            } catch (const std::system_error& e) {
                owed.error = e.code().value();
                owed.what = e.what();
            }
            ++owed.resumed;
        };
        io.run(owe());
        // max_retries starved reads per channel, then no more (a failed channel reads nothing).
        CHECK(starve_event_reads::starved() == 2 * max_retries);
    }
    CHECK(owed.resumed == 1);
    CHECK((owed.ok == 1 || owed.error == EBUSY));
    MESSAGE("owed exchange: ok " << owed.ok << ", error " << owed.error << " " << owed.what);
    for (const channel* c : {&p.ch_a, &p.ch_b})
        CHECK(c->error() == EBUSY);
    auto post_later = [&]() -> task<void> {
        try {
            (void)co_await p.a.send(p.out.local(0, 8));
        } catch (const std::system_error& e) {
            later.error = e.code().value();
            later.what = e.what();
        }
        ++later.resumed;
    };
    io.run(post_later());
    CHECK(later.resumed == 1);
    CHECK(later.error == EBUSY);
    CHECK(later.what.find("a completion channel of its CQs failed") != std::string::npos);
    int said = 0;
    for (const std::string& line : lines) {
        MESSAGE(line);
        if (line.find("reading its events through io_uring failed: Device or resource busy") !=
            std::string::npos)
            ++said;
    }
    CHECK(said == 2);
}

TEST_CASE("channel counters mean the same on both event paths: every event counted, acked and "
          "followed by an arm; wakeups at most one per event") {
    for (event_read path : event_paths) {
        const std::string path_name = to_string(path);
        CAPTURE(path_name);
        device dev;
        io_context io;
        loopback lp(dev, io, channel_options{.ack_batch = 1, .read = path});
        region out(dev.pd, 64), in(dev.pd, 64);
        CHECK(io.run(in_turn(lp, out, in, 300, 32)) == 300);
        const channel_counters& ch = lp.ch.counters();
        const cq_counters& ca = lp.cq_a.counters();
        const cq_counters& cb = lp.cq_b.counters();
        CHECK(ch.events == ca.events + cb.events);
        CHECK(ch.events > 0);
        CHECK(ch.events <= ch.completions);
        CHECK(ch.completions == 600);
        CHECK(ch.wakeups > 0);
        CHECK(ch.wakeups <= ch.events);
        // ack_batch 1: each event acked in its own service pass, on either path.
        CHECK(ca.acked_events == ca.events);
        CHECK(cb.acked_events == cb.events);
        CHECK(ch.acks == ch.events);
        // Each event re-arms its CQ (plus the first arm of each).
        CHECK(ch.arms == ch.events + 2);
        MESSAGE(path_name << ": " << ch.wakeups << " wakeups, " << ch.events << " events, "
                          << ch.arms << " arms, " << ch.polls << " polls for " << ch.completions
                          << " completions");
    }
}
