// A protection domain (ibv_pd): the scope within which memory regions and queue pairs may be
// used together.
#pragma once

#include <ringverbs/config.hpp>

#include <ringverbs/verbs/context.hpp>

#include <infiniband/verbs.h>

#include <memory>

namespace ringverbs::verbs {

// RAII, move-only owner of an ibv_pd.
//
// Ownership: holds a share of its context; memory regions and queue pairs created in it hold a
// share of it. The PD is deallocated when this object and all of them are gone, so destroying
// the protection_domain object before its MRs and QPs is allowed (verbs alone would refuse with
// EBUSY and leak it).
class protection_domain {
  public:
    // Allocates a PD. Throws std::system_error naming ibv_alloc_pd (ENOMEM when the device is
    // out of PDs).
    explicit protection_domain(const context& ctx);

    // Drops this object's share; the object itself goes when its last holder does.
    ~protection_domain() = default;
    // Moving transfers ownership; the moved-from object is empty (operator bool is false) and
    // may only be assigned to or destroyed. Move assignment releases the target's previous share.
    protection_domain(protection_domain&&) noexcept = default;
    protection_domain& operator=(protection_domain&&) noexcept = default;
    protection_domain(const protection_domain&) = delete;
    protection_domain& operator=(const protection_domain&) = delete;

    // The raw PD (null after a move). Owned by this object and its children: do not deallocate.
    [[nodiscard]] ibv_pd* native() const noexcept { return pd_.get(); }
    [[nodiscard]] ibv_pd* get() const noexcept { return pd_.get(); }

    // A share of the raw PD that keeps it (and its context) alive.
    [[nodiscard]] const std::shared_ptr<ibv_pd>& handle() const noexcept { return pd_; }

    // False only for a moved-from object.
    explicit operator bool() const noexcept { return pd_ != nullptr; }

  private:
    std::shared_ptr<ibv_pd> pd_;
};

} // namespace ringverbs::verbs
