// object_registry: which ibv_cq / ibv_qp / ibv_srq belong to ringverbs' runtime, so that an async
// event naming one can be routed to its state. An event names the verbs object, whose context
// pointers may be anyone's; this process-wide table (a mutex, used at creation, destruction and
// on async events only) is the one safe way back.
#pragma once

#include <ringverbs/config.hpp>

#include <infiniband/verbs.h>

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

// The lock and lookups behind with_object.
void lock_registry() noexcept;
void unlock_registry() noexcept;
cq_state* find_object(ibv_cq* cq) noexcept;
qp_state* find_object(ibv_qp* qp) noexcept;
srq_state* find_object(ibv_srq* srq) noexcept;

// Calls fn(state) under the registry's lock when `object` (an ibv_cq* or ibv_qp*) is ours and
// lives, and returns true; the state cannot be destroyed meanwhile. fn must not create or
// destroy runtime objects.
template <typename Object, typename Fn>
bool with_object(Object* object, Fn&& fn) {
    lock_registry();
    auto* s = find_object(object);
    if (s) fn(*s);
    unlock_registry();
    return s != nullptr;
}

} // namespace ringverbs::detail
