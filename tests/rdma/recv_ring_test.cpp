// recv_ring on a real RDMA device: messages in arrival order through reposted slots, waits that
// end without touching the receives, failures that stick, a teardown that owes nothing.
#include "../engine/uring_faults.hpp"
#include "rdma_fixture.hpp"

#include <ringverbs/engine/diagnostics.hpp>
#include <ringverbs/engine/timer.hpp>
#include <ringverbs/engine/when_all.hpp>
#include <ringverbs/rdma/recv_ring.hpp>
#include <ringverbs/rdma/srq.hpp>
#include <ringverbs/verbs/detail/verbs_hooks.hpp>

#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <endian.h>
#include <memory>
#include <optional>
#include <stop_token>
#include <vector>

using namespace rt;
using namespace std::chrono_literals;

namespace {

std::errc errc_of(const std::system_error& e) {
    return static_cast<std::errc>(e.code().value());
}

// Message k: its number in the first 4 bytes, then bytes made from it; `len` varies with k.
std::uint32_t length_of(std::uint32_t k) {
    return 16 + (k * 37) % 200;
}
void stamp(std::span<std::byte> s, std::uint32_t k) {
    fill(s, k);
    std::memcpy(s.data(), &k, sizeof k);
}
bool intact(std::span<const std::byte> got, std::uint32_t k) {
    std::vector<std::byte> want(got.size());
    stamp(want, k);
    return got.size() == length_of(k) && std::memcmp(got.data(), want.data(), got.size()) == 0;
}

// What every case starts from: a device, a context, and a loopback pair on it (a sends, the
// ring is made on b).
struct ring_case {
    device dev;
    io_context io;
    loopback lp{dev, io};
};

} // namespace

TEST_CASE_FIXTURE(
    ring_case, "recv_ring: 200 messages through 8 slots arrive in order and intact; every slot is "
               "posted again, the qp owes the ring's 8 receives and nothing else") {
    recv_ring ring(lp.b, dev.pd, 8, 256);
    CHECK(ring.count() == 8);
    CHECK(ring.slot_size() == 256);
    CHECK(lp.b.pending() == 8);
    region out(dev.pd, 8 * 256);
    constexpr std::uint32_t total = 200;
    std::uint32_t got = 0, bad = 0;
    auto run = [&]() -> task<void> {
        // Rounds of 7: the sender never has more in flight than the ring has slots posted
        // (8, less the one whose message is held until the next next()).
        for (std::uint32_t base = 0; base < total; base += 7) {
            const std::uint32_t end = std::min(base + 7, total);
            for (std::uint32_t k = base; k < end; ++k) {
                auto slot = std::span(out.bytes).subspan((k % 8) * 256, length_of(k));
                stamp(slot, k);
                co_await lp.a.send(local_buffer(out.mr, slot));
            }
            if (base == 0) CHECK(ring.ready() >= 1);
            for (std::uint32_t k = base; k < end; ++k) {
                recv_ring::message m = co_await ring.next();
                CHECK(m.wc.status == IBV_WC_SUCCESS);
                if (intact(m.data, k))
                    ++got;
                else
                    ++bad;
            }
        }
    };
    io.run(run());
    CHECK(got == total);
    CHECK(bad == 0);
    // The last message's slot is held until the next next(); the other 7 are posted.
    CHECK(lp.b.pending() == 7);
}

TEST_CASE_FIXTURE(ring_case,
                  "recv_ring: a next() that times out leaves the receives posted; the ring still "
                  "delivers the next message") {
    recv_ring ring(lp.b, dev.pd, 4, 128);
    region out(dev.pd, 128);
    stamp(std::span(out.bytes).first(length_of(1)), 1);
    auto run = [&]() -> task<void> {
        bool timed_out = false;
        try {
            co_await ring.next(wait_options(50ms));
        } catch (const std::system_error& e) {
            timed_out = errc_of(e) == std::errc::timed_out;
            CHECK(std::string(e.what()).find("recv_ring::next") != std::string::npos);
        }
        CHECK(timed_out);
        CHECK(lp.b.pending() == 4);
        co_await lp.a.send(out.local(0, length_of(1)));
        recv_ring::message m = co_await ring.next(wait_options(10s));
        CHECK(intact(m.data, 1));
    };
    io.run(run());
}

TEST_CASE_FIXTURE(
    ring_case, "recv_ring: after the QP's error every next() throws the flush; destroying the ring "
               "then owes nothing") {
    std::optional<recv_ring> ring;
    ring.emplace(lp.b, dev.pd, 4, 64);
    auto run = [&]() -> task<void> {
        lp.b.to_error();
        for (int i = 0; i < 2; ++i) {
            bool flushed = false;
            try {
                co_await ring->next(wait_options(10s));
            } catch (const completion_error& e) {
                flushed = e.status() == IBV_WC_WR_FLUSH_ERR;
            }
            CHECK(flushed);
        }
    };
    io.run(run());
    CHECK(lp.b.pending() == 0);
    ring.reset();
    CHECK(lp.b.pending() == 0);
}

TEST_CASE_FIXTURE(
    ring_case, "recv_ring: destroyed with receives posted, the qp goes to the error state and its "
               "close() ends once the ring's receives flushed") {
    {
        recv_ring ring(lp.b, dev.pd, 6, 64);
        CHECK(lp.b.pending() == 6);
    }
    auto run = [&]() -> task<void> { co_await lp.b.close(wait_options(10s)); };
    io.run(run());
    CHECK(lp.b.pending() == 0);
    CHECK(in_error_state(lp.b));
}

TEST_CASE_FIXTURE(
    ring_case,
    "recv_ring: a next() waiting when the ring is destroyed ends with operation_canceled") {
    std::optional<recv_ring> ring;
    ring.emplace(lp.b, dev.pd, 2, 64);
    bool cancelled = false;
    auto waiter = [&]() -> task<void> {
        try {
            co_await ring->next(wait_options(10s));
        } catch (const std::system_error& e) {
            cancelled = errc_of(e) == std::errc::operation_canceled;
        }
    };
    auto destroyer = [&]() -> task<void> {
        co_await io.schedule();
        ring.reset();
    };
    io.run(when_all(waiter(), destroyer()));
    CHECK(cancelled);
}

TEST_CASE_FIXTURE(ring_case, "recv_ring: what it refuses") {
    // lp: receive queues of 256 (or more)
    auto refused = [&](auto make, std::errc want, const char* says) {
        try {
            make();
            FAIL("accepted");
        } catch (const std::system_error& e) {
            CHECK(errc_of(e) == want);
            CHECK(std::string(e.what()).find(says) != std::string::npos);
        }
    };
    refused([&] { recv_ring r(lp.b, dev.pd, 0, 64); }, std::errc::invalid_argument, "not be 0");
    // The device may round the capacity up (6.12's rxe does): what the qp reports counts.
    const std::uint32_t capacity = lp.b.native_qp().caps().max_recv_wr;
    const std::string holds = "holds " + std::to_string(capacity);
    refused([&] { recv_ring r(lp.b, dev.pd, capacity + 1, 64); }, std::errc::invalid_argument,
            holds.c_str());
    recv_ring first(lp.b, dev.pd, 4, 64);
    refused([&] { recv_ring r(lp.b, dev.pd, 4, 64); }, std::errc::device_or_resource_busy,
            "already has one");
    srq shared(io, dev.pd);
    qp on_srq(dev.pd, lp.cq_a, lp.cq_a, {}, qp_options{.shared_receive_queue = &shared});
    refused([&] { recv_ring r(on_srq, dev.pd, 4, 64); }, std::errc::invalid_argument, "srq");
}

TEST_CASE_FIXTURE(
    ring_case, "recv_ring: one consumer: a second next() while one waits throws EBUSY; the first "
               "still gets its message") {
    recv_ring ring(lp.b, dev.pd, 4, 128);
    region out(dev.pd, 128);
    stamp(std::span(out.bytes).first(length_of(2)), 2);
    bool first_got = false, second_busy = false;
    auto first = [&]() -> task<void> {
        recv_ring::message m = co_await ring.next(wait_options(10s));
        first_got = intact(m.data, 2);
    };
    auto second = [&]() -> task<void> {
        co_await io.schedule(); // after the first is waiting
        try {
            co_await ring.next(wait_options(10s));
        } catch (const std::system_error& e) {
            second_busy = errc_of(e) == std::errc::device_or_resource_busy;
        }
        co_await lp.a.send(out.local(0, length_of(2)));
    };
    io.run(when_all(first(), second()));
    CHECK(second_busy);
    CHECK(first_got);
}

TEST_CASE_FIXTURE(ring_case,
                  "recv_ring: once a spent ring is gone (nothing posted), the qp takes a new one") {
    std::optional<recv_ring> ring;
    ring.emplace(lp.b, dev.pd, 4, 64);
    auto drain = [&]() -> task<void> {
        lp.b.to_error();
        try {
            co_await ring->next(wait_options(10s));
        } catch (const completion_error&) {
        }
        co_await lp.b.close(wait_options(10s)); // every slot flushed
    };
    io.run(drain());
    ring.reset();
    recv_ring again(lp.b, dev.pd, 2, 64); // would be EBUSY if the spent ring still held the qp
    CHECK(again.count() == 2);
    auto drain_again = [&]() -> task<void> { co_await lp.b.close(wait_options(10s)); };
    io.run(drain_again());
}

namespace {

// A device that misreports: every successful receive completion claims 16 KiB more than it
// carried. A fault between the runtime and the real device (the completion itself is real).
struct inflate_receives {
    inflate_receives() noexcept { verbs::detail::hooks().poll_cq = &poll; }
    ~inflate_receives() { verbs::detail::hooks().poll_cq = verbs::detail::real_verbs().poll_cq; }
    inflate_receives(const inflate_receives&) = delete;
    inflate_receives& operator=(const inflate_receives&) = delete;
    static int poll(ibv_cq* cq, int n, ibv_wc* wc) noexcept {
        const int got = verbs::detail::real_verbs().poll_cq(cq, n, wc);
        for (int i = 0; i < got; ++i)
            if (wc[i].status == IBV_WC_SUCCESS && wc[i].opcode == IBV_WC_RECV)
                wc[i].byte_len += 16384;
        return got;
    }
};

} // namespace

TEST_CASE_FIXTURE(
    ring_case, "recv_ring: a peer's RDMA WRITE WITH IMMEDIATE of 16 KiB consumes a 4 KiB slot as a "
               "message with no data and its immediate; nothing past the slot is handed out" *
                   doctest::test_suite(ringverbs::test::ib_roce_only)) {
    recv_ring ring(lp.b, dev.pd, 4, 4096);
    region target(dev.pd, 16384); // remote-writable, on the ring's PD (any connection's region)
    region out(dev.pd, 16384);
    fill(out.bytes, 5);
    auto run = [&]() -> task<void> {
        co_await lp.a.write(out.all(), target.remote(), send_options{.imm = 0xABCDu});
        recv_ring::message m = co_await ring.next(wait_options(10s));
        CHECK(m.wc.opcode == IBV_WC_RECV_RDMA_WITH_IMM);
        CHECK(m.data.empty());
        CHECK(m.wc.byte_len == 16384); // what the peer wrote into its chosen region
        CHECK(be32toh(m.wc.imm_data) == 0xABCDu);
        CHECK(target.bytes == out.bytes);
        // The ring goes on: a SEND after it lands in a slot as usual.
        stamp(std::span(out.bytes).first(length_of(3)), 3);
        co_await lp.a.send(out.local(0, length_of(3)));
        recv_ring::message n = co_await ring.next(wait_options(10s));
        CHECK(n.wc.opcode == IBV_WC_RECV);
        CHECK(intact(n.data, 3));
    };
    io.run(run());
}

TEST_CASE_FIXTURE(
    ring_case,
    "recv_ring: a receive completion longer than its slot is a protocol violation: EPROTO "
    "naming the length, the QP to the error state, every later next() the same") {
    recv_ring ring(lp.b, dev.pd, 4, 256);
    region out(dev.pd, 256);
    stamp(std::span(out.bytes).first(length_of(4)), 4);
    const inflate_receives misreporting;
    auto run = [&]() -> task<void> {
        co_await lp.a.send(out.local(0, length_of(4)));
        for (int i = 0; i < 2; ++i) {
            bool violation = false;
            try {
                recv_ring::message m = co_await ring.next(wait_options(10s));
                MESSAGE("handed out " << m.data.size() << " bytes from a 256-byte slot");
            } catch (const std::system_error& e) {
                MESSAGE(std::string(e.what()));
                violation = errc_of(e) == std::errc::protocol_error;
                CHECK(std::string(e.what()).find("recv_ring::next") != std::string::npos);
                CHECK(std::string(e.what()).find(std::to_string(length_of(4) + 16384)) !=
                      std::string::npos);
            }
            CHECK(violation);
        }
    };
    io.run(run());
    CHECK(in_error_state(lp.b)); // the other slots flush (or time out)
}

namespace {

// What the two fault sets below share, while one lives: Faults::poll as the verbs poll_cq,
// every io_uring submission refused (EBUSY) while Faults::refusing, and the diagnostics taken
// by Faults::sink (which prints them too). All three restored when it goes.
template <typename Faults>
struct poll_submit_sink_hooks {
    static inline bool refusing = false;
    static inline decltype(ringverbs::detail::uring_hooks::submit) saved_submit = nullptr;
    static inline diagnostics_sink saved_sink = nullptr;
    poll_submit_sink_hooks() {
        refusing = false;
        saved_submit = ringverbs::detail::io_uring_hooks().submit;
        verbs::detail::hooks().poll_cq = &Faults::poll;
        ringverbs::detail::io_uring_hooks().submit = &submit;
        saved_sink = set_diagnostics_sink(&Faults::sink);
    }
    ~poll_submit_sink_hooks() {
        set_diagnostics_sink(saved_sink);
        verbs::detail::hooks().poll_cq = verbs::detail::real_verbs().poll_cq;
        ringverbs::detail::io_uring_hooks().submit = saved_submit;
    }
    poll_submit_sink_hooks(const poll_submit_sink_hooks&) = delete;
    poll_submit_sink_hooks& operator=(const poll_submit_sink_hooks&) = delete;
    static int submit(io_uring* ring) noexcept { return refusing ? -EBUSY : saved_submit(ring); }
    static void print(std::string_view m) noexcept {
        std::fprintf(stderr, "ringverbs: %.*s\n", static_cast<int>(m.size()), m.data());
    }
};

// Two receives of one QP in one poll, the first misreported as longer than its slot, and from
// that poll on the submission ring full with every submission refused until the violation's
// flush watch found no SQE for its timer (its diagnostic), so that what the QP owes ends at
// once (the event reader's next read may be refused before: it tries again a turn later).
// Faults between the runtime and the real device and ring; the completions are the device's.
struct violation_in_batch : poll_submit_sink_hooks<violation_in_batch> {
    static inline ibv_cq* target = nullptr;
    static inline io_context* io = nullptr;
    static inline std::vector<ibv_wc> held;
    static inline bool fired = false;
    static inline bool watch_refused = false; // "no flush timer": the watch ended what was owed
    violation_in_batch(ibv_cq* cq, io_context& ctx) {
        target = cq;
        io = &ctx;
        held.clear();
        fired = watch_refused = false;
    }
    static void sink(std::string_view m) noexcept {
        if (m.find("no flush timer") != std::string_view::npos) {
            watch_refused = true;
            refusing = false;
        }
        print(m);
    }
    static int poll(ibv_cq* cq, int n, ibv_wc* wc) noexcept {
        if (cq != target || fired) return verbs::detail::real_verbs().poll_cq(cq, n, wc);
        // Held back until two receives are in: then both in one batch.
        ibv_wc got[8];
        const int k = verbs::detail::real_verbs().poll_cq(cq, 8, got);
        for (int i = 0; i < k; ++i)
            held.push_back(got[i]);
        if (held.size() < 2 || static_cast<int>(held.size()) > n) return 0;
        fired = true;
        held[0].byte_len += 16384; // the first one claims more than its slot
        for (std::size_t i = 0; i < held.size(); ++i)
            wc[i] = held[i];
        ::test::fill_sq(*io, 0);
        refusing = true;
        return static_cast<int>(held.size());
    }
};

} // namespace

TEST_CASE(
    "recv_ring: a violation whose QP's requests end at once (no SQE for the flush timer) while "
    "a second receive of that QP waits in the same poll: each slot completes exactly once, "
    "the qp owes nothing and closes (both ways of reading events, and busy polling)") {
    for (const channel_options& options :
         {channel_options{.read = event_read::ring}, channel_options{.read = event_read::syscall},
          channel_options{.mode = polling_mode::busy}}) {
        const std::string path =
            options.mode == polling_mode::busy ? "busy" : to_string(options.read);
        CAPTURE(path);
        device dev;
        io_context io;
        loopback lp{dev, io, options};
        recv_ring ring(lp.b, dev.pd, 4, 256);
        region out(dev.pd, 2 * 256);
        {
            const violation_in_batch faults(lp.cq_b.native(), io);
            auto run = [&]() -> task<void> {
                for (std::uint32_t k = 0; k < 2; ++k) {
                    auto slot = std::span(out.bytes).subspan(k * 256, length_of(k));
                    stamp(slot, k);
                    co_await lp.a.send(local_buffer(out.mr, slot));
                }
                bool violation = false;
                try {
                    co_await ring.next(wait_options(10s));
                } catch (const std::system_error& e) {
                    MESSAGE(std::string(e.what()));
                    violation = errc_of(e) == std::errc::protocol_error;
                }
                CHECK(violation);
            };
            io.run(run());
            CHECK(violation_in_batch::fired);
            CHECK(violation_in_batch::watch_refused); // the flush watch found no SQE
        }
        bool closed = false;
        auto close = [&]() -> task<void> {
            co_await lp.b.close(wait_options(10s)); // nothing owed: none ended twice
            closed = true;
        };
        io.run(close());
        CHECK(closed);
        CHECK(lp.b.pending() == 0); // 4 receives posted, 4 ended
    }
}

namespace {

// One receive of each of `qps` QPs in one poll of their shared CQ, each misreported as longer
// than its slot, and from that poll on every submission refused: each violation's flush watch
// finds no SQE for its timer and ends what its QP owes at once (reset(), which polls the CQ
// again and runs the watches listed meanwhile). The flushes show up late, each QP's when the
// runtime resets that QP (its watch's diagnostic names it): a device whose flush lags, so that
// no reset ends what another QP owes. Notes the stack address of each reset's first poll: a
// reset nested in another's polls deeper.
struct violations_on_shared_cq : poll_submit_sink_hooks<violations_on_shared_cq> {
    static inline ibv_cq* target = nullptr;
    static inline io_context* io = nullptr;
    static inline std::size_t qps = 0;
    static inline std::vector<ibv_wc> held;
    static inline std::vector<std::uint32_t> released; // QPs whose completions show up now
    static inline bool fired = false;
    static inline std::size_t watches_refused = 0;
    static inline bool reset_next = false; // the next poll is a reset's first
    static inline std::size_t resets_seen = 0;
    static inline std::uintptr_t deepest = 0, shallowest = 0; // of the resets' first polls
    violations_on_shared_cq(ibv_cq* cq, io_context& ctx, std::size_t n) {
        target = cq;
        io = &ctx;
        qps = n;
        held.clear();
        released.clear();
        fired = reset_next = false;
        watches_refused = resets_seen = 0;
        deepest = shallowest = 0;
    }
    static void sink(std::string_view m) noexcept {
        constexpr std::string_view mark = "no flush timer";
        if (m.find(mark) != std::string_view::npos && m.starts_with("qp ")) {
            released.push_back(static_cast<std::uint32_t>(std::strtoul(m.data() + 3, nullptr, 10)));
            reset_next = true;
            if (++watches_refused == qps) refusing = false;
        }
        print(m);
    }
    [[gnu::noinline]] static int poll(ibv_cq* cq, int n, ibv_wc* wc) noexcept {
        if (cq != target) return verbs::detail::real_verbs().poll_cq(cq, n, wc);
        ibv_wc got[16];
        const int k = verbs::detail::real_verbs().poll_cq(cq, 16, got);
        for (int i = 0; i < k; ++i)
            held.push_back(got[i]);
        if (!fired) {
            // Held back until a receive of each QP is in: then all in one batch.
            if (held.size() < qps || static_cast<int>(held.size()) > n) return 0;
            fired = true;
            for (std::size_t i = 0; i < held.size(); ++i) {
                wc[i] = held[i];
                wc[i].byte_len += 16384;
            }
            const int all = static_cast<int>(held.size());
            held.clear();
            ::test::fill_sq(*io, 0);
            refusing = true;
            return all;
        }
        if (reset_next) {
            reset_next = false;
            ++resets_seen;
            const auto here = reinterpret_cast<std::uintptr_t>(__builtin_frame_address(0));
            deepest = deepest == 0 ? here : std::min(deepest, here);
            shallowest = std::max(shallowest, here);
        }
        int out = 0;
        for (auto it = held.begin(); it != held.end() && out < n;) {
            if (std::find(released.begin(), released.end(), it->qp_num) == released.end()) {
                ++it;
                continue;
            }
            wc[out++] = *it;
            it = held.erase(it);
        }
        return out;
    }
};

} // namespace

TEST_CASE("recv_ring: violations of many QPs on one CQ in one poll, each QP's requests ending "
          "at once (no SQE for its flush timer): the resets run one after another, not each "
          "inside the one before; every QP owes nothing and closes") {
    constexpr std::size_t n = 6;
    device dev;
    io_context io;
    channel ch(io, dev.ctx);
    cq shared(ch);
    std::vector<std::unique_ptr<cq>> send_cqs;
    std::vector<std::unique_ptr<qp>> senders, receivers;
    std::vector<pair_link> links;
    std::vector<std::unique_ptr<recv_ring>> rings;
    const verbs::qp_caps caps{.max_send_wr = 16,
                              .max_recv_wr = 16,
                              .max_send_sge = 1,
                              .max_recv_sge = 1,
                              .max_inline_data = 64};
    for (std::size_t i = 0; i < n; ++i) {
        send_cqs.push_back(std::make_unique<cq>(ch));
        senders.push_back(std::make_unique<qp>(dev.pd, *send_cqs.back(), *send_cqs.back(), caps));
        receivers.push_back(std::make_unique<qp>(dev.pd, shared, shared, caps));
        links.push_back(
            connect_pair(senders.back()->native_qp(), receivers.back()->native_qp(), all_remote));
        rings.push_back(std::make_unique<recv_ring>(*receivers.back(), dev.pd, 2, 256));
    }
    region out(dev.pd, 256);
    stamp(std::span(out.bytes).first(length_of(1)), 1);
    {
        const violations_on_shared_cq faults(shared.native(), io, n);
        auto run = [&]() -> task<void> {
            for (auto& s : senders)
                co_await s->send(out.local(0, length_of(1)));
            std::size_t violations = 0;
            for (auto& r : rings) {
                try {
                    co_await r->next(wait_options(10s));
                } catch (const std::system_error& e) {
                    violations += errc_of(e) == std::errc::protocol_error;
                }
            }
            CHECK(violations == n);
        };
        io.run(run());
        CHECK(violations_on_shared_cq::fired);
        CHECK(violations_on_shared_cq::watches_refused == n); // each watch ended its QP at once
        CHECK(violations_on_shared_cq::resets_seen == n);
        // Each reset polled the CQ through the same frames: none ran inside another (each
        // reset nested in the one before polls one run_deferred_watches, watch_flush and reset
        // deeper: on GCC 12 -O2, 128 bytes a QP more, 640 for 6).
        const std::uintptr_t spread =
            violations_on_shared_cq::shallowest - violations_on_shared_cq::deepest;
        MESSAGE("the resets' polls spread over " << spread << " bytes of stack");
        CHECK(spread == 0);
    }
    std::size_t closed = 0;
    auto close = [&]() -> task<void> {
        for (auto& r : receivers) {
            co_await r->close(wait_options(10s)); // nothing owed: none ended twice
            ++closed;
        }
    };
    io.run(close());
    CHECK(closed == n);
    for (auto& r : receivers)
        CHECK(r->pending() == 0); // 2 receives posted, 2 ended
    rings.clear();
}

TEST_CASE_FIXTURE(
    ring_case,
    "recv_ring: a stop requested before next() ends it at once, even with messages ready; "
    "they stay in the ring, in order") {
    recv_ring ring(lp.b, dev.pd, 4, 256);
    region out(dev.pd, 3 * 256);
    std::stop_source stop;
    auto run = [&]() -> task<void> {
        for (std::uint32_t k = 0; k < 3; ++k) {
            auto slot = std::span(out.bytes).subspan(k * 256, length_of(k));
            stamp(slot, k);
            co_await lp.a.send(local_buffer(out.mr, slot));
        }
        for (int spin = 0; ring.ready() < 3 && spin < 2000; ++spin) // 20 s at most
            co_await sleep_for(io, 10ms);
        REQUIRE(ring.ready() == 3);
        stop.request_stop();
        bool cancelled = false;
        try {
            co_await ring.next(wait_options(10s, stop.get_token()));
        } catch (const std::system_error& e) {
            cancelled = errc_of(e) == std::errc::operation_canceled;
        }
        CHECK(cancelled);
        CHECK(ring.ready() == 3);
        for (std::uint32_t k = 0; k < 3; ++k) {
            recv_ring::message m = co_await ring.next(wait_options(10s));
            CHECK(intact(m.data, k));
        }
    };
    io.run(run());
}

TEST_CASE_FIXTURE(
    ring_case, "recv_ring: destroyed by a coroutine that runs between a next()'s message and its "
               "resumption: the next() ends with operation_canceled, never with the freed bytes") {
    std::optional<recv_ring> ring;
    ring.emplace(lp.b, dev.pd, 1, 64); // one slot: once handed out nothing is posted, so
                                       // ~recv_ring frees the memory at once
    region out(dev.pd, 64);
    stamp(std::span(out.bytes).first(length_of(6)), 6);
    bool cancelled = false, got_message = false, destroyed_in_between = false;
    auto consumer = [&]() -> task<void> {
        try {
            recv_ring::message m = co_await ring->next(wait_options(10s));
            got_message = true;
            CHECK(intact(m.data, 6)); // reads the slot: a use-after-free under ASan
        } catch (const std::system_error& e) {
            cancelled = errc_of(e) == std::errc::operation_canceled;
        }
    };
    // Resumed every loop turn, ahead of what the turn's completions ready: it sees the receive
    // taken (nothing owed on b) before the consumer runs, and destroys the ring then.
    auto destroyer = [&]() -> task<void> {
        co_await io.schedule();
        // Unsignaled: the await ends at the post, so that this coroutine turns with the loop
        // before the receive completes, whichever turn brings its event.
        co_await lp.a.send(out.local(0, length_of(6)), send_options{.signaled = false});
        for (long turn = 0; turn < 50'000'000 && ring; ++turn) {
            if (lp.b.pending() == 0 && !got_message && !cancelled) {
                ring.reset();
                destroyed_in_between = true;
            }
            if (ring) co_await io.schedule();
        }
    };
    io.run(when_all(consumer(), destroyer()));
    CHECK(destroyed_in_between);
    CHECK(cancelled);
    CHECK_FALSE(got_message);
}
