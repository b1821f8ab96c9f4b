// The devices libibverbs can see. Listing is the only way to get an ibv_device*, which is what
// ibv_open_device needs; context.hpp opens one.
#pragma once

#include <ringverbs/config.hpp>

#include <infiniband/verbs.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string_view>

namespace ringverbs::verbs {

// A non-owning view of one ibv_device. Valid only while the device_list it came from is alive
// (rdma-core frees unopened devices with the list); a context opened from it stays valid after.
class device {
  public:
    // Wraps a raw device pointer (not null). Ownership stays with the list.
    explicit device(ibv_device* dev) noexcept : dev_(dev) {}

    // The kernel name, e.g. "rxe0" or "mlx5_0".
    [[nodiscard]] std::string_view name() const noexcept;

    // The node GUID in host byte order (0 if the provider cannot tell).
    [[nodiscard]] std::uint64_t guid() const noexcept;

    // The raw device, owned by the list.
    [[nodiscard]] ibv_device* native() const noexcept { return dev_; }

  private:
    ibv_device* dev_;
};

// RAII owner of ibv_get_device_list's array. Move-only.
class device_list {
  public:
    // Lists the devices. Throws std::system_error naming ibv_get_device_list when the listing
    // fails: ENOSYS means this kernel has no RDMA support at all (no uverbs), EPERM a sandbox.
    // A kernel with RDMA support but no device yields an empty list, not an error.
    device_list();
    // Frees the array; contexts opened from its devices stay valid.
    ~device_list();
    // Moving transfers the array; the source becomes an empty list.
    device_list(device_list&& other) noexcept;
    device_list& operator=(device_list&& other) noexcept;
    device_list(const device_list&) = delete;
    device_list& operator=(const device_list&) = delete;

    // Number of devices.
    [[nodiscard]] std::size_t size() const noexcept { return size_; }
    // True when libibverbs sees no device (or after a move).
    [[nodiscard]] bool empty() const noexcept { return size_ == 0; }

    // The i-th device, i < size(). No bounds check.
    [[nodiscard]] device operator[](std::size_t i) const noexcept { return device(list_[i]); }

    // The device called `name`, or nullopt.
    [[nodiscard]] std::optional<device> find(std::string_view name) const noexcept;

    // The device called `name`. Throws std::system_error(ENODEV) naming the device when absent.
    [[nodiscard]] device at(std::string_view name) const;

    // Iteration over the devices, in the order libibverbs reports them. A forward iterator over
    // the array; it yields device views by value.
    class iterator {
      public:
        using value_type = device;
        using difference_type = std::ptrdiff_t;
        iterator() = default;
        explicit iterator(ibv_device* const* p) noexcept : p_(p) {}
        device operator*() const noexcept { return device(*p_); }
        iterator& operator++() noexcept {
            ++p_;
            return *this;
        }
        iterator operator++(int) noexcept {
            auto old = *this;
            ++p_;
            return old;
        }
        bool operator==(const iterator&) const = default;

      private:
        ibv_device* const* p_ = nullptr;
    };
    // The first device / one past the last.
    [[nodiscard]] iterator begin() const noexcept { return iterator(list_); }
    [[nodiscard]] iterator end() const noexcept { return iterator(list_ + size_); }

    // The raw NULL-terminated array, owned by this object.
    [[nodiscard]] ibv_device** native() const noexcept { return list_; }

  private:
    ibv_device** list_ = nullptr;
    std::size_t size_ = 0;
};

} // namespace ringverbs::verbs
