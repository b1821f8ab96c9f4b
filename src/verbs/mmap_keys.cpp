#include <ringverbs/engine/diagnostics.hpp>
#include <ringverbs/verbs/detail/mmap_keys.hpp>
#include <ringverbs/verbs/detail/provider.hpp>

#include <cstring>
#include <mutex>
#include <string>
#include <unordered_map>

namespace ringverbs::verbs::detail {

namespace {

// 32768 entries of 32 bytes plus the control word: 257 pages, past page offset 144.
constexpr int guard_entries = 32768;

struct context_record {
    bool siw = false;
    ibv_cq* guard = nullptr;
    // The device's name, copied while the context was alive: forget_device() must not read
    // the context, which its owner may have closed without telling us (librdmacm closes its
    // context of a removed device when it re-reads its device list, for whichever device
    // asked it to).
    std::string device;
};

std::mutex records_lock;
std::unordered_map<ibv_context*, context_record>& records() {
    static auto* r = new std::unordered_map<ibv_context*, context_record>; // never destroyed
    return *r;
}

} // namespace

void prepare_for_queues(ibv_context* ctx) noexcept {
    std::lock_guard g(records_lock);
    try {
        auto [it, fresh] = records().try_emplace(ctx);
        if (!fresh) return;
        it->second.device = ibv_get_device_name(ctx->device);
        if (!is_siw(ctx)) return;
        it->second.siw = true;
        errno = 0;
        it->second.guard = ibv_create_cq(ctx, guard_entries, nullptr, nullptr, 0);
        if (it->second.guard == nullptr)
            ringverbs::detail::diagnose(
                "%s: no guard CQ against libsiw's mmap key collision (ibv_create_cq of %d "
                "entries: errno %d): a create whose queue starts at page offset 144 of this "
                "context will fail",
                ibv_get_device_name(ctx->device), guard_entries, errno);
    } catch (...) {
        // Out of memory for the record: the creates go on unguarded.
    }
}

void forget_context(ibv_context* ctx) noexcept {
    std::lock_guard g(records_lock);
    auto it = records().find(ctx);
    if (it == records().end()) return;
    if (it->second.guard) ibv_destroy_cq(it->second.guard);
    records().erase(it);
}

void forget_device(const char* device_name) noexcept {
    std::lock_guard g(records_lock);
    for (auto it = records().begin(); it != records().end();) {
        // By the name kept in the record, not it->first->device->name: the contexts of other
        // devices may be closed already (see forget_missing_devices).
        if (it->second.device != device_name) {
            ++it;
            continue;
        }
        if (it->second.guard) ibv_destroy_cq(it->second.guard);
        it = records().erase(it);
    }
}

void forget_missing_devices() noexcept {
    int n = 0;
    ibv_device** list = ibv_get_device_list(&n);
    if (list == nullptr) return; // cannot tell which are gone: nothing is dropped
    std::lock_guard g(records_lock);
    for (auto it = records().begin(); it != records().end();) {
        bool present = false;
        for (int i = 0; i < n && !present; ++i)
            present = it->second.device == ibv_get_device_name(list[i]);
        if (present) {
            ++it;
            continue;
        }
        if (it->second.guard) ibv_destroy_cq(it->second.guard); // its context is still open
        it = records().erase(it);
    }
    ibv_free_device_list(list);
}

std::string create_failure_note(ibv_context* ctx, int saved_errno) {
    if (saved_errno != 0) return {};
    std::lock_guard g(records_lock);
    auto it = records().find(ctx);
    if (it == records().end() || !it->second.siw) return {};
    return it->second.guard
               ? " (libsiw returned no object and errno 0)"
               : " (libsiw returned no object and errno 0: its mmap key collided with "
                 "SIW_INVAL_UOBJ_KEY, page offset 144 of this context, a libsiw bug; objects "
                 "made on this context before ringverbs' first one defeat its guard)";
}

} // namespace ringverbs::verbs::detail
