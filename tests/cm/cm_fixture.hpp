// What the rdma_cm tests share: the test device's address, the VM check, private data helpers.
#pragma once

#include "rdma_fixture.hpp"

#include <arpa/inet.h>

#include <cstdlib>
#include <cstring>
#include <span>
#include <string>
#include <system_error>
#include <vector>

namespace rt {

inline std::errc errc_of(const std::system_error& e) {
    return static_cast<std::errc>(e.code().value());
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
