// recv_ring: keeps a qp's receive queue stocked with receives into slots of one registered
// buffer, and hands the messages out in the order they arrived.
#pragma once

#include <ringverbs/config.hpp>

#include <ringverbs/engine/detail/waiter.hpp>
#include <ringverbs/engine/error.hpp>
#include <ringverbs/engine/io_context.hpp>
#include <ringverbs/rdma/detail/rdma_state.hpp>
#include <ringverbs/rdma/qp.hpp>
#include <ringverbs/verbs/memory_region.hpp>
#include <ringverbs/verbs/protection_domain.hpp>

#include <infiniband/verbs.h>

#include <coroutine>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>

namespace ringverbs {

namespace detail {

class recv_ring_waiter;

// What the ring and the qp share. The qp's state owns it (so that every slot, whose address
// is its receive's wr_id, outlives the receive's completion); the ring handle holds both.
struct recv_ring_state {
    struct slot : wr_op {
        recv_ring_state* owner = nullptr;
        ibv_recv_wr wr{};
        ibv_sge sge{};
        ibv_wc wc{};
        std::uint32_t length = 0; // the bytes in the slot: wc.byte_len for a RECV, 0 for a
                                  // WRITE WITH IMMEDIATE (its bytes went elsewhere)
        bool posted = false;      // owed a completion
        bool done = false;        // its completion came (wc), not handed out yet
        bool closed = false;      // a flush after the connection ended
        bool violation = false;   // a success the slot cannot hold (length, opcode)
        bool failed() const noexcept { return wc.status != IBV_WC_SUCCESS || violation; }
    };

    qp_state* qp = nullptr;
    io_context* ctx = nullptr;
    std::unique_ptr<std::byte[]> memory;
    std::optional<verbs::memory_region> mr;
    std::unique_ptr<slot[]> slots;
    std::uint32_t count = 0;
    std::uint32_t size = 0;
    std::uint32_t head = 0; // the next slot to hand out
    std::uint32_t held = 0; // the slot handed out last, reposted by the next next()
    bool holding = false;
    bool orphaned = false; // the ring handle is gone
    waiter_queue waiters;  // of recv_ring_waiter
    // The waiter given a message and readied, not resumed yet: its bytes are in a slot, so
    // ~recv_ring (another coroutine of the same loop turn) must end it instead of freeing them
    // under it.
    recv_ring_waiter* handed = nullptr;

    // Posts slot i (ibv_post_recv). Throws std::system_error naming it.
    void post(std::uint32_t i);
    // Before a next(): refuses a second consumer (EBUSY), then reposts the slot handed out
    // last, if any, unless a failure waits at the head.
    void repost_held();
    bool owed() const noexcept; // a slot is posted
    // Gives the head slot's outcome to `w` when it is done: true.
    bool hand_out(recv_ring_waiter& w) noexcept;
    static void completed(wr_op* op, const ibv_wc& wc, bool last) noexcept;
};

// A next() waiter: the ring writes the outcome here before fulfilling it, so the awaiter does
// not read the ring after resuming.
class recv_ring_waiter : public waiter {
  public:
    ibv_wc wc{};
    std::byte* data = nullptr;
    std::uint32_t length = 0;
    std::uint32_t slot_size = 0;
    bool closed = false;
    bool violation = false;
    bool handed = false;    // recv_ring_state::handed is this waiter
    bool abandoned = false; // the ring was destroyed between its fulfilment and its resumption
    bool stopped = false;   // its stop_token was requested before it waited
};

} // namespace detail

// Keeps `count` receives posted on a qp, each into its own `size`-byte slot of one buffer the
// ring allocates and registers once; co_await ring.next() gives the next message in arrival
// order. No allocation after construction: a slot is posted again when the next next() is
// called, so a message's bytes stay valid (and its slot out of the receive queue: count - 1
// receives posted) until then.
//
//   recv_ring ring(q, pd, 16, 4096);          // before connecting: the peer's first send finds
//   for (;;) {                                // a receive posted
//       recv_ring::message m = co_await ring.next();
//       use(m.data);                          // m.wc: byte_len, imm_data, wc_flags
//   }
//
// A failed receive throws from next() as a qp await does: connection_reset when the
// connection ended, completion_error otherwise (IBV_WC_WR_FLUSH_ERR after the QP's error),
// and so does every next() after it (the ring is then spent). A timeout or stop of next()
// only ends that wait: the receives stay posted, the ring stays usable.
//
// What the peer controls is checked before it is handed out: a message's data never reaches
// past its slot. A SEND lands in the slot (data: wc.byte_len bytes). An RDMA WRITE WITH
// IMMEDIATE consumes a slot but writes elsewhere (a remote-writable region the peer chose):
// its message has empty data, m.wc.imm_data its immediate, and m.wc.byte_len the length the
// peer wrote there (not bytes of the slot). A completion the slot cannot hold (a length above
// slot_size(), an opcode that is no receive) is a protocol violation: the QP goes to the error
// state and next() throws std::system_error(EPROTO) naming recv_ring::next, the length and the
// opcode, as does every next() after it.
//
// One consumer: a next() while another waits throws EBUSY (the ring hands out one message at a
// time, and posts it again at the following next()). One ring per qp (not on an srq's qp),
// made before anything else posts receives on it if the order matters. Lifetime: the ring
// keeps the qp's state; destroying the ring while receives are still posted moves the QP to
// the error state (a posted receive cannot be recalled otherwise) and its slots live on until
// their flushes came. A message's bytes are the ring's: gone with it. Destroy on the
// io_context's thread, before it.
class recv_ring {
  public:
    struct message {
        // The bytes received, in the slot (at most slot_size(); empty for a WRITE WITH
        // IMMEDIATE, whose bytes went to the region the peer wrote).
        std::span<std::byte> data;
        ibv_wc wc; // as the device reported it (opcode, imm_data, wc_flags, byte_len)
    };
    class next_awaitable;

    // Allocates count * size bytes, registers them on `pd` (local write) and posts `count`
    // receives. Throws std::system_error: EINVAL (count 0, count > the qp's receive capacity,
    // the qp receives from an srq), EBUSY (the qp has a ring), naming ibv_reg_mr or
    // ibv_post_recv.
    recv_ring(qp& q, const verbs::protection_domain& pd, std::uint32_t count, std::uint32_t size);
    ~recv_ring();
    recv_ring(const recv_ring&) = delete;
    recv_ring& operator=(const recv_ring&) = delete;

    // co_await ring.next(): the next message. Posts the slot of the previous one again first
    // (throws naming ibv_post_recv if that fails; tried again by the next next()). Errors: as
    // above; std::system_error "recv_ring::next" with timed_out / operation_canceled per `w`
    // (a stop requested before the co_await ends it at once, even with messages ready: they
    // stay in the ring), operation_canceled when the ring is destroyed while awaited (also
    // when its message was ready but the coroutine not resumed yet: the bytes went with the
    // ring), EBUSY when another next() is waiting.
    next_awaitable next(wait_options w = {}) noexcept;

    std::uint32_t count() const noexcept { return state_->count; }
    std::uint32_t slot_size() const noexcept { return state_->size; }
    // Messages received and not handed out yet.
    std::uint32_t ready() const noexcept;

  private:
    std::shared_ptr<detail::qp_state> qp_;
    std::shared_ptr<detail::recv_ring_state> state_;
};

// recv_ring::next_awaitable: returned by next(); co_await gives a recv_ring::message (throws as
// next() says). Awaited in place, not moved.
class recv_ring::next_awaitable : detail::recv_ring_waiter {
  public:
    next_awaitable(const next_awaitable&) = delete;
    next_awaitable& operator=(const next_awaitable&) = delete;
    ~next_awaitable() {
        // Destroyed while readied but never resumed (its frame destroyed): the ring forgets it.
        if (handed && !abandoned) state_->handed = nullptr;
    }
    bool await_ready() {
        state_->repost_held();
        if (options_.stop.stop_requested()) {
            stopped = true; // a requested stop wins over ready messages: they stay in the ring
            return true;
        }
        return state_->hand_out(*this);
    }
    void await_suspend(std::coroutine_handle<> h) {
        wait_in(state_->waiters, *state_->ctx, options_, h);
    }
    message await_resume();

  private:
    friend class recv_ring;
    next_awaitable(detail::recv_ring_state* s, wait_options w) noexcept
        : state_(s), options_(std::move(w)) {}
    detail::recv_ring_state* state_;
    wait_options options_;
};

inline recv_ring::next_awaitable recv_ring::next(wait_options w) noexcept {
    return {state_.get(), std::move(w)};
}

} // namespace ringverbs
