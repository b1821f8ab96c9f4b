// A loopback pair of RC queue pairs on the test device, served by one io_context and one
// channel: what the runtime tests build on.
#pragma once

#include "rdma_test_device.hpp"

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
using ringverbs::test::rdma_device;

inline constexpr verbs::access all_remote =
    verbs::access::local_write | verbs::access::remote_write | verbs::access::remote_read |
    verbs::access::remote_atomic;

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
    loopback(device& d, io_context& ctx, channel_options opts = {},
             verbs::qp_caps caps = {.max_send_wr = 256,
                                    .max_recv_wr = 256,
                                    .max_send_sge = 1,
                                    .max_recv_sge = 1,
                                    .max_inline_data = 64})
        : dev(d), io(ctx), ch(ctx, d.ctx, opts), cq_a(ch), cq_b(ch), a(d.pd, cq_a, cq_a, caps),
          b(d.pd, cq_b, cq_b, caps) {
        verbs::connect_loopback(a.native_qp(), b.native_qp(), rdma_device().port,
                                rdma_device().gid_index, all_remote);
    }
};

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
