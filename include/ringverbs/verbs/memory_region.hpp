// A registered memory region (ibv_mr): a buffer the device may access, with the rights granted.
#pragma once

#include <ringverbs/config.hpp>

#include <ringverbs/verbs/access.hpp>
#include <ringverbs/verbs/protection_domain.hpp>

#include <infiniband/verbs.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

namespace ringverbs::verbs {

// RAII, move-only owner of an ibv_mr.
//
// Least privilege: the default right is local_write only (the buffer may receive data and RDMA
// read results, but no peer can touch it). Remote rights are granted only when asked for.
//
// Ownership: the buffer stays the caller's; it must outlive this object, and no work request
// naming the region may still be in flight when it is destroyed. Holds a share of the PD, so the
// PD lives at least as long as the region.
class memory_region {
  public:
    // Registers `buffer` with `rights`. Throws std::system_error naming ibv_reg_mr: EINVAL,
    // before calling the verb, when remote_write or remote_atomic comes without local_write
    // (verbs demand it); EINVAL from the device for an empty buffer; ENOMEM for a device out of
    // MRs or a locked-memory limit (RLIMIT_MEMLOCK; processes with CAP_IPC_LOCK are exempt);
    // EFAULT for memory that cannot be pinned.
    memory_region(const protection_domain& pd, std::span<std::byte> buffer,
                  access rights = access::local_write);

    // Deregisters the region at once (nothing else holds it) and drops the share of the PD.
    ~memory_region() = default;
    // Moving transfers ownership; the moved-from object is empty (operator bool is false) and
    // may only be assigned to or destroyed. Move assignment releases the target's previous share.
    memory_region(memory_region&&) noexcept = default;
    memory_region& operator=(memory_region&&) noexcept = default;
    memory_region(const memory_region&) = delete;
    memory_region& operator=(const memory_region&) = delete;

    // The raw MR (null after a move). Owned by this object: do not deregister.
    [[nodiscard]] ibv_mr* native() const noexcept { return mr_.get(); }
    [[nodiscard]] ibv_mr* get() const noexcept { return mr_.get(); }

    // False only for a moved-from object.
    explicit operator bool() const noexcept { return mr_ != nullptr; }

    // The key local work requests use in their scatter/gather entries.
    [[nodiscard]] std::uint32_t lkey() const noexcept { return mr_->lkey; }

    // The key a peer needs, with the address, for RDMA read/write/atomics into this region.
    [[nodiscard]] std::uint32_t rkey() const noexcept { return mr_->rkey; }

    // The registered buffer.
    [[nodiscard]] std::span<std::byte> bytes() const noexcept { return buffer_; }
    [[nodiscard]] std::byte* data() const noexcept { return buffer_.data(); }
    [[nodiscard]] std::size_t size() const noexcept { return buffer_.size(); }

    // The address a peer targets for RDMA: the buffer's virtual address.
    [[nodiscard]] std::uint64_t remote_addr(std::size_t offset = 0) const noexcept {
        return reinterpret_cast<std::uintptr_t>(buffer_.data()) + offset;
    }

    // The rights granted at registration.
    [[nodiscard]] access rights() const noexcept { return rights_; }

    // A scatter/gather entry for bytes [offset, offset + length) of the region; length defaults
    // to the rest of the region. Throws std::system_error(EINVAL) naming memory_region::sge when
    // the range does not fit in the region or in the 32-bit SGE length.
    [[nodiscard]] ibv_sge sge(std::size_t offset = 0,
                              std::size_t length = static_cast<std::size_t>(-1)) const;

  private:
    std::shared_ptr<ibv_mr> mr_;
    std::span<std::byte> buffer_;
    access rights_ = access::none;
};

} // namespace ringverbs::verbs
