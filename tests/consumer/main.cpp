// A program that uses ringverbs from outside: tools/consumer-test builds it as a subproject
// consumer and against an installed ringverbs (pkg-config).
//
// 1. Awaits an io_uring timeout on an io_context (the engine, any Linux host).
// 2. Opens an RDMA device ($RINGVERBS_DEVICE, else $RDMA_DEVICE, else the first one with an
//    active port), connects two RC queue pairs to each other and co_awaits one send and its
//    receive. Exits 77 (skip) when there is no RDMA device, 1 on any failure.
#include <ringverbs/engine/io_context.hpp>
#include <ringverbs/engine/task.hpp>
#include <ringverbs/engine/timer.hpp>
#include <ringverbs/engine/when_all.hpp>
#include <ringverbs/rdma/channel.hpp>
#include <ringverbs/rdma/cq.hpp>
#include <ringverbs/rdma/qp.hpp>
#include <ringverbs/verbs.hpp>

#include <infiniband/verbs.h>

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <optional>
#include <stdexcept>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

using namespace ringverbs;

namespace {

struct rdma_port {
    verbs::context ctx;
    std::uint8_t port;
    std::uint32_t gid_index;
};

const char* env(const char* name) {
    const char* v = std::getenv(name);
    return v != nullptr && *v != '\0' ? v : nullptr;
}

// The device to use, or nullopt when this machine has none (a named one that is missing throws).
std::optional<rdma_port> find_port() {
    const char* named = env("RINGVERBS_DEVICE");
    if (named == nullptr) named = env("RDMA_DEVICE");
    std::optional<verbs::context> ctx;
    std::uint8_t port = 1;
    try {
        verbs::device_list list;
        if (named != nullptr) {
            ctx.emplace(list.at(named));
            auto p = ctx->first_active_port();
            if (!p) throw std::runtime_error(std::string(named) + " has no active port");
            port = *p;
        } else {
            for (verbs::device d : list) {
                verbs::context c(d);
                if (auto p = c.first_active_port()) {
                    ctx.emplace(std::move(c));
                    port = *p;
                    break;
                }
            }
            if (!ctx) return std::nullopt;
        }
    } catch (const std::system_error& e) {
        // No uverbs in this kernel: no RDMA here.
        if (named == nullptr && e.code().value() == ENOSYS) return std::nullopt;
        throw;
    }
    std::uint32_t gid_index = 0;
    if (const char* gi = env("RINGVERBS_GID_INDEX")) {
        gid_index = static_cast<std::uint32_t>(std::stoul(gi));
    } else if (ctx->query_port(port).link_layer != IBV_LINK_LAYER_INFINIBAND) {
        auto g = ctx->find_gid_index(port, IBV_GID_TYPE_ROCE_V2, verbs::gid_family::ipv4);
        if (!g) g = ctx->find_gid_index(port, IBV_GID_TYPE_ROCE_V2, verbs::gid_family::any);
        if (!g) throw std::runtime_error("no RoCE v2 GID on " + std::string(ctx->name()));
        gid_index = *g;
    }
    return rdma_port{std::move(*ctx), port, gid_index};
}

task<void> nap(io_context& io) {
    co_await sleep_for(io, std::chrono::milliseconds(1));
}

int run() {
    io_context io;
    io.run(nap(io));
    std::printf("consumer: io_context awaited a 1 ms io_uring timeout\n");

    std::optional<rdma_port> dev = find_port();
    if (!dev) {
        std::fflush(stdout);
        std::fprintf(stderr, "consumer: SKIP: no RDMA device with an active port\n");
        return 77;
    }
    verbs::protection_domain pd(dev->ctx);
    channel ch(io, dev->ctx);
    cq cq_a(ch), cq_b(ch);
    qp a(pd, cq_a, cq_a), b(pd, cq_b, cq_b);
    verbs::connect_loopback(a.native_qp(), b.native_qp(), dev->port, dev->gid_index);

    std::vector<std::byte> out(256), in(256);
    for (std::size_t i = 0; i < out.size(); ++i)
        out[i] = static_cast<std::byte>(i * 7 + 1);
    verbs::memory_region mr_out(pd, out), mr_in(pd, in);

    auto receiver = [&]() -> task<ibv_wc> { co_return co_await b.recv(local_buffer(mr_in, in)); };
    auto sender = [&]() -> task<ibv_wc> { co_return co_await a.send(local_buffer(mr_out, out)); };
    auto [rwc, swc] = io.run(when_all(receiver(), sender()));

    const bool ok = rwc.status == IBV_WC_SUCCESS && rwc.opcode == IBV_WC_RECV &&
                    rwc.byte_len == out.size() && swc.status == IBV_WC_SUCCESS &&
                    swc.opcode == IBV_WC_SEND && std::memcmp(in.data(), out.data(), in.size()) == 0;
    std::printf("consumer: %s port %u GID %u: co_await recv got %u bytes (%s), send %s\n",
                std::string(dev->ctx.name()).c_str(), dev->port, dev->gid_index, rwc.byte_len,
                ibv_wc_status_str(rwc.status), ibv_wc_status_str(swc.status));
    if (!ok) {
        std::fprintf(stderr, "consumer: FAIL: the received message is not the one sent\n");
        return 1;
    }
    std::printf("consumer: OK\n");
    return 0;
}

} // namespace

int main() {
    try {
        return run();
    } catch (const std::exception& e) {
        std::fprintf(stderr, "consumer: FAIL: %s\n", e.what());
        return 1;
    }
}
