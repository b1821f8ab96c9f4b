#include "rdma_test_pair.hpp"

#include <ringverbs/engine/error.hpp>
#include <ringverbs/verbs/verb_error.hpp>

#include <rdma/rdma_cma.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <string>

namespace ringverbs::test {

struct pair_link::ids {
    rdma_event_channel* channel = nullptr;
    rdma_cm_id* listening = nullptr;
    rdma_cm_id* connecting = nullptr;
    rdma_cm_id* accepted = nullptr;
    ~ids() {
        // Disconnect first: the QPs go to the error state while both ends still exist.
        if (connecting) rdma_disconnect(connecting);
        if (accepted) rdma_disconnect(accepted);
        if (accepted) rdma_destroy_id(accepted);
        if (connecting) rdma_destroy_id(connecting);
        if (listening) rdma_destroy_id(listening);
        if (channel) rdma_destroy_event_channel(channel);
    }
};

pair_link::pair_link() noexcept = default;
pair_link::pair_link(std::unique_ptr<ids> held) noexcept : ids_(std::move(held)) {}
pair_link::pair_link(pair_link&&) noexcept = default;
pair_link& pair_link::operator=(pair_link&&) noexcept = default;
pair_link::~pair_link() = default;

void pair_link::reset() noexcept {
    ids_.reset();
}

namespace {

[[noreturn]] void fail(int err, const std::string& what) {
    throw_system_error(err != 0 ? err : EIO, "connect_pair (iWARP): " + what);
}

// The next rdma_cm event, bounded; it must be `want` (for `id`, when given). Acked.
rdma_cm_id* expect(rdma_event_channel* ch, rdma_cm_event_type want, const char* step) {
    pollfd p{ch->fd, POLLIN, 0};
    const int r = ::poll(&p, 1, 15000);
    if (r == 0) fail(ETIMEDOUT, std::string(step) + ": no rdma_cm event in 15 s");
    if (r < 0) fail(errno, std::string(step) + ": poll");
    rdma_cm_event* ev = nullptr;
    if (rdma_get_cm_event(ch, &ev) != 0) fail(errno, std::string(step) + ": rdma_get_cm_event");
    const rdma_cm_event_type got = ev->event;
    const int status = ev->status;
    rdma_cm_id* id = ev->id;
    rdma_ack_cm_event(ev);
    if (got != want)
        fail(status < 0 ? -status : EPROTO, std::string(step) + ": got " + rdma_event_str(got) +
                                                " (status " + std::to_string(status) +
                                                "), wanted " + rdma_event_str(want));
    return id;
}

} // namespace

namespace {

pair_link connect_iwarp(verbs::queue_pair& a, verbs::queue_pair& b, bool& qp_tied);

} // namespace

pair_link connect_pair(verbs::queue_pair& a, verbs::queue_pair& b, verbs::access remote_rights,
                       const verbs::rts_params& send_side) {
    const rdma_test_device& dev = rdma_device();
    if (!dev.iwarp) {
        verbs::connect_loopback(a, b, dev.port, dev.gid_index, remote_rights, send_side);
        return {};
    }
    // The access rights are the QP's own (siw takes them at INIT); the CM moves it on from there.
    a.to_init(dev.port, remote_rights);
    b.to_init(dev.port, remote_rights);
    // rdma_cm picks ports from its own port space, which iWARP then binds in the kernel's TCP
    // space: a port still held there (a connection of an earlier pair closing) refuses the
    // connect at once (ECONNREFUSED: the listener's port; EADDRNOTAVAIL or EADDRINUSE: the
    // connecting side's). Other ports then do; a few tries, said aloud. Those come from the
    // TCP connect, before siw ties QP a to the attempt. A reset (ECONNRESET, at once: siw had
    // tied QP a and sent the MPA request, and the reset suspended QP a's sending for good; or
    // a reject after rdma_connect returned 0: closing the attempt moves QP a to ERROR, which
    // siw never leaves) is thrown: a retry would connect a QP whose sends never complete.
    for (int attempt = 1;; ++attempt) {
        bool qp_tied = false;
        try {
            return connect_iwarp(a, b, qp_tied);
        } catch (const std::system_error& e) {
            const int err = e.code().value();
            const bool port_taken =
                err == ECONNREFUSED || err == EADDRNOTAVAIL || err == EADDRINUSE;
            if (!port_taken || qp_tied || attempt == 5) throw;
            std::fprintf(stderr, "connect_pair: %s; trying another port (%d of 5)\n", e.what(),
                         attempt + 1);
        }
    }
}

namespace {

// `qp_tied`: set once rdma_connect has given QP a to the attempt.
pair_link connect_iwarp(verbs::queue_pair& a, verbs::queue_pair& b, bool& qp_tied) {
    const rdma_test_device& dev = rdma_device();

    const char* addr = std::getenv("RINGVERBS_ADDR");
    if (addr == nullptr || *addr == '\0')
        fail(EINVAL, "set RINGVERBS_ADDR to the IPv4 address of " + dev.name);
    sockaddr_in sin{};
    sin.sin_family = AF_INET;
    if (::inet_pton(AF_INET, addr, &sin.sin_addr) != 1)
        fail(EINVAL, std::string("RINGVERBS_ADDR=") + addr + " is not an IPv4 address");

    auto held = std::make_unique<pair_link::ids>();
    auto& s = *held;
    s.channel = rdma_create_event_channel();
    if (s.channel == nullptr) fail(errno, "rdma_create_event_channel");
    if (rdma_create_id(s.channel, &s.listening, nullptr, RDMA_PS_TCP) != 0)
        fail(errno, "rdma_create_id");
    if (rdma_bind_addr(s.listening, reinterpret_cast<sockaddr*>(&sin)) != 0)
        fail(errno, std::string("rdma_bind_addr(") + addr + ":0)");
    if (rdma_listen(s.listening, 4) != 0) fail(errno, "rdma_listen");
    sin.sin_port = rdma_get_src_port(s.listening);

    if (rdma_create_id(s.channel, &s.connecting, nullptr, RDMA_PS_TCP) != 0)
        fail(errno, "rdma_create_id");
    if (rdma_resolve_addr(s.connecting, nullptr, reinterpret_cast<sockaddr*>(&sin), 5000) != 0)
        fail(errno, "rdma_resolve_addr");
    expect(s.channel, RDMA_CM_EVENT_ADDR_RESOLVED, "rdma_resolve_addr");
    if (rdma_resolve_route(s.connecting, 5000) != 0) fail(errno, "rdma_resolve_route");
    expect(s.channel, RDMA_CM_EVENT_ROUTE_RESOLVED, "rdma_resolve_route");
    if (s.connecting->verbs == nullptr ||
        s.connecting->verbs->device != a.native()->context->device)
        fail(ENODEV, std::string("RINGVERBS_ADDR=") + addr + " does not belong to " + dev.name);

    ibv_device_attr attr{};
    verbs::verb_check(ibv_query_device(a.native()->context, &attr), "ibv_query_device");
    rdma_conn_param param{};
    param.responder_resources = static_cast<std::uint8_t>(std::clamp(attr.max_qp_rd_atom, 0, 16));
    param.initiator_depth = static_cast<std::uint8_t>(std::clamp(attr.max_qp_init_rd_atom, 0, 16));
    param.qp_num = a.qp_num();
    if (rdma_connect(s.connecting, &param) != 0) fail(errno, "rdma_connect");
    qp_tied = true;
    s.accepted = expect(s.channel, RDMA_CM_EVENT_CONNECT_REQUEST, "rdma_connect");
    param.qp_num = b.qp_num();
    if (rdma_accept(s.accepted, &param) != 0) fail(errno, "rdma_accept");
    // Both ends report ESTABLISHED on the one channel, in either order.
    expect(s.channel, RDMA_CM_EVENT_ESTABLISHED, "establishing");
    expect(s.channel, RDMA_CM_EVENT_ESTABLISHED, "establishing");
    return pair_link(std::move(held));
}

} // namespace

} // namespace ringverbs::test
