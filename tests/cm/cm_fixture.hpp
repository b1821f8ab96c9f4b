// What the rdma_cm tests share: the test device's address, the VM check, private data helpers.
#pragma once

#include "rdma_fixture.hpp"

#include <ringverbs/cm/cm_channel.hpp>
#include <ringverbs/cm/cm_id.hpp>
#include <ringverbs/cm/connection.hpp>
#include <ringverbs/engine/nothrow.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <rdma/rdma_cma.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <span>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

namespace rt {

inline std::errc errc_of(const std::system_error& e) {
    return static_cast<std::errc>(e.code().value());
}
// What co_await nothrow(aw) says: std::errc{} when it succeeded.
template <typename T>
std::errc errc_of(const ringverbs::result<T>& r) {
    return static_cast<std::errc>(r.error().value());
}

// The IPv4 address of the test device: $RINGVERBS_ADDR (the VM harness), else the address its
// RoCE v2 GID carries. rdma_cm cannot bind 127.0.0.1 on rxe.
inline std::string test_addr() {
    if (const char* a = std::getenv("RINGVERBS_ADDR"); a != nullptr && *a != '\0') return a;
    if (const char* a = std::getenv("SOFTROCE_ADDR"); a != nullptr && *a != '\0') return a;
    verbs::context ctx(rdma_device().name);
    ibv_gid_entry e = ctx.query_gid(rdma_device().port, rdma_device().gid_index);
    char text[INET_ADDRSTRLEN] = {};
    inet_ntop(AF_INET, &e.gid.raw[12], text, sizeof text);
    return text;
}

// `ip`:`port` as a sockaddr_in (port in host order). Throws std::invalid_argument for an
// address that is not IPv4.
inline sockaddr_in addr_at(const std::string& ip, std::uint16_t port) {
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    if (inet_pton(AF_INET, ip.c_str(), &a.sin_addr) != 1)
        throw std::invalid_argument("not an IPv4 address: " + ip);
    return a;
}

inline const sockaddr* sa(const sockaddr_in& a) {
    return reinterpret_cast<const sockaddr*>(&a);
}

// Makes `id` listen on `ip` at a port the kernel picks; returns where it listens.
inline sockaddr_in listen_anywhere(ringverbs::cm_id& id, const std::string& ip) {
    sockaddr_in a = addr_at(ip, 0);
    id.listen(sa(a));
    a.sin_port = htons(id.local_port());
    return a;
}

// What most rdma_cm cases start from (TEST_CASE_FIXTURE): one event channel, an id listening on
// the test device's address at a port the kernel picks (`at` says where), and what connections
// on that device need: librdmacm's own context of the device (the PD and CQs of rdma_create_qp
// must be on it), a PD, a completion channel, and a CQ for each side.
struct listening {
    const std::string ip = test_addr();
    ringverbs::io_context io;
    ringverbs::cm_channel events{io};
    ringverbs::cm_id listener{events};
    const sockaddr_in at = listen_anywhere(listener, ip);
    ringverbs::verbs::context dev = listener.device();
    ringverbs::verbs::protection_domain pd{dev};
    ringverbs::channel comp{io, dev};
    ringverbs::cq cq_server{comp};
    ringverbs::cq cq_client{comp};
};

// What the connection cases start from (TEST_CASE_FIXTURE): a listener on the test device's
// address at a port the kernel picks; `at` ("ip:port") is where connect() finds it.
struct serving {
    const std::string ip = test_addr();
    ringverbs::io_context io;
    ringverbs::listener l{io, ip + ":0"};
    const std::string at = ip + ":" + std::to_string(l.port());
};

// Inside tools/softroce-vm, whose device sits on a dummy netdev with no NIC.
inline bool in_our_vm() {
    const char* v = std::getenv("RINGVERBS_IN_VM");
    return v != nullptr && std::string(v) == "1";
}

inline std::vector<std::byte> bytes_of(const char* s) {
    std::vector<std::byte> v(std::strlen(s));
    std::memcpy(v.data(), s, v.size());
    return v;
}

// IB CM pads private data with zeros: compare the prefix that was sent.
inline bool starts_with(std::span<const std::byte> got, const std::vector<std::byte>& want) {
    return got.size() >= want.size() && std::memcmp(got.data(), want.data(), want.size()) == 0;
}

} // namespace rt

namespace rt {

// A peer that sends its connect request and then never reads another rdma_cm event: raw
// librdmacm, no ringverbs. librdmacm sends the RTU while it processes CONNECT_RESPONSE inside
// rdma_get_cm_event, so this peer's handshake never completes (as a SIGSTOPped client's).
class silent_peer {
  public:
    silent_peer(const std::string& ip, std::uint16_t port) {
        channel_ = rdma_create_event_channel();
        if (channel_ == nullptr) throw std::system_error(errno, std::system_category(), "channel");
        if (rdma_create_id(channel_, &id_, nullptr, RDMA_PS_TCP) != 0)
            throw std::system_error(errno, std::system_category(), "rdma_create_id");
        sockaddr_in to{};
        to.sin_family = AF_INET;
        to.sin_port = htons(port);
        inet_pton(AF_INET, ip.c_str(), &to.sin_addr);
        check(rdma_resolve_addr(id_, nullptr, reinterpret_cast<sockaddr*>(&to), 2000),
              "rdma_resolve_addr");
        expect(RDMA_CM_EVENT_ADDR_RESOLVED);
        check(rdma_resolve_route(id_, 2000), "rdma_resolve_route");
        expect(RDMA_CM_EVENT_ROUTE_RESOLVED);
        ibv_qp_init_attr attr{}; // librdmacm's default PD and CQs of the device
        attr.qp_type = IBV_QPT_RC;
        attr.cap.max_send_wr = attr.cap.max_recv_wr = 4;
        attr.cap.max_send_sge = attr.cap.max_recv_sge = 1;
        check(rdma_create_qp(id_, nullptr, &attr), "rdma_create_qp");
        rdma_conn_param p{};
        p.responder_resources = p.initiator_depth = 1;
        p.retry_count = 7;
        p.rnr_retry_count = 7;
        check(rdma_connect(id_, &p), "rdma_connect");
    }
    ~silent_peer() {
        if (id_ != nullptr && id_->qp != nullptr) rdma_destroy_qp(id_);
        if (id_ != nullptr) rdma_destroy_id(id_);
        if (channel_ != nullptr) rdma_destroy_event_channel(channel_);
    }
    silent_peer(const silent_peer&) = delete;
    silent_peer& operator=(const silent_peer&) = delete;

  private:
    static void check(int rc, const char* what) {
        if (rc != 0) throw std::system_error(errno, std::system_category(), what);
    }
    void expect(rdma_cm_event_type want) {
        rdma_cm_event* ev = nullptr;
        check(rdma_get_cm_event(channel_, &ev), "rdma_get_cm_event");
        const rdma_cm_event_type got = ev->event;
        rdma_ack_cm_event(ev);
        if (got != want)
            throw std::system_error(EPROTO, std::system_category(),
                                    std::string("silent_peer: ") + rdma_event_str(got));
    }
    rdma_event_channel* channel_ = nullptr;
    rdma_cm_id* id_ = nullptr;
};

} // namespace rt
