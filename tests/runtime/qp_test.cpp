#include "runtime_fixture.hpp"

#include <ringverbs/completion_error.hpp>
#include <ringverbs/timer.hpp>
#include <ringverbs/when_all.hpp>

#include <doctest/doctest.h>

#include <chrono>
#include <cstdint>
#include <stop_token>

using namespace rt;
using namespace std::chrono_literals;

namespace {
std::errc errc_of(const std::system_error& e) { return static_cast<std::errc>(e.code().value()); }
} // namespace

TEST_CASE("send and recv: each await resumes with its own completion, payload intact") {
    device dev;
    io_context io;
    loopback lp(dev, io);
    region out(dev.pd, 4096), in(dev.pd, 4096);
    fill(out.bytes, 1);
    auto receiver = [&]() -> task<ibv_wc> { co_return co_await lp.b.recv(in.all()); };
    auto sender = [&]() -> task<ibv_wc> { co_return co_await lp.a.send(out.local(0, 1000)); };
    auto [rwc, swc] = io.run(when_all(receiver(), sender()));
    CHECK(rwc.status == IBV_WC_SUCCESS);
    CHECK(rwc.opcode == IBV_WC_RECV);
    CHECK(rwc.byte_len == 1000);
    CHECK(swc.opcode == IBV_WC_SEND);
    CHECK(std::memcmp(in.bytes.data(), out.bytes.data(), 1000) == 0);
    CHECK(lp.a.pending() == 0);
    CHECK(lp.b.pending() == 0);
}

TEST_CASE("send with immediate data, inline and solicited") {
    device dev;
    io_context io;
    loopback lp(dev, io);
    region in(dev.pd, 64);
    std::byte msg[16];
    fill(msg, 9);
    auto receiver = [&]() -> task<ibv_wc> { co_return co_await lp.b.recv(in.all()); };
    auto sender = [&]() -> task<ibv_wc> {
        co_return co_await lp.a.send(local_buffer::inline_data(msg),
                                     send_options{.imm = 0xC0FFEEu, .inline_data = true, .solicited = true});
    };
    auto [rwc, swc] = io.run(when_all(receiver(), sender()));
    CHECK(rwc.opcode == IBV_WC_RECV);
    CHECK((rwc.wc_flags & IBV_WC_WITH_IMM) != 0);
    CHECK(be32toh(rwc.imm_data) == 0xC0FFEEu);
    CHECK(rwc.byte_len == sizeof msg);
    CHECK(std::memcmp(in.bytes.data(), msg, sizeof msg) == 0);
    CHECK(swc.status == IBV_WC_SUCCESS);
}

TEST_CASE("RDMA write, write with immediate, read, compare-and-swap, fetch-and-add") {
    device dev;
    io_context io;
    loopback lp(dev, io);
    region local(dev.pd, 8192), remote(dev.pd, 8192);
    fill(local.bytes, 3);
    fill(remote.bytes, 4);
    auto t = [&]() -> task<void> {
        // write: local[0..4096) -> remote[0..4096)
        ibv_wc w = co_await lp.a.write(local.local(0, 4096), remote.remote(0));
        CHECK(w.opcode == IBV_WC_RDMA_WRITE);
        CHECK(std::memcmp(remote.bytes.data(), local.bytes.data(), 4096) == 0);
        // read: remote[4096..8192) -> local[4096..8192)
        ibv_wc r = co_await lp.a.read(local.local(4096, 4096), remote.remote(4096));
        CHECK(r.opcode == IBV_WC_RDMA_READ);
        CHECK(std::memcmp(local.bytes.data() + 4096, remote.bytes.data() + 4096, 4096) == 0);
        // write with immediate: consumes a receive on the peer, which sees the imm
        auto receiver = [&]() -> task<ibv_wc> { co_return co_await lp.b.recv(local_buffer{}); };
        auto writer = [&]() -> task<ibv_wc> {
            co_return co_await lp.a.write(local.local(0, 128), remote.remote(0), send_options{.imm = 77u});
        };
        auto [rw, ww] = co_await when_all(receiver(), writer());
        CHECK(rw.opcode == IBV_WC_RECV_RDMA_WITH_IMM);
        CHECK(be32toh(rw.imm_data) == 77u);
        CHECK(ww.status == IBV_WC_SUCCESS);
        // atomics on an aligned 8-byte word of the remote region
        std::uint64_t initial = 40;
        std::memcpy(remote.bytes.data() + 64, &initial, 8);
        co_await lp.a.fetch_add(local.local(0, 8), remote.remote(64), 2);
        std::uint64_t old = 0;
        std::memcpy(&old, local.bytes.data(), 8);
        CHECK(old == 40);
        co_await lp.a.compare_swap(local.local(8, 8), remote.remote(64), 42, 1000);
        std::memcpy(&old, local.bytes.data() + 8, 8);
        CHECK(old == 42);
        std::uint64_t now = 0;
        std::memcpy(&now, remote.bytes.data() + 64, 8);
        CHECK(now == 1000);
    };
    io.run(t());
}

TEST_CASE("a chain posted in one call with unsignaled requests is awaited together") {
    device dev;
    io_context io;
    loopback lp(dev, io);
    region src(dev.pd, 4 * 512), dst(dev.pd, 4 * 512);
    fill(src.bytes, 11);
    ibv_sge sge[4];
    ibv_send_wr wr[4]{};
    for (int i = 0; i < 4; ++i) {
        auto b = src.local(static_cast<std::size_t>(i) * 512, 512);
        sge[i] = {reinterpret_cast<std::uintptr_t>(b.addr), b.length, b.lkey};
        wr[i].sg_list = &sge[i];
        wr[i].num_sge = 1;
        wr[i].opcode = IBV_WR_RDMA_WRITE;
        wr[i].wr.rdma.remote_addr = dst.remote(static_cast<std::size_t>(i) * 512).addr;
        wr[i].wr.rdma.rkey = dst.remote().rkey;
        wr[i].send_flags = 0; // unsignaled: only the last (made signaled) completes
        wr[i].next = i < 3 ? &wr[i + 1] : nullptr;
    }
    ibv_wc each[4]{};
    auto t = [&]() -> task<ibv_wc> { co_return co_await lp.a.post_send(wr[0], each); };
    ibv_wc last = io.run(t());
    CHECK(last.status == IBV_WC_SUCCESS);
    CHECK(std::memcmp(dst.bytes.data(), src.bytes.data(), src.bytes.size()) == 0);
    CHECK(lp.cq_a.counters().completions == 1); // selective signaling: one completion
}

TEST_CASE("100,000 per-request send/recv awaits, checked byte for byte") {
    device dev;
    io_context io;
    loopback lp(dev, io);
    constexpr int streams = 16;
    constexpr int total = 100'000;
    constexpr std::size_t size = 64;
    region out(dev.pd, streams * size), in(dev.pd, streams * size);
    long verified = 0;
    long bad = 0;
    // Stream i owns slot i of both regions. It posts its receive and its send back to back
    // (when_all starts both before anything else runs), so the n-th send lands in the n-th
    // receive, which is its own: the bytes match only if every completion reached the
    // coroutine that posted its request and no buffer was reused early.
    auto stream = [&](int i) -> task<void> {
        auto off = static_cast<std::size_t>(i) * size;
        for (int m = i; m < total; m += streams) {
            fill(std::span(out.bytes).subspan(off, size), static_cast<std::uint32_t>(m));
            auto r = [&]() -> task<ibv_wc> { co_return co_await lp.b.recv(in.local(off, size)); };
            auto s = [&]() -> task<ibv_wc> { co_return co_await lp.a.send(out.local(off, size)); };
            auto [rwc, swc] = co_await when_all(r(), s());
            bool ok = rwc.status == IBV_WC_SUCCESS && swc.status == IBV_WC_SUCCESS &&
                      rwc.byte_len == size &&
                      std::memcmp(in.bytes.data() + off, out.bytes.data() + off, size) == 0;
            ok ? ++verified : ++bad;
        }
    };
    std::vector<task<void>> all;
    for (int i = 0; i < streams; ++i) all.push_back(stream(i));
    io.run(when_all(std::move(all)));
    CHECK(bad == 0);
    CHECK(verified == total);
    CHECK(lp.a.pending() == 0);
    CHECK(lp.b.pending() == 0);
    MESSAGE("channel: " << lp.ch.counters().wakeups << " wakeups, " << lp.ch.counters().events
                        << " events, " << lp.ch.counters().acks << " acks, "
                        << lp.ch.counters().polls << " polls, " << lp.ch.counters().completions
                        << " completions");
}

TEST_CASE("a failed completion gives its status; the QP's pending awaits resume with the flush") {
    device dev;
    io_context io;
    loopback lp(dev, io);
    region local(dev.pd, 4096), remote(dev.pd, 4096);
    int flushed = 0;
    // Receives pending on a: the error of a's send queue flushes them too.
    auto waiting_recv = [&]() -> task<void> {
        try {
            co_await lp.a.recv(local.local(0, 64));
        } catch (const completion_error& e) {
            if (e.status() == IBV_WC_WR_FLUSH_ERR) ++flushed;
        }
    };
    auto bad_write = [&]() -> task<std::string> {
        remote_buffer wrong = remote.remote(0);
        wrong.rkey ^= 0x5a5a; // not a key the peer knows
        try {
            co_await lp.a.write(local.local(0, 64), wrong);
        } catch (const completion_error& e) {
            CHECK(e.status() == IBV_WC_REM_ACCESS_ERR);
            co_return e.what();
        }
        co_return "";
    };
    for (int i = 0; i < 5; ++i) io.spawn(waiting_recv());
    std::string what = io.run(bad_write());
    io.run();
    MESSAGE(what);
    CHECK(what.find("ibv_post_send(RDMA_WRITE)") != std::string::npos);
    CHECK(what.find(ibv_wc_status_str(IBV_WC_REM_ACCESS_ERR)) != std::string::npos);
    CHECK(flushed == 5);
    CHECK(lp.a.pending() == 0);
}

TEST_CASE("a posted receive cancelled by its stop_token resumes once flushed") {
    device dev;
    io_context io;
    loopback lp(dev, io);
    region in(dev.pd, 64);
    std::stop_source src;
    auto t = [&]() -> task<std::errc> {
        try {
            co_await lp.b.recv(in.all(), wait_options{src.get_token()});
        } catch (const std::system_error& e) {
            co_return errc_of(e);
        }
        co_return std::errc{};
    };
    auto stopper = [&]() -> task<void> {
        co_await sleep_for(io, 5ms);
        src.request_stop();
    };
    io.spawn(stopper());
    CHECK(io.run(t()) == std::errc::operation_canceled);
    CHECK(lp.b.pending() == 0);
}

TEST_CASE("a posted receive with a timeout resumes with timed_out once flushed") {
    device dev;
    io_context io;
    loopback lp(dev, io);
    region in(dev.pd, 64);
    auto t = [&]() -> task<std::errc> {
        try {
            co_await lp.b.recv(in.all(), 5ms);
        } catch (const std::system_error& e) {
            CHECK(std::string(e.what()).find("ibv_post_recv") != std::string::npos);
            co_return errc_of(e);
        }
        co_return std::errc{};
    };
    CHECK(io.run(t()) == std::errc::timed_out);
    CHECK(io.operations_in_flight() == 1); // only the channel's poll is left
    CHECK(io.waiters() == 0);
}

TEST_CASE("destroying a qp with pending receives resumes every awaiter with the flush") {
    device dev;
    io_context io;
    channel ch(io, dev.ctx);
    cq c(ch);
    region in(dev.pd, 64 * 8);
    int flushed = 0;
    auto q = std::make_unique<qp>(dev.pd, c, c);
    q->native_qp().to_init(rdma_device().port);
    auto waiting = [&](int i) -> task<void> {
        try {
            co_await q->recv(in.local(static_cast<std::size_t>(i) * 64, 64));
        } catch (const completion_error& e) {
            if (e.status() == IBV_WC_WR_FLUSH_ERR) ++flushed;
        }
    };
    for (int i = 0; i < 8; ++i) io.spawn(waiting(i));
    io.run_once(false);
    CHECK(q->pending() == 8);
    q.reset();
    io.run();
    CHECK(flushed == 8);
}
