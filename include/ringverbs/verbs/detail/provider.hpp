// provider: which kernel driver serves a context, for the few places where the runtime works
// around one (docs/design.md, "Transports and providers").
#pragma once

#include <ringverbs/config.hpp>

#include <infiniband/verbs.h>

#include <cstdint>

namespace ringverbs::verbs::detail {

// Soft-iWARP's ibv_device_attr::vendor_id (ASCII "bmt", drivers/infiniband/sw/siw/siw.h).
inline constexpr std::uint32_t siw_vendor_id = 0x626d74;

// Whether `ctx` is served by Soft-iWARP. On an iWARP device, one ibv_query_device: keep the
// answer where it is asked often.
inline bool is_siw(ibv_context* ctx) noexcept {
    if (ctx == nullptr || ctx->device->transport_type != IBV_TRANSPORT_IWARP) return false;
    ibv_device_attr attr{};
    return ibv_query_device(ctx, &attr) == 0 && attr.vendor_id == siw_vendor_id;
}

} // namespace ringverbs::verbs::detail
