#include <ringverbs/verbs/memory_region.hpp>
#include <ringverbs/verbs/verb_error.hpp>

#include <cstdint>
#include <cstdio>
#include <string>

namespace ringverbs::verbs {

namespace {

std::string describe(std::span<std::byte> buffer, access rights) {
    char text[80];
    std::snprintf(text, sizeof text, "ibv_reg_mr(%zu bytes, access 0x%x)", buffer.size(),
                  static_cast<unsigned>(rights));
    return text;
}

} // namespace

memory_region::memory_region(const protection_domain& pd, std::span<std::byte> buffer,
                             access rights)
    : buffer_(buffer), rights_(rights) {
    // The kernel answers a bare EINVAL for this; saying why saves a trip to the man page.
    if ((has(rights, access::remote_write) || has(rights, access::remote_atomic)) &&
        !has(rights, access::local_write))
        throw_system_error(EINVAL, describe(buffer, rights) +
                                       ": remote_write and remote_atomic need local_write too");
    errno = 0;
    ibv_mr* raw = ibv_reg_mr(pd.native(), buffer.data(), buffer.size(), to_ibv(rights));
    if (raw == nullptr) throw_system_error(errno_or_eio(errno), describe(buffer, rights));
    mr_ = std::shared_ptr<ibv_mr>(raw, [keep = pd.handle()](ibv_mr* m) { ibv_dereg_mr(m); });
}

ibv_sge memory_region::sge(std::size_t offset, std::size_t length) const {
    if (offset > buffer_.size())
        throw_system_error(EINVAL, "memory_region::sge: offset " + std::to_string(offset) +
                                       " is past the region's " + std::to_string(buffer_.size()) +
                                       " bytes");
    if (length == static_cast<std::size_t>(-1)) length = buffer_.size() - offset;
    if (length > buffer_.size() - offset || length > UINT32_MAX)
        throw_system_error(EINVAL, "memory_region::sge: " + std::to_string(length) +
                                       " bytes at offset " + std::to_string(offset) +
                                       " do not fit the region's " +
                                       std::to_string(buffer_.size()) + " bytes");
    return ibv_sge{.addr = remote_addr(offset),
                   .length = static_cast<std::uint32_t>(length),
                   .lkey = mr_->lkey};
}

} // namespace ringverbs::verbs
