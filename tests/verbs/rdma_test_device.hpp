// Which RDMA device the rdma suite runs on, and the decision to skip when there is none.
//
// Device: $RINGVERBS_DEVICE, else $RDMA_DEVICE (set by the reference Soft-RoCE VM), else the
// first device with an active port. A named device that is missing or has no active port is a
// failure, not a skip: whoever named it expected it to be there.
// GID index: $RINGVERBS_GID_INDEX, else the lowest RoCE v2 GID carrying an IPv4 address (the one
// that routes over the netdev's IPv4 address), else any RoCE v2 GID; 0 on InfiniBand.
#pragma once

#include <ringverbs/verbs/context.hpp>
#include <ringverbs/verbs/device.hpp>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <system_error>

namespace ringverbs::test {

// Test suites of cases that need what some devices do not have; rdma_test_main.cpp filters
// them out there (doctest lists them as skipped) and says why:
// - InfiniBand/RoCE transport (RNR, manual QP state changes and reconnecting a QP, SEND and
//   WRITE WITH IMMEDIATE, atomics, IB CM reject reasons): not on iWARP;
inline constexpr const char* ib_roce_only = "ib_roce_only";
// - iWARP transport (what the runtime does only there: rdma_connect on a thread of its own):
//   not on InfiniBand/RoCE.
inline constexpr const char* iwarp_only = "iwarp_only";
// - an event for a solicited receive on a CQ armed solicited-only: not on siw, whose 6.1
//   driver completes receives without the solicited flag (cq_options::solicited_only).
inline constexpr const char* solicited_events = "solicited_events";
// - a QP's own remote access flags enforced by the target: not on siw, which checks only a
//   region's rights.
inline constexpr const char* qp_access_checked = "qp_access_checked";
// Cases where threads meet (objects of several io_contexts, cross-thread routing): tools/test.sh
// runs this suite again under ThreadSanitizer in the VM (doctest -ts=threads).
inline constexpr const char* threads = "threads";
inline constexpr std::uint32_t siw_vendor_id = 0x626d74;

// The device, port and GID index the tests use.
struct rdma_test_device {
    std::string name;
    std::uint8_t port = 1;
    std::uint32_t gid_index = 0;
    // The transport is iWARP (siw, ...): QPs connect only through the iWARP CM (connect_pair in
    // rdma_test_pair.hpp), there is no RNR, and rejects carry an errno instead of an IB reason.
    bool iwarp = false;
    // Soft-iWARP (ibv_device_attr::vendor_id), whose quirks some cases cannot run with.
    bool siw = false;
    // Where the choice came from, for the log line.
    std::string how;
};

// Outcome of looking for a device: a device, or why there is none. `hard_error` separates "this
// machine has no RDMA" (skip) from "the device that was asked for is broken" (fail).
struct rdma_probe {
    std::optional<rdma_test_device> device;
    std::string reason;
    bool hard_error = false;
};

namespace detail {

inline const char* env_nonempty(const char* name) {
    const char* v = std::getenv(name);
    return v != nullptr && *v != '\0' ? v : nullptr;
}

inline rdma_probe probe_rdma_device_uncached() {
    rdma_probe out;
    const char* named = env_nonempty("RINGVERBS_DEVICE");
    std::string source = "RINGVERBS_DEVICE";
    if (named == nullptr) {
        named = env_nonempty("RDMA_DEVICE");
        source = "RDMA_DEVICE";
    }
    try {
        verbs::device_list list;
        std::optional<verbs::context> ctx;
        rdma_test_device dev;
        if (named != nullptr) {
            auto d = list.find(named);
            if (!d) {
                out.hard_error = true;
                out.reason = source + "=" + named +
                             " but libibverbs lists no such device (it lists " +
                             std::to_string(list.size()) + ")";
                return out;
            }
            ctx.emplace(*d);
            auto port = ctx->first_active_port();
            if (!port) {
                out.hard_error = true;
                out.reason = source + "=" + named + " has no active port";
                return out;
            }
            dev.port = *port;
            dev.how = "from $" + source;
        } else {
            for (verbs::device d : list) {
                verbs::context c(d);
                if (auto port = c.first_active_port()) {
                    dev.port = *port;
                    ctx.emplace(std::move(c));
                    break;
                }
            }
            if (!ctx) {
                out.reason = list.empty() ? "libibverbs lists no device"
                                          : "none of the " + std::to_string(list.size()) +
                                                " devices has an active port";
                out.reason += "; run the suite in the Soft-RoCE VM, e.g. "
                              "softroce-vm -- meson test --suite rdma";
                return out;
            }
            dev.how = "first device with an active port";
        }
        dev.name = std::string(ctx->name());
        dev.iwarp = ctx->native()->device->transport_type == IBV_TRANSPORT_IWARP;
        dev.siw = ctx->query_device().vendor_id == siw_vendor_id;

        if (const char* gi = env_nonempty("RINGVERBS_GID_INDEX")) {
            char* end = nullptr;
            const unsigned long v = std::strtoul(gi, &end, 10);
            if (*end != '\0' || v > 0xFF) {
                out.hard_error = true;
                out.reason = std::string("RINGVERBS_GID_INDEX=") + gi + " is not a GID index";
                return out;
            }
            dev.gid_index = static_cast<std::uint32_t>(v);
            dev.how += ", GID index from $RINGVERBS_GID_INDEX";
        } else if (dev.iwarp) {
            dev.gid_index = 0;
            dev.how += ", iWARP (connections through the CM, no GID used)";
        } else if (ctx->query_port(dev.port).link_layer == IBV_LINK_LAYER_INFINIBAND) {
            dev.gid_index = 0;
            dev.how += ", GID index 0 (InfiniBand)";
        } else if (auto v4 = ctx->find_gid_index(dev.port, IBV_GID_TYPE_ROCE_V2,
                                                 verbs::gid_family::ipv4)) {
            dev.gid_index = *v4;
            dev.how += ", RoCE v2 IPv4 GID";
        } else if (auto any = ctx->find_gid_index(dev.port, IBV_GID_TYPE_ROCE_V2,
                                                  verbs::gid_family::any)) {
            dev.gid_index = *any;
            dev.how += ", RoCE v2 GID (no IPv4 one)";
        } else {
            out.hard_error = true;
            out.reason = dev.name + " port " + std::to_string(dev.port) +
                         " has no RoCE v2 GID: give the netdev an IP address or set "
                         "RINGVERBS_GID_INDEX";
            return out;
        }
        out.device = std::move(dev);
    } catch (const std::system_error& e) {
        // No uverbs in the kernel (ENOSYS) is the ordinary "no RDMA here" case.
        out.hard_error = named != nullptr || e.code().value() != ENOSYS;
        out.reason = e.what();
        if (e.code().value() == ENOSYS)
            out.reason += ": this kernel has no RDMA support; run the suite in the Soft-RoCE VM, "
                          "e.g. softroce-vm -- meson test --suite rdma";
    }
    return out;
}

} // namespace detail

// Looks for the device once per process and remembers the answer.
inline const rdma_probe& probe_rdma_device() {
    static const rdma_probe probe = detail::probe_rdma_device_uncached();
    return probe;
}

// The device to test on. Only valid after the test main checked probe_rdma_device().
inline const rdma_test_device& rdma_device() {
    return *probe_rdma_device().device;
}

// What a test main does before running tests: prints the choice and returns -1 to go on, or
// prints why not and returns the exit status: 77 (Meson's SKIP) or 1 for a broken named device.
inline int check_rdma_device_or_skip() {
    const rdma_probe& p = probe_rdma_device();
    if (p.device) {
        std::fprintf(stderr, "rdma tests: device %s (%s), port %u, GID index %u (%s)\n",
                     p.device->name.c_str(), p.device->iwarp ? "iWARP" : "InfiniBand/RoCE",
                     p.device->port, p.device->gid_index, p.device->how.c_str());
        return -1;
    }
    if (p.hard_error) {
        std::fprintf(stderr, "FAIL: the RDMA device cannot be used (%s)\n", p.reason.c_str());
        return 1;
    }
    std::fprintf(stderr, "SKIP: no RDMA device (%s)\n", p.reason.c_str());
    return 77;
}

} // namespace ringverbs::test
