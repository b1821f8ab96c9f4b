// An open device (ibv_context): the root every other verbs object hangs from.
#pragma once

#include <ringverbs/config.hpp>

#include <ringverbs/verbs/device.hpp>

#include <infiniband/verbs.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace ringverbs::verbs {

// Which address a RoCE GID carries; RoCE v2 over IPv4 uses IPv4-mapped IPv6 GIDs (::ffff:a.b.c.d).
enum class gid_family { any, ipv4, ipv6 };

// True for an IPv4-mapped GID (::ffff:a.b.c.d), which is how RoCE v2 names an IPv4 address.
[[nodiscard]] bool is_ipv4_mapped(const ibv_gid& gid) noexcept;

// The GID in IPv6 text form ("::ffff:198.18.0.1", "fe80::1").
[[nodiscard]] std::string to_string(const ibv_gid& gid);

// RAII, move-only owner of an ibv_context.
//
// Ownership: every object created from a context (protection_domain, completion_channel,
// completion_queue, and through them memory_region and queue_pair) holds a share of it, so the
// device is closed only when the context object *and* all of those are gone. Destroying the
// context object first is therefore allowed and closes nothing early.
//
// Async events: libibverbs' ibv_destroy_cq/ibv_destroy_qp wait until every async event read
// with ibv_get_async_event on native()->async_fd has been acked with ibv_ack_async_event; anyone
// reading that fd must ack what they read before dropping the objects it names.
class context {
  public:
    // Opens `dev`. Throws std::system_error naming ibv_open_device and the device (EMFILE when
    // out of descriptors: opening takes two fds, the command fd and the async event fd).
    explicit context(device dev);

    // Lists the devices and opens the one called `name`. Throws std::system_error(ENODEV) naming
    // the device when no device has that name, or any error of device_list() or context(device).
    explicit context(std::string_view name);

    // Shares a context opened by someone else, e.g. librdmacm's (rdma_create_qp requires the PD
    // of the cm id's own ibv_context). `shared`'s deleter decides what closing means: for
    // librdmacm it releases rdma_get_devices(), never ibv_close_device.
    explicit context(std::shared_ptr<ibv_context> shared) noexcept : ctx_(std::move(shared)) {}

    // Drops this object's share; the object itself goes when its last holder does.
    ~context() = default;
    // Moving transfers ownership; the moved-from object is empty (operator bool is false) and
    // may only be assigned to or destroyed. Move assignment releases the target's previous share.
    context(context&&) noexcept = default;
    context& operator=(context&&) noexcept = default;
    context(const context&) = delete;
    context& operator=(const context&) = delete;

    // The raw context (null after a move). Owned by this object and its children: do not close.
    [[nodiscard]] ibv_context* native() const noexcept { return ctx_.get(); }
    [[nodiscard]] ibv_context* get() const noexcept { return ctx_.get(); }

    // A share of the raw context that keeps it open (what children hold).
    [[nodiscard]] const std::shared_ptr<ibv_context>& handle() const noexcept { return ctx_; }

    // False only for a moved-from object.
    explicit operator bool() const noexcept { return ctx_ != nullptr; }

    // The device name, e.g. "rxe0".
    [[nodiscard]] std::string_view name() const noexcept;

    // How many completion vectors (interrupt queues) a completion_queue may pick from:
    // valid vectors are 0 .. num_comp_vectors() - 1.
    [[nodiscard]] int num_comp_vectors() const noexcept { return ctx_->num_comp_vectors; }

    // Device limits (max_qp_wr, max_cqe, max_qp_rd_atom, phys_port_cnt, ...). Throws
    // std::system_error naming ibv_query_device.
    [[nodiscard]] ibv_device_attr query_device() const;

    // Number of physical ports; ports are numbered 1 .. port_count(). Throws as query_device().
    [[nodiscard]] std::uint8_t port_count() const;

    // State, MTUs, link layer, GID table size of one port. Throws std::system_error naming
    // ibv_query_port and the port (EINVAL for a port that does not exist).
    [[nodiscard]] ibv_port_attr query_port(std::uint8_t port) const;

    // The lowest-numbered port in IBV_PORT_ACTIVE state, or nullopt. Throws as query_port().
    [[nodiscard]] std::optional<std::uint8_t> first_active_port() const;

    // One GID table entry with its type (IB, RoCE v1, RoCE v2) and netdev. Throws
    // std::system_error naming ibv_query_gid_ex, the port and the index: ENODATA for an empty
    // slot, EINVAL for an index past the table.
    [[nodiscard]] ibv_gid_entry query_gid(std::uint8_t port, std::uint32_t index) const;

    // Every populated GID entry of every port. Throws std::system_error naming
    // ibv_query_gid_table.
    [[nodiscard]] std::vector<ibv_gid_entry> gid_table() const;

    // The lowest GID index on `port` whose type is `type` and whose address is of `family`, or
    // nullopt. With RoCE v2 and ipv4 this finds the GID that routes over the port's IPv4 address.
    // Throws as gid_table().
    [[nodiscard]] std::optional<std::uint32_t>
    find_gid_index(std::uint8_t port, ibv_gid_type type = IBV_GID_TYPE_ROCE_V2,
                   gid_family family = gid_family::ipv4) const;

  private:
    std::shared_ptr<ibv_context> ctx_;
};

} // namespace ringverbs::verbs
