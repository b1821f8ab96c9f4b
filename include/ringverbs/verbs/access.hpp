// Access rights for memory regions and queue pairs, as a type instead of a bare int so that the
// rights a buffer or QP grants are visible at the call site.
#pragma once

#include <ringverbs/config.hpp>

#include <infiniband/verbs.h>

namespace ringverbs::verbs {

// One or more ibv_access_flags. Local read is always allowed and has no flag. Combine with `|`.
enum class access : unsigned {
    none = 0,
    // The device may write into the buffer for this process: receives, RDMA read results, atomics.
    local_write = IBV_ACCESS_LOCAL_WRITE,
    // Peers may RDMA-write into the buffer / QP. Verbs require local_write alongside it on an MR.
    remote_write = IBV_ACCESS_REMOTE_WRITE,
    // Peers may RDMA-read the buffer / through the QP.
    remote_read = IBV_ACCESS_REMOTE_READ,
    // Peers may run atomics on the buffer / through the QP. Needs local_write on an MR.
    remote_atomic = IBV_ACCESS_REMOTE_ATOMIC,
    // Lets the device reorder PCIe writes; providers that do not know it ignore it.
    relaxed_ordering = IBV_ACCESS_RELAXED_ORDERING,
};

// Union of two sets of rights.
[[nodiscard]] constexpr access operator|(access a, access b) noexcept {
    return static_cast<access>(static_cast<unsigned>(a) | static_cast<unsigned>(b));
}

// Intersection of two sets of rights.
[[nodiscard]] constexpr access operator&(access a, access b) noexcept {
    return static_cast<access>(static_cast<unsigned>(a) & static_cast<unsigned>(b));
}

// True when `set` grants every right in `wanted`.
[[nodiscard]] constexpr bool has(access set, access wanted) noexcept {
    return (set & wanted) == wanted;
}

// The int that ibv_reg_mr and ibv_qp_attr::qp_access_flags take.
[[nodiscard]] constexpr int to_ibv(access a) noexcept {
    return static_cast<int>(a);
}

} // namespace ringverbs::verbs
