// Zero heap allocations per completion in steady state, counted with a replaced operator new.
#include "../bench/alloc_counter.hpp"
#include "rdma_fixture.hpp"

#include <ringverbs/engine/when_all.hpp>
#include <ringverbs/rdma/recv_ring.hpp>
#include <ringverbs/rdma/srq.hpp>

#include <doctest/doctest.h>

using namespace rt;

TEST_CASE("per-request awaits and next() allocate nothing per completion in steady state") {
    device dev;
    io_context io;
    loopback lp(dev, io);
    region out(dev.pd, 256), in(dev.pd, 256);
    std::size_t before = 0;
    std::size_t after = 0;
    constexpr int warmup = 200;
    constexpr int measured = 2000;
    // A loop inside one coroutine: the awaiters live in its frame, no task is created per
    // message (a task frame is an allocation by design).
    auto loop = [&]() -> task<void> {
        for (int i = 0; i < warmup + measured; ++i) {
            if (i == warmup) before = bench::allocations.load();
            auto r = lp.b.recv(in.local(0, 64));
            r.post(); // the receive is posted before the send that fills it
            ibv_wc swc = co_await lp.a.send(out.local(0, 64));
            ibv_wc rwc = co_await r;
            CHECK(swc.status == IBV_WC_SUCCESS);
            CHECK(rwc.status == IBV_WC_SUCCESS);
        }
        after = bench::allocations.load();
    };
    io.run(loop());
    MESSAGE("allocations during " << measured << " send/recv round trips: " << after - before);
    CHECK(after - before == 0);
}

TEST_CASE("unsignaled sends allocate nothing, forced-signaled completions included") {
    device dev;
    io_context io;
    loopback lp(dev, io);
    region in(dev.pd, 256);
    std::byte msg[32]{};
    std::size_t before = 0;
    std::size_t after = 0;
    constexpr int warmup = 200;
    constexpr int measured = 2000;
    const send_options unsignaled{
        .imm = {}, .inline_data = true, .solicited = false, .fence = false, .signaled = false};
    auto loop = [&]() -> task<void> {
        for (int i = 0; i < warmup + measured; ++i) {
            if (i == warmup) before = bench::allocations.load();
            auto r = lp.b.recv(in.local(0, 64));
            r.post();
            ibv_wc swc = co_await lp.a.send(local_buffer::inline_data(msg), unsignaled);
            ibv_wc rwc = co_await r;
            CHECK(swc.status == IBV_WC_SUCCESS);
            CHECK(rwc.status == IBV_WC_SUCCESS);
        }
        after = bench::allocations.load();
    };
    io.run(loop());
    MESSAGE("allocations during " << measured
                                  << " unsignaled send/recv round trips: " << after - before);
    CHECK(after - before == 0);
    // One in signal_interval() was signaled and consumed by the qp.
    CHECK(lp.a.counters().forced_signaled == (warmup + measured) / lp.a.signal_interval());
    CHECK(lp.a.counters().throttled == 0);
}

TEST_CASE("srq: a receive pool refilled through cq::next() allocates nothing per message in "
          "steady state") {
    device dev;
    io_context io;
    channel ch(io, dev.ctx);
    cq senders(ch), receivers(ch, cq_options{.entries = 512});
    srq shared(io, dev.pd, srq_options{.max_wr = 64});
    const verbs::qp_caps caps{.max_send_wr = 64,
                              .max_recv_wr = 1,
                              .max_send_sge = 1,
                              .max_recv_sge = 1,
                              .max_inline_data = 64};
    qp a(dev.pd, senders, senders, caps);
    qp b(dev.pd, receivers, receivers, caps, qp_options{.shared_receive_queue = &shared});
    auto link = connect_pair(a.native_qp(), b.native_qp(), all_remote);
    constexpr std::uint64_t slots = 8;
    region out(dev.pd, 64), in(dev.pd, 64 * slots);
    for (std::uint64_t slot = 0; slot < slots; ++slot)
        shared.post_recv(in.local(slot * 64, 64), slot);
    std::size_t before = 0, after = 0;
    constexpr int warmup = 200, measured = 2000;
    auto loop = [&]() -> task<void> {
        for (int i = 0; i < warmup + measured; ++i) {
            if (i == warmup) before = bench::allocations.load();
            ibv_wc swc = co_await a.send(out.local(0, 64));
            CHECK(swc.status == IBV_WC_SUCCESS);
            ibv_wc got = co_await receivers.next();
            CHECK(got.status == IBV_WC_SUCCESS);
            CHECK(got.qp_num == b.qp_num());
            shared.post_recv(in.local(got.wr_id * 64, 64), got.wr_id); // refill that slot
        }
        after = bench::allocations.load();
    };
    io.run(loop());
    MESSAGE("allocations during " << measured << " messages into an srq pool: " << after - before);
    CHECK(after - before == 0);
}

TEST_CASE("recv_ring::next() allocates nothing per message in steady state (its slot is posted "
          "again in place)") {
    device dev;
    io_context io;
    loopback lp(dev, io);
    recv_ring ring(lp.b, dev.pd, 4, 256);
    region out(dev.pd, 256);
    std::size_t before = 0;
    std::size_t after = 0;
    constexpr int warmup = 200;
    constexpr int measured = 2000;
    auto loop = [&]() -> task<void> {
        for (int i = 0; i < warmup + measured; ++i) {
            if (i == warmup) before = bench::allocations.load();
            ibv_wc swc = co_await lp.a.send(out.local(0, 64));
            recv_ring::message m = co_await ring.next();
            CHECK(swc.status == IBV_WC_SUCCESS);
            CHECK(m.data.size() == 64);
        }
        after = bench::allocations.load();
    };
    io.run(loop());
    MESSAGE("allocations during " << measured
                                  << " messages through a recv_ring: " << after - before);
    CHECK(after - before == 0);
}
