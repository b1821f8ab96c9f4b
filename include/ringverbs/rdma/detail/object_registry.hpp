// object_registry: which ibv_cq / ibv_qp / ibv_srq belong to ringverbs' runtime, so that an async
// event naming one can be routed to its state. An event names the verbs object, whose context
// pointers may be anyone's; this process-wide table (a mutex, used at creation, destruction and
// on async events only) is the one safe way back.
#pragma once

#include <ringverbs/config.hpp>

#include <infiniband/verbs.h>

#include <cstdint>
#include <type_traits>
#include <vector>

namespace ringverbs::detail {

struct cq_state;
struct qp_state;
struct srq_state;

// Throw std::bad_alloc (registration happens in the states' constructors).
void register_object(ibv_cq* cq, cq_state* s);
void register_object(ibv_qp* qp, qp_state* s);
void register_object(ibv_srq* srq, srq_state* s);
void unregister_object(ibv_cq* cq) noexcept;
void unregister_object(ibv_qp* qp) noexcept;
void unregister_object(ibv_srq* srq) noexcept;

// The lock and lookups behind with_object. `generation` receives the number the registration
// was given: unique for the process's lifetime, so that a lookup made later (on another thread,
// after the verbs object may have been destroyed and its address reused) can tell the object it
// meant from a newer one at the same address.
void lock_registry() noexcept;
void unlock_registry() noexcept;
cq_state* find_object(ibv_cq* cq, std::uint64_t& generation) noexcept;
qp_state* find_object(ibv_qp* qp, std::uint64_t& generation) noexcept;
srq_state* find_object(ibv_srq* srq, std::uint64_t& generation) noexcept;

// The registered objects made on one device, with their registration numbers.
template <typename Object, typename State>
struct registered {
    Object* object;
    State* state;
    std::uint64_t generation;
};
struct device_objects {
    std::vector<registered<ibv_qp, qp_state>> qps;
    std::vector<registered<ibv_srq, srq_state>> srqs;
    std::vector<registered<ibv_cq, cq_state>> cqs;
};
// Fills `out` with the objects made on the device called `device_name`, through any
// ibv_context of it (librdmacm's, or one opened by name). Only with the registry locked (the
// states stay alive until it is unlocked). Throws std::bad_alloc.
void objects_on(const char* device_name, device_objects& out);

// Calls fn(state) (or fn(state, generation)) under the registry's lock when `object` (an
// ibv_cq*, ibv_qp* or ibv_srq*) is ours and lives, and returns true; the state cannot be
// destroyed meanwhile. fn must not create or destroy runtime objects.
template <typename Object, typename Fn>
bool with_object(Object* object, Fn&& fn) {
    lock_registry();
    std::uint64_t generation = 0;
    auto* s = find_object(object, generation);
    if (s) {
        if constexpr (std::is_invocable_v<Fn&, decltype(*s), std::uint64_t>)
            fn(*s, generation);
        else
            fn(*s);
    }
    unlock_registry();
    return s != nullptr;
}

// with_object, only when `object` is still the registration numbered `generation`.
template <typename Object, typename Fn>
bool with_object_of(Object* object, std::uint64_t generation, Fn&& fn) {
    lock_registry();
    std::uint64_t now = 0;
    auto* s = find_object(object, now);
    const bool same = s != nullptr && now == generation;
    if (same) fn(*s);
    unlock_registry();
    return same;
}

} // namespace ringverbs::detail
