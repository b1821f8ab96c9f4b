#include <ringverbs/verbs/protection_domain.hpp>
#include <ringverbs/verbs/verb_error.hpp>

namespace ringverbs::verbs {

protection_domain::protection_domain(const context& ctx) {
    errno = 0;
    ibv_pd* raw = ibv_alloc_pd(ctx.native());
    if (raw == nullptr) throw_system_error(errno_or_eio(errno), "ibv_alloc_pd");
    // The deleter's copy of the context handle is what keeps the device open until the PD is
    // gone. ibv_dealloc_pd can only fail with EBUSY for children made behind ringverbs' back
    // (raw verbs on native()); a destructor cannot report that, so the PD is leaked then.
    pd_ = std::shared_ptr<ibv_pd>(raw, [keep = ctx.handle()](ibv_pd* p) { ibv_dealloc_pd(p); });
}

} // namespace ringverbs::verbs
