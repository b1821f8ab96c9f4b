#include <ringverbs/verbs/context.hpp>
#include <ringverbs/verbs/detail/mmap_keys.hpp>
#include <ringverbs/verbs/verb_error.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>

#include <cstring>

namespace ringverbs::verbs {

bool is_ipv4_mapped(const ibv_gid& gid) noexcept {
    static constexpr unsigned char prefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    return std::memcmp(gid.raw, prefix, sizeof prefix) == 0;
}

std::string to_string(const ibv_gid& gid) {
    char text[INET6_ADDRSTRLEN] = {};
    if (inet_ntop(AF_INET6, gid.raw, text, sizeof text) == nullptr) return {};
    return text;
}

context::context(device dev) {
    errno = 0;
    ibv_context* raw = ibv_open_device(dev.native());
    if (raw == nullptr)
        throw_system_error(errno_or_eio(errno), "ibv_open_device(" + std::string(dev.name()) + ")");
    // ibv_close_device cannot fail in a way the caller could act on (it always returns 0).
    ctx_ = std::shared_ptr<ibv_context>(raw, [](ibv_context* c) {
        detail::forget_context(c); // its guard CQ (mmap_keys.hpp), if any, goes first
        ibv_close_device(c);
    });
}

context::context(std::string_view name) : context(device_list().at(name)) {}

std::string_view context::name() const noexcept {
    const char* n = ibv_get_device_name(ctx_->device);
    return n != nullptr ? std::string_view(n) : std::string_view();
}

ibv_device_attr context::query_device() const {
    ibv_device_attr attr{};
    verb_check(ibv_query_device(ctx_.get(), &attr), "ibv_query_device");
    return attr;
}

std::uint8_t context::port_count() const {
    return query_device().phys_port_cnt;
}

ibv_port_attr context::query_port(std::uint8_t port) const {
    ibv_port_attr attr{};
    const int ret = ibv_query_port(ctx_.get(), port, &attr);
    if (ret != 0)
        throw_system_error(verb_errno(ret), "ibv_query_port(port " + std::to_string(port) + ")");
    return attr;
}

std::optional<std::uint8_t> context::first_active_port() const {
    const std::uint8_t n = port_count();
    for (unsigned p = 1; p <= n; ++p)
        if (query_port(static_cast<std::uint8_t>(p)).state == IBV_PORT_ACTIVE)
            return static_cast<std::uint8_t>(p);
    return std::nullopt;
}

ibv_gid_entry context::query_gid(std::uint8_t port, std::uint32_t index) const {
    ibv_gid_entry entry{};
    const int ret = ibv_query_gid_ex(ctx_.get(), port, index, &entry, 0);
    if (ret != 0)
        throw_system_error(verb_errno(ret), "ibv_query_gid_ex(port " + std::to_string(port) +
                                                ", index " + std::to_string(index) + ")");
    return entry;
}

std::vector<ibv_gid_entry> context::gid_table() const {
    const std::uint8_t ports = port_count();
    std::size_t slots = 0;
    for (unsigned p = 1; p <= ports; ++p)
        slots += static_cast<std::size_t>(query_port(static_cast<std::uint8_t>(p)).gid_tbl_len);
    std::vector<ibv_gid_entry> entries(slots);
    if (slots == 0) return entries;
    // Returns the count, or a negative errno (unlike its sibling ibv_query_gid_ex).
    const ssize_t n = ibv_query_gid_table(ctx_.get(), entries.data(), entries.size(), 0);
    if (n < 0) throw_system_error(static_cast<int>(-n), "ibv_query_gid_table");
    entries.resize(static_cast<std::size_t>(n));
    return entries;
}

std::optional<std::uint32_t> context::find_gid_index(std::uint8_t port, ibv_gid_type type,
                                                     gid_family family) const {
    std::optional<std::uint32_t> best;
    for (const ibv_gid_entry& e : gid_table()) {
        if (e.port_num != port || e.gid_type != static_cast<std::uint32_t>(type)) continue;
        const bool v4 = is_ipv4_mapped(e.gid);
        if ((family == gid_family::ipv4 && !v4) || (family == gid_family::ipv6 && v4)) continue;
        if (!best || e.gid_index < *best) best = e.gid_index;
    }
    return best;
}

} // namespace ringverbs::verbs
