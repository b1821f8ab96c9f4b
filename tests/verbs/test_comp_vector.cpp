// Completion vectors: every valid one delivers events; an invalid one is refused clearly.
#include "verbs_test_util.hpp"

using namespace ringverbs;
using namespace ringverbs::test;

TEST_CASE("a CQ on each completion vector delivers completions and events") {
    const int vectors = verbs::context(rdma_device().name).num_comp_vectors();
    REQUIRE(vectors >= 1);
    for (int v = 0; v < vectors; ++v) {
        CAPTURE(v);
        loopback lp(verbs::access::none, v);
        CHECK(lp.cq.comp_vector() == v);
        std::vector<std::byte> src(128), dst(128);
        fill_pattern(src, static_cast<std::uint32_t>(v));
        verbs::memory_region smr(lp.pd, src, verbs::access::none), dmr(lp.pd, dst);
        // Arm first so the completions must arrive as a channel event, not just by polling.
        lp.cq.req_notify();
        post_recv_into(lp.b, dmr, 2);
        post_send_from(lp.a, smr, 1);
        auto ev = lp.channel.wait_event(10s);
        REQUIRE(ev.has_value());
        CHECK(ev->cq == lp.cq.native());
        CHECK(ev->user_context == &lp);
        lp.cq.ack_events(1);
        const auto wcs = lp.wait(2);
        CHECK(find_wc(wcs, 1).status == IBV_WC_SUCCESS);
        CHECK(find_wc(wcs, 2).status == IBV_WC_SUCCESS);
        CHECK(src == dst);
    }
}

TEST_CASE("an out-of-range completion vector is a clear error") {
    verbs::context ctx(rdma_device().name);
    verbs::completion_channel ch(ctx);
    const int n = ctx.num_comp_vectors();
    for (int bad : {n, n + 7, -1}) {
        CAPTURE(bad);
        const auto e = catch_system_error([&] { verbs::completion_queue cq(ctx, 16, &ch, bad); });
        CHECK(e.code() == std::errc::invalid_argument);
        const std::string what = e.what();
        CHECK(what.find("ibv_create_cq") != std::string::npos);
        CHECK(what.find("comp_vector " + std::to_string(bad)) != std::string::npos);
        CHECK(what.find("out of range") != std::string::npos);
        MESSAGE(what);
    }
    // The refusal left nothing behind: the channel still works for a valid vector.
    verbs::completion_queue ok(ctx, 16, &ch, n - 1);
    CHECK(ok.comp_vector() == n - 1);
}

TEST_CASE("a CQ larger than the device allows is refused by the verb, with its parameters") {
    verbs::context ctx(rdma_device().name);
    const int max_cqe = ctx.query_device().max_cqe;
    const auto e = catch_system_error([&] { verbs::completion_queue cq(ctx, max_cqe + 1); });
    CHECK(e.code() == std::errc::invalid_argument);
    CHECK(std::string(e.what()).find("ibv_create_cq(entries " + std::to_string(max_cqe + 1)) !=
          std::string::npos);
    verbs::completion_queue biggest(ctx, max_cqe);
    CHECK(biggest.capacity() >= max_cqe);
}
