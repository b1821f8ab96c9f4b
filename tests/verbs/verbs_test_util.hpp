// Shared pieces of the verbs tests: a loopback RC pair on the test device, waiting for
// completions through the completion channel, and small checks.
#pragma once

#include "rdma_test_device.hpp"
#include "rdma_test_pair.hpp"

#include <ringverbs/verbs.hpp>

#include <doctest/doctest.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <map>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

namespace ringverbs::test {

using namespace std::chrono_literals;

// Runs f, which must throw std::system_error, and returns the exception for inspection.
template <class F>
std::system_error catch_system_error(F&& f) {
    try {
        f();
    } catch (const std::system_error& e) {
        return e;
    }
    FAIL("expected a std::system_error");
    throw std::logic_error("unreachable");
}

// Open descriptors of this process (each context holds 2, each completion channel 1).
inline std::size_t count_open_fds() {
    std::size_t n = 0;
    for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/fd"))
        ++n;
    return n - 1; // the iterator's own
}

// A deterministic byte pattern, different per seed, so a misplaced or stale buffer shows.
inline void fill_pattern(std::span<std::byte> buf, std::uint32_t seed) {
    std::uint32_t x = seed * 2654435761u + 1;
    for (std::byte& b : buf) {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        b = static_cast<std::byte>(x);
    }
}

// Kernel-side object counts of one device from `rdma resource show` (iproute2), e.g.
// {"pd": 1, "cq": 2, "qp": 1, "mr": 0, "ctx": 1}; nullopt when the tool is missing. They are
// system-wide, which is fine in the VM where the test is the only verbs user.
inline std::optional<std::map<std::string, long>> rdma_resource_counts(const std::string& dev) {
    const std::string cmd = "rdma resource show " + dev + " 2>/dev/null";
    FILE* p = ::popen(cmd.c_str(), "r");
    if (p == nullptr) return std::nullopt;
    std::string out;
    char buf[512];
    while (std::fgets(buf, sizeof buf, p) != nullptr)
        out += buf;
    if (::pclose(p) != 0 || out.empty()) return std::nullopt;
    // "0: rxe0: pd 1 cq 2 qp 1 cm_id 0 mr 0 ctx 1 srq 0"
    std::istringstream in(out);
    std::string tok;
    in >> tok >> tok; // index, device
    std::map<std::string, long> counts;
    std::string key;
    long value = 0;
    while (in >> key >> value)
        counts[key] = value;
    return counts;
}

// The counts as "ctx 1 mr 0 pd 1 ...", for readable assertions.
inline std::string show_counts(const std::optional<std::map<std::string, long>>& c) {
    if (!c) return "(no counts)";
    std::string s;
    for (const auto& [k, v] : *c)
        s += (s.empty() ? "" : " ") + k + " " + std::to_string(v);
    return s;
}

// Collects `n` completions from `cq`, sleeping on `channel` between polls: poll, arm, poll again
// (a completion may land between the first poll and arming), then wait for the event and ack it.
// Fails the test when nothing arrives within `timeout`.
inline std::vector<ibv_wc> wait_completions(verbs::completion_queue& cq,
                                            verbs::completion_channel& channel, std::size_t n,
                                            std::chrono::milliseconds timeout = 10s) {
    std::vector<ibv_wc> got;
    ibv_wc wc[16];
    while (got.size() < n) {
        std::size_t k = cq.poll(wc);
        if (k == 0) {
            cq.req_notify();
            k = cq.poll(wc);
        }
        if (k == 0) {
            auto ev = channel.wait_event(timeout);
            REQUIRE_MESSAGE(ev.has_value(), "no completion event within the timeout");
            REQUIRE(ev->cq == cq.native());
            REQUIRE(ev->user_context == cq.user_context());
            cq.ack_events(1);
            continue;
        }
        got.insert(got.end(), wc, wc + k);
    }
    REQUIRE(got.size() == n);
    return got;
}

// The completion with `wr_id` among `wcs`; fails the test if absent.
inline ibv_wc find_wc(const std::vector<ibv_wc>& wcs, std::uint64_t wr_id) {
    for (const ibv_wc& wc : wcs)
        if (wc.wr_id == wr_id) return wc;
    FAIL("no completion with wr_id " << wr_id);
    throw std::logic_error("unreachable");
}

// A connected RC pair on the test device: both QPs share one CQ on one channel.
struct loopback {
    verbs::context ctx;
    verbs::protection_domain pd;
    verbs::completion_channel channel;
    verbs::completion_queue cq;
    verbs::queue_pair a;
    verbs::queue_pair b;
    pair_link link; // last: on iWARP it holds the connection, which goes before the QPs

    explicit loopback(verbs::access remote_rights = verbs::access::none, int comp_vector = 0,
                      verbs::qp_caps caps = {})
        : ctx(rdma_device().name), pd(ctx), channel(ctx), cq(ctx, 256, &channel, comp_vector, this),
          a(pd, cq, cq, caps), b(pd, cq, cq, caps) {
        link = connect_pair(a, b, remote_rights);
    }

    std::vector<ibv_wc> wait(std::size_t n) { return wait_completions(cq, channel, n); }
};

// Posts a receive of `dst` on `to`, a signaled send of `src` on `from`, and checks both complete.
// Posts one receive of the whole of `dst` with `wr_id`.
inline void post_recv_into(verbs::queue_pair& qp, const verbs::memory_region& dst,
                           std::uint64_t wr_id) {
    ibv_sge sge = dst.sge();
    ibv_recv_wr wr{};
    wr.wr_id = wr_id;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    qp.post_recv(wr);
}

// A signaled SEND of `sge` with `wr_id`.
inline ibv_send_wr signaled_send(std::uint64_t wr_id, ibv_sge& sge) {
    ibv_send_wr wr{};
    wr.wr_id = wr_id;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_SEND;
    wr.send_flags = IBV_SEND_SIGNALED;
    return wr;
}

// Posts one signaled SEND of the whole of `src` with `wr_id`.
inline void post_send_from(verbs::queue_pair& qp, const verbs::memory_region& src,
                           std::uint64_t wr_id) {
    ibv_sge sge = src.sge();
    ibv_send_wr wr = signaled_send(wr_id, sge);
    qp.post_send(wr);
}

inline void send_recv(loopback& lp, verbs::queue_pair& from, verbs::queue_pair& to,
                      const verbs::memory_region& src, const verbs::memory_region& dst,
                      std::uint64_t id = 1) {
    post_recv_into(to, dst, id * 2 + 1);
    post_send_from(from, src, id * 2);

    const auto wcs = lp.wait(2);
    const ibv_wc s = find_wc(wcs, id * 2);
    const ibv_wc r = find_wc(wcs, id * 2 + 1);
    CHECK_MESSAGE(s.status == IBV_WC_SUCCESS, std::string(ibv_wc_status_str(s.status)));
    CHECK(s.opcode == IBV_WC_SEND);
    CHECK_MESSAGE(r.status == IBV_WC_SUCCESS, std::string(ibv_wc_status_str(r.status)));
    CHECK(r.opcode == IBV_WC_RECV);
    CHECK(r.byte_len == src.size());
    CHECK(r.qp_num == to.qp_num());
}

} // namespace ringverbs::test
