// Zero heap allocations per completion in steady state, counted with a replaced operator new.
#include "../bench/alloc_counter.hpp"
#include "rdma_fixture.hpp"

#include <ringverbs/engine/when_all.hpp>

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
