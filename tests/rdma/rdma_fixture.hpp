// A loopback pair of RC queue pairs on the test device, served by one io_context and one
// channel: what the runtime tests build on.
#pragma once

#include "rdma_test_device.hpp"
#include "rdma_test_pair.hpp"

#include <ringverbs/engine/io_context.hpp>
#include <ringverbs/rdma/channel.hpp>
#include <ringverbs/rdma/cq.hpp>
#include <ringverbs/rdma/qp.hpp>
#include <ringverbs/verbs.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <vector>

namespace rt {

using namespace ringverbs;
using ringverbs::test::connect_pair;
using ringverbs::test::pair_link;
using ringverbs::test::rdma_device;

inline constexpr verbs::access all_remote =
    verbs::access::local_write | verbs::access::remote_write | verbs::access::remote_read |
    verbs::access::remote_atomic;

// Whether ibv_query_qp tells a QP's state: not on siw (Linux 6.1's siw_query_qp leaves
// qp_state 0, RESET, whatever the state).
inline bool device_reports_qp_state() {
    return !rdma_device().siw;
}
// The QP is in the error state: the device's word where it reports states, else the runtime's
// own record (qp::in_error()).
inline bool in_error_state(qp& q) {
    return device_reports_qp_state() ? q.native_qp().state() == IBV_QPS_ERR : q.in_error();
}
// The QP is connected and usable: RTS where the device reports states, else not in error by
// the runtime's record.
inline bool ready_state(qp& q) {
    return device_reports_qp_state() ? q.native_qp().state() == IBV_QPS_RTS : !q.in_error();
}

// The two ways a channel reads its CQ events (channel_options::read): the tests of the event
// path run on each, the path in CAPTURE.
inline constexpr event_read event_paths[] = {event_read::ring, event_read::syscall};

// A registered buffer.
struct region {
    std::vector<std::byte> bytes;
    verbs::memory_region mr;
    region(const verbs::protection_domain& pd, std::size_t size, verbs::access rights = all_remote)
        : bytes(size), mr(pd, bytes, rights) {}
    local_buffer local(std::size_t offset, std::size_t len) {
        return local_buffer(mr, std::span(bytes).subspan(offset, len));
    }
    local_buffer all() { return local(0, bytes.size()); }
    remote_buffer remote(std::size_t offset = 0) const {
        return {reinterpret_cast<std::uint64_t>(bytes.data()) + offset, mr.native()->rkey};
    }
};

struct device {
    verbs::context ctx{rdma_device().name};
    verbs::protection_domain pd{ctx};
};

// Two connected QPs, a and b, each with its own CQ on one channel.
struct loopback {
    device& dev;
    io_context& io;
    channel ch;
    cq cq_a;
    cq cq_b;
    qp a;
    qp b;
    pair_link link; // last: on iWARP it holds the connection, which goes before the QPs
    loopback(device& d, io_context& ctx, channel_options opts = {},
             verbs::qp_caps caps = {.max_send_wr = 256,
                                    .max_recv_wr = 256,
                                    .max_send_sge = 1,
                                    .max_recv_sge = 1,
                                    .max_inline_data = 64})
        : dev(d), io(ctx), ch(ctx, d.ctx, opts), cq_a(ch), cq_b(ch), a(d.pd, cq_a, cq_a, caps),
          b(d.pd, cq_b, cq_b, caps) {
        link = connect_pair(a.native_qp(), b.native_qp(), all_remote);
    }
};

// Posts a signaled SEND of `b` with a caller-chosen wr_id, outside the per-request awaits:
// its completion goes to cq::next().
inline void raw_send(qp& q, local_buffer b, std::uint64_t wr_id,
                     unsigned flags = IBV_SEND_SIGNALED) {
    ibv_sge sge{reinterpret_cast<std::uintptr_t>(b.addr), b.length, b.lkey};
    ibv_send_wr wr{};
    wr.wr_id = wr_id;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_SEND;
    wr.send_flags = flags;
    q.native_qp().post_send(wr);
}

inline void raw_recv(qp& q, local_buffer b, std::uint64_t wr_id) {
    ibv_sge sge{reinterpret_cast<std::uintptr_t>(b.addr), b.length, b.lkey};
    ibv_recv_wr wr{};
    wr.wr_id = wr_id;
    wr.sg_list = &sge;
    wr.num_sge = 1;
    q.native_qp().post_recv(wr);
}

inline void fill(std::span<std::byte> s, std::uint32_t seed) {
    std::uint32_t x = seed * 2654435761u + 7;
    for (auto& b : s) {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        b = static_cast<std::byte>(x);
    }
}

} // namespace rt
