// A completion queue (ibv_cq): where the device reports finished work requests.
#pragma once

#include <ringverbs/config.hpp>

#include <ringverbs/verbs/completion_channel.hpp>
#include <ringverbs/verbs/context.hpp>
#include <ringverbs/verbs/verb_error.hpp>

#include <infiniband/verbs.h>

#include <atomic>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>

namespace ringverbs::verbs {

namespace detail {

// What a completion_queue owns, at a stable address: ibv_cq::cq_context points here so that a
// completion_channel can count events against the right CQ without knowing its wrapper (which
// may move). The destructor acks whatever is still unacked, then destroys the CQ.
struct owned_cq {
    ibv_cq* cq = nullptr;
    // Events handed out by completion_channel::get_event() and not yet acked. ibv_destroy_cq
    // blocks until every event it reported has been acked, so this must reach 0 before it runs.
    std::atomic<std::uint32_t> unacked{0};
    void* user_context = nullptr;
    int comp_vector = 0;
    std::shared_ptr<ibv_context> ctx;
    std::shared_ptr<ibv_comp_channel> channel;

    owned_cq() = default;
    owned_cq(const owned_cq&) = delete;
    owned_cq& operator=(const owned_cq&) = delete;
    ~owned_cq();
};

// completion_channel::take_event, inline for the runtime's read path.
inline cq_event take_cq_event(std::uint64_t cq_handle) noexcept {
    // The kernel hands back the pointer libibverbs gave as the CQ's handle at creation.
    auto* cq = reinterpret_cast<ibv_cq*>(static_cast<std::uintptr_t>(cq_handle));
    // The provider's cq_event op, which ibv_get_cq_event calls and which has no public entry
    // point: verbs_set_ops() copies it into the ABI-compatibility slot _compat_cq_event (a
    // no-op for providers without one, never null). Declared there as void *(*)(void); it is
    // the provider's void (*)(struct ibv_cq *). The cast goes through void (*)(void), the
    // type that converts to any other without a warning.
    using cq_event_fn = void (*)(ibv_cq*);
    if (auto* op = cq->context->ops._compat_cq_event; op != nullptr)
        reinterpret_cast<cq_event_fn>(reinterpret_cast<void (*)()>(op))(cq);
    auto* state = static_cast<owned_cq*>(cq->cq_context);
    state->unacked.fetch_add(1, std::memory_order_relaxed);
    return cq_event{cq, state->user_context};
}

// Out-of-line throw for a negative ibv_poll_cq result.
[[noreturn]] void throw_poll_error(int ret);

} // namespace detail

// RAII, move-only owner of an ibv_cq.
//
// Ownership: holds a share of its context and of its completion_channel (if any); queue pairs
// using it hold a share of it, so the CQ is destroyed only after its last QP.
//
// Events: each event taken from the channel with completion_channel::get_event() must be acked
// with ack_events() (batching is fine: acking takes a mutex in libibverbs). The owner should ack
// everything before letting go; as a safety net the destructor acks what is still counted, since
// ibv_destroy_cq would otherwise wait forever. Events read with raw ibv_get_cq_event are not
// counted and must be acked raw.
//
// Not thread-safe beyond what verbs guarantee: poll() and req_notify() from one thread at a time.
class completion_queue {
  public:
    // Creates a CQ with room for at least `entries` completions (the device may round up: see
    // capacity()). With a channel, events go there once armed with req_notify(); comp_vector
    // (0 .. ctx.num_comp_vectors() - 1) picks the interrupt vector. user_context is returned in
    // every cq_event of this CQ and is not owned.
    // Throws std::system_error naming ibv_create_cq with entries and comp_vector: EINVAL, before
    // calling the verb, for a comp_vector out of range; EINVAL for more entries than max_cqe;
    // ENOMEM when the device is out of CQs.
    completion_queue(const context& ctx, int entries, const completion_channel* channel = nullptr,
                     int comp_vector = 0, void* user_context = nullptr);

    // Drops this object's share; the object itself goes when its last holder does.
    ~completion_queue() = default;
    // Moving transfers ownership; the moved-from object is empty (operator bool is false) and
    // may only be assigned to or destroyed. Move assignment releases the target's previous share.
    completion_queue(completion_queue&&) noexcept = default;
    completion_queue& operator=(completion_queue&&) noexcept = default;
    completion_queue(const completion_queue&) = delete;
    completion_queue& operator=(const completion_queue&) = delete;

    // The raw CQ (null after a move). Owned by this object and its QPs: do not destroy, and do not
    // change its cq_context (ringverbs' bookkeeping lives there).
    [[nodiscard]] ibv_cq* native() const noexcept { return state_ ? state_->cq : nullptr; }
    [[nodiscard]] ibv_cq* get() const noexcept { return native(); }

    // A share of the raw CQ that keeps it (and its channel and context) alive.
    [[nodiscard]] std::shared_ptr<ibv_cq> handle() const noexcept {
        return state_ ? std::shared_ptr<ibv_cq>(state_, state_->cq) : nullptr;
    }

    // False only for a moved-from object.
    explicit operator bool() const noexcept { return state_ != nullptr; }

    // The number of completions the CQ actually holds (>= the entries asked for).
    [[nodiscard]] int capacity() const noexcept { return state_->cq->cqe; }

    // The completion vector given at creation.
    [[nodiscard]] int comp_vector() const noexcept { return state_->comp_vector; }

    // The user_context given at creation (or set since), returned with each of its events.
    [[nodiscard]] void* user_context() const noexcept { return state_->user_context; }
    // Replaces it: for an owner that goes while the CQ lives on (shared by a QP or a
    // handle()), so that a later event does not lead to it. Not thread-safe against an
    // event read on another thread.
    void set_user_context(void* user_context) noexcept { state_->user_context = user_context; }

    // Moves up to out.size() completions into `out`; returns how many (0 when empty). Throws
    // std::system_error(EIO) naming ibv_poll_cq when the provider reports a failure (it gives
    // no errno).
    std::size_t poll(std::span<ibv_wc> out) {
        const int want = out.size() > INT_MAX ? INT_MAX : static_cast<int>(out.size());
        const int n = ibv_poll_cq(state_->cq, want, out.data());
        if (n < 0) [[unlikely]]
            detail::throw_poll_error(n);
        return static_cast<std::size_t>(n);
    }

    // Arms the CQ: the next completion (only solicited ones, if solicited_only) produces one event
    // on the channel. Completions that arrived before arming produce none, so poll once more
    // after arming. Throws std::system_error naming ibv_req_notify_cq.
    void req_notify(bool solicited_only = false) {
        verb_check(ibv_req_notify_cq(state_->cq, solicited_only ? 1 : 0), "ibv_req_notify_cq");
    }

    // Acks n events obtained through completion_channel::get_event() for this CQ. Throws
    // std::system_error(EINVAL) naming ibv_ack_cq_events when n exceeds unacked_events():
    // acking more than was reported would make ibv_destroy_cq wait forever.
    void ack_events(std::uint32_t n);

    // Events handed out for this CQ and not yet acked.
    [[nodiscard]] std::uint32_t unacked_events() const noexcept {
        return state_->unacked.load(std::memory_order_relaxed);
    }

  private:
    std::shared_ptr<detail::owned_cq> state_;
};

} // namespace ringverbs::verbs
