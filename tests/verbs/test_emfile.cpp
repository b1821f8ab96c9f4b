// Running out of file descriptors: ibv_create_comp_channel fails with a clear EMFILE error and
// the process carries on once descriptors are available again.
#include "verbs_test_util.hpp"

#include <sys/resource.h>

#include <algorithm>
#include <filesystem>

using namespace ringverbs;
using namespace ringverbs::test;

namespace {

// RLIMIT_NOFILE bounds fd numbers, not counts: the limit that leaves `spare` free descriptors is
// one past the highest open fd plus `spare`.
rlim_t limit_leaving(rlim_t spare) {
    int highest = 2;
    for (const auto& e : std::filesystem::directory_iterator("/proc/self/fd"))
        highest = std::max(highest, std::stoi(e.path().filename().string()));
    return static_cast<rlim_t>(highest) + 1 + spare;
}

} // namespace

TEST_CASE(
    "EMFILE from ibv_create_comp_channel reads as too many open files; the process recovers") {
    loopback lp; // everything but the channels exists before the limit drops
    // Build one such error while descriptors are plentiful: UBSan's first check of a dynamic
    // type probes memory through a pipe, which fails (a false "invalid vptr") once the process
    // is out of fds; after one successful check the result is cached.
    CHECK(std::string(make_system_error(EMFILE, "warm-up").what()).find("too many") !=
          std::string::npos);
    rlimit saved{};
    REQUIRE(getrlimit(RLIMIT_NOFILE, &saved) == 0);

    std::vector<verbs::completion_channel> channels;
    std::optional<std::system_error> failure;
    {
        rlimit low = saved;
        low.rlim_cur = limit_leaving(4);
        REQUIRE(setrlimit(RLIMIT_NOFILE, &low) == 0);
        try {
            for (int i = 0; i < 1000; ++i)
                channels.emplace_back(lp.ctx);
        } catch (const std::system_error& e) {
            failure = e;
        }
        REQUIRE(setrlimit(RLIMIT_NOFILE, &saved) == 0);
    }

    REQUIRE(failure.has_value());
    MESSAGE("after " << channels.size() << " channels: " << std::string(failure->what()));
    CHECK(channels.size() >= 1);
    // Free slots below the highest fd count too, so a few more than 4 may fit.
    CHECK(channels.size() < 1000);
    CHECK(failure->code() == std::errc::too_many_files_open);
    const std::string what = failure->what();
    CHECK(what.find("ibv_create_comp_channel") != std::string::npos);
    CHECK(what.find("too many open files") != std::string::npos);

    // With the limit back, a new channel works end to end: CQ, QPs, a send and its event.
    verbs::completion_channel fresh(lp.ctx);
    verbs::completion_queue cq(lp.ctx, 16, &fresh);
    verbs::queue_pair a(lp.pd, cq, cq), b(lp.pd, cq, cq);
    auto link = connect_pair(a, b);
    std::vector<std::byte> src(256), dst(256);
    fill_pattern(src, 77);
    verbs::memory_region smr(lp.pd, src, verbs::access::none), dmr(lp.pd, dst);
    post_recv_into(b, dmr, 2);
    cq.req_notify();
    post_send_from(a, smr, 1);
    const auto wcs = wait_completions(cq, fresh, 2);
    CHECK(find_wc(wcs, 1).status == IBV_WC_SUCCESS);
    CHECK(find_wc(wcs, 2).status == IBV_WC_SUCCESS);
    CHECK(src == dst);

    // The channels made before the failure are fine too.
    for (verbs::completion_channel& ch : channels)
        CHECK(ch.fd() >= 0);
}
