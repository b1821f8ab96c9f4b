// What examples/echo_server/ and examples/echo_client.cpp share: addresses, options, the
// device check, and the few bytes the server tells each client.
#pragma once

#include <ringverbs/rdma/channel.hpp>
#include <ringverbs/ringverbs.hpp>
#include <ringverbs/verbs.hpp>

#include <netdb.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>
#include <span>
#include <stdexcept>
#include <stop_token>
#include <string>
#include <vector>

namespace echo {

inline constexpr std::uint16_t default_port = 18515;
inline constexpr std::uint32_t default_max_size = 4096;

// A usage error: main prints it with --help's text and exits 2.
struct usage_error : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// Runs `parse` on the command line into `out`. Returns nothing to go on; or, after printing
// the usage (and for a bad option the error, on stderr), the exit status: 0 for --help, 2.
template <typename Config, typename Parse>
std::optional<int> parse_options(const char* program, const char* usage, Parse parse, int argc,
                                 char** argv, Config& out) {
    try {
        out = parse(argc, argv);
        return std::nullopt;
    } catch (const usage_error& e) {
        if (*e.what()) std::fprintf(stderr, "%s: %s\n", program, e.what());
        std::fputs(usage, *e.what() ? stderr : stdout);
        return *e.what() ? 2 : 0;
    }
}

inline unsigned long number(const std::string& flag, const std::string& text, unsigned long lo,
                            unsigned long hi) {
    try {
        std::size_t end = 0;
        unsigned long v = std::stoul(text, &end);
        if (end == text.size() && v >= lo && v <= hi) return v;
    } catch (const std::exception&) {
    }
    throw usage_error(flag + " wants a number from " + std::to_string(lo) + " to " +
                      std::to_string(hi) + ", not '" + text + "'");
}

inline ringverbs::polling_mode mode_of(const std::string& text) {
    if (auto m = ringverbs::parse_polling_mode(text)) return *m;
    throw usage_error("--mode wants events, hybrid or busy, not '" + text + "'");
}

// A numeric IPv4 or IPv6 address and a port (rdma_cm resolves addresses, not names).
inline sockaddr_storage address_of(const std::string& text, std::uint16_t port) {
    addrinfo hints{};
    hints.ai_flags = AI_NUMERICHOST | AI_NUMERICSERV;
    addrinfo* found = nullptr;
    const std::string service = std::to_string(port);
    if (int rc = getaddrinfo(text.c_str(), service.c_str(), &hints, &found); rc != 0)
        throw usage_error("--address '" + text + "' is not a numeric IPv4 or IPv6 address (" +
                          gai_strerror(rc) + ")");
    sockaddr_storage a{};
    std::memcpy(&a, found->ai_addr, found->ai_addrlen);
    freeaddrinfo(found);
    return a;
}

inline std::string text_of(const sockaddr* a) {
    char host[NI_MAXHOST] = "?", serv[NI_MAXSERV] = "?";
    const socklen_t len = a->sa_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
    getnameinfo(a, len, host, sizeof host, serv, sizeof serv, NI_NUMERICHOST | NI_NUMERICSERV);
    return a->sa_family == AF_INET6 ? "[" + std::string(host) + "]:" + serv
                                    : std::string(host) + ":" + serv;
}

// Fails clearly when there is no RDMA device at all, or none called `name`.
inline void check_device(const std::string& name) {
    ringverbs::verbs::device_list devices;
    if (devices.empty())
        throw std::runtime_error(
            "no RDMA device on this machine (load a driver, e.g. rdma_rxe for Soft-RoCE, "
            "or run under tools/softroce-vm)");
    if (!name.empty() && !devices.find(name)) {
        std::string names;
        for (std::size_t i = 0; i < devices.size(); ++i)
            names += (i ? ", " : "") + std::string(devices[i].name());
        throw std::runtime_error("no RDMA device called '" + name + "' (there is: " + names + ")");
    }
}

// The private data of the server's accept: what it takes, so that a client can say why a
// connection was closed. Network byte order.
struct server_hello {
    std::uint32_t max_size = 0; // bytes of each posted receive
    std::uint32_t depth = 0;    // receives posted per connection
};

// The private data of the server's reject: why, as a short text (e.g. "busy: 4 connections, the
// server's limit"), at most 148 bytes on RoCE.
inline std::vector<std::byte> reject_data(const std::string& why) {
    const auto text = std::as_bytes(std::span(why.data(), std::min<std::size_t>(why.size(), 148)));
    return {text.begin(), text.end()};
}

// The text of a reject's private data: its printable bytes up to the first NUL (IB CM pads it
// with zeros); empty when there is none (a reject by the peer's CM, or one without a reason).
inline std::string reject_reason(std::span<const std::byte> data) {
    std::string why;
    for (std::byte b : data) {
        const auto c = static_cast<unsigned char>(b);
        if (c == 0) break;
        why += c >= 0x20 && c < 0x7f ? static_cast<char>(c) : '?';
    }
    return why;
}

} // namespace echo
