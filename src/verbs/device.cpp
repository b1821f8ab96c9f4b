#include <ringverbs/verbs/device.hpp>
#include <ringverbs/verbs/verb_error.hpp>

#include <endian.h>

#include <string>
#include <utility>

namespace ringverbs::verbs {

std::string_view device::name() const noexcept {
    const char* n = ibv_get_device_name(dev_);
    return n != nullptr ? std::string_view(n) : std::string_view();
}

std::uint64_t device::guid() const noexcept {
    return be64toh(ibv_get_device_guid(dev_));
}

device_list::device_list() {
    int n = 0;
    errno = 0;
    list_ = ibv_get_device_list(&n);
    if (list_ == nullptr) throw_system_error(errno_or_eio(errno), "ibv_get_device_list");
    size_ = static_cast<std::size_t>(n);
}

device_list::~device_list() {
    if (list_ != nullptr) ibv_free_device_list(list_);
}

device_list::device_list(device_list&& other) noexcept
    : list_(std::exchange(other.list_, nullptr)), size_(std::exchange(other.size_, 0)) {}

device_list& device_list::operator=(device_list&& other) noexcept {
    if (this != &other) {
        if (list_ != nullptr) ibv_free_device_list(list_);
        list_ = std::exchange(other.list_, nullptr);
        size_ = std::exchange(other.size_, 0);
    }
    return *this;
}

std::optional<device> device_list::find(std::string_view name) const noexcept {
    for (device d : *this)
        if (d.name() == name) return d;
    return std::nullopt;
}

device device_list::at(std::string_view name) const {
    if (auto d = find(name)) return *d;
    throw_system_error(ENODEV,
                       "ibv_open_device(" + std::string(name) + "): no RDMA device of that name");
}

} // namespace ringverbs::verbs
