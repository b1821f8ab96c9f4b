// local_buffer and remote_buffer: the memory a work request reads or writes, here (in a
// registered memory region) and at the peer (its address and rkey).
#pragma once

#include <ringverbs/config.hpp>

#include <ringverbs/verbs/memory_region.hpp>

#include <cstddef>
#include <cstdint>
#include <span>

namespace ringverbs {

// Local memory a request reads or writes: a span inside a registered memory region.
struct local_buffer {
    void* addr = nullptr;
    std::uint32_t length = 0;
    std::uint32_t lkey = 0;

    local_buffer() = default;
    local_buffer(const verbs::memory_region& mr, std::span<std::byte> s) noexcept
        : addr(s.data()), length(static_cast<std::uint32_t>(s.size())), lkey(mr.native()->lkey) {}
    // Data for an inline send: copied at post time, needs no memory region.
    static local_buffer inline_data(std::span<const std::byte> s) noexcept {
        local_buffer b;
        b.addr = const_cast<std::byte*>(s.data());
        b.length = static_cast<std::uint32_t>(s.size());
        return b;
    }
};

// Remote memory of the peer (its address and rkey, exchanged out of band).
struct remote_buffer {
    std::uint64_t addr = 0;
    std::uint32_t rkey = 0;
};

} // namespace ringverbs
