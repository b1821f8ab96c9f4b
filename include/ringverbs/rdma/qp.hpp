// qp: an RC queue pair whose work requests coroutines post and co_await, each resumed by its
// own request's completion.
#pragma once

#include <ringverbs/config.hpp>

#include <ringverbs/engine/detail/io_awaiter.hpp>
#include <ringverbs/engine/detail/stop_gate.hpp>
#include <ringverbs/engine/io_context.hpp>
#include <ringverbs/rdma/buffers.hpp>
#include <ringverbs/rdma/completion_error.hpp>
#include <ringverbs/rdma/cq.hpp>
#include <ringverbs/rdma/detail/rdma_state.hpp>
#include <ringverbs/verbs/memory_region.hpp>
#include <ringverbs/verbs/protection_domain.hpp>
#include <ringverbs/verbs/queue_pair.hpp>

#include <endian.h>
#include <infiniband/verbs.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <optional>
#include <span>

namespace ringverbs {

class srq;

struct send_options {
    std::optional<std::uint32_t> imm = {}; // immediate data (SEND_WITH_IMM / WRITE_WITH_IMM)
    bool inline_data = false;              // IBV_SEND_INLINE (size <= the QP's max_inline_data)
    bool solicited = false;                // IBV_SEND_SOLICITED: wakes a solicited_only CQ
    bool fence = false;                    // IBV_SEND_FENCE
    // false: selective signaling for one send or write. The request is posted without
    // IBV_SEND_SIGNALED and its await ends right after ibv_post_send, without waiting for a
    // completion (none comes unless it fails); it gives a made-up ibv_wc: status
    // IBV_WC_SUCCESS, the opcode (IBV_WC_SEND or IBV_WC_RDMA_WRITE), qp_num, wr_id 0.
    // - Buffers: with inline_data the bytes were copied by the post and the buffer is free at
    //   once. Otherwise the device may still read it: leave it untouched until a LATER
    //   signaled request on the same qp has completed (any awaited send, write, read or
    //   atomic posted after it), or until the qp is destroyed.
    // - Send queue: a slot is freed only by the completion of a later signaled request, so
    //   the qp posts one in every qp::signal_interval() unsignaled requests signaled all the
    //   same and consumes its completion itself (qp::pending() counts it, teardown waits for
    //   it). If two of those are still unconfirmed when the next is due, that request is
    //   posted signaled and its await waits for its completion like any other (back
    //   pressure: a loop of unsignaled sends cannot overrun the send queue).
    // - Errors: a post failure throws as usual. A failure found later (the request's error
    //   completion) cannot reach the await, which is over: the QP is then in the error state,
    //   so every later await on it fails with the flush, and qp::counters() /
    //   qp::unsignaled_failure() tell what happened.
    // Only for send and write; stop_token and timeout have nothing to cancel once posted.
    bool signaled = true;
};

struct qp_options {
    // The bounded flush. When the QP is in the error state (a timeout or stop of one of its
    // awaits, qp::to_error(), an async error event, ~qp) and some of its requests are still
    // owed a completion this long after, the device is taken not to deliver their flushes
    // (Linux 6.1's rxe loses some; a CQ overrun loses them): the QP is moved to RESET, its
    // CQs are polled once more, and each remaining await resumes with
    // std::system_error(errc::io_error) "... never flushed by the device" (or with its own
    // timed_out / operation_canceled when that is what moved the QP to error). Their buffers
    // are then free: no completion can come after RESET (siw ignores RESET, but processes
    // nothing in the error state). Connect the QP again to reuse it.
    std::chrono::milliseconds flush_timeout = std::chrono::seconds(5);
    // The QPs on one CQ may together have more requests outstanding than the CQ has entries
    // (send queue capacity on the send CQ, receive queue capacity on the receive CQ): a QP
    // error flushes all of them at once and overruns it (IBV_EVENT_CQ_ERR, completions lost).
    // By default making such a qp throws EINVAL naming both numbers; true allows it.
    bool allow_cq_overcommit = false;
    // Receives from this shared receive queue (srq.hpp) instead of its own receive queue: the
    // qp's recv() and post_recv() then fail with EINVAL. The srq lives while the qp does. It
    // must belong to the io_context of the qp's send and receive CQs (else EINVAL): one loop
    // serves them all (the srq's receives complete on the receive CQ).
    srq* shared_receive_queue = nullptr;
};

namespace detail {

// What to post, as the qp's calls describe it; the awaiter builds the verbs request from it.
struct wr_request {
    ibv_wr_opcode opcode = IBV_WR_SEND;
    local_buffer local;
    unsigned send_flags = 0;
    std::optional<std::uint32_t> imm;
    remote_buffer remote;
    std::uint64_t compare_add = 0;
    std::uint64_t swap = 0;
    ibv_send_wr* send_chain = nullptr; // a user's chain instead of one request
    ibv_recv_wr* recv_chain = nullptr;
    std::span<ibv_wc> each;
    bool signaled = true; // send_options::signaled
};

} // namespace detail

// Owns an RC queue pair whose send and receive completions go to two cqs (which may be the
// same). Connect it with the verbs-level calls on native_qp() (to_init/to_rtr/to_rts) or
// verbs::connect_loopback, then post and co_await:
//
//   ibv_wc wc = co_await q.send(local_buffer(mr, bytes));
//
// Every posted request completes exactly once, to the coroutine that posted it (an
// unsignaled send or write, send_options::signaled = false, completes when posted). A failed
// completion throws completion_error (its ibv_wc_status and ibv_wc_status_str). After a QP
// error every pending await resumes with its flush status; none is left hanging.
//
// Lifetime: destroying the qp never blocks. With requests still owed, it moves the QP to the
// error state and its state lives on, served by the io_context, until every pending await got
// its flush completion (or, after qp_options::flush_timeout, the QP is reset and the rest end
// as never flushed); then the QP is destroyed. No buffer is written after its awaiter
// resumed. Destroy before the io_context, on its thread.
class qp {
  public:
    class request;
    class close_awaitable;

    // Throws std::system_error naming ibv_create_qp, or EINVAL when the CQs would be
    // overcommitted (see qp_options::allow_cq_overcommit), or when send_cq and recv_cq (or
    // the srq) belong to two io_contexts: a QP is served by one loop, one thread.
    qp(const verbs::protection_domain& pd, cq& send_cq, cq& recv_cq,
       const verbs::qp_caps& caps = {}, qp_options options = {});
    // Adopts an RC QP created elsewhere on these CQs (its send_cq and recv_cq are
    // send_cq.native() and recv_cq.native(), else EINVAL), e.g. by rdma_create_qp:
    // cm_id::make_qp (<ringverbs/cm/cm_id.hpp>) is the way in for a connection. `adopted`'s
    // deleter destroys it once nothing is owed. Throws as the constructor above, but for
    // ibv_create_qp.
    qp(verbs::queue_pair adopted, cq& send_cq, cq& recv_cq, qp_options options = {});
    ~qp();
    qp(const qp&) = delete;
    qp& operator=(const qp&) = delete;
    // A moved-from qp may only be assigned to or destroyed. Move assignment releases the
    // target's QP as ~qp does.
    qp(qp&& other) noexcept = default;
    qp& operator=(qp&& other) noexcept;

    verbs::queue_pair& native_qp() noexcept { return state_->qp; }
    std::uint32_t qp_num() const noexcept { return state_->qp.qp_num(); }
    // Requests posted through this qp whose completion has not arrived (the forced-signaled
    // ones of unsignaled sends included; unsignaled ones, which are owed none, not).
    std::size_t pending() const noexcept { return state_->pending_count; }
    // The runtime moved this QP to the error state (a failed completion, a stop or timeout of
    // a posted request, a fatal async event, a disconnect, to_error()), and no post since
    // found it out of that state. Devices differ in what ibv_query_qp tells (Linux 6.1's siw
    // never reports a QP's state), so this is the runtime's own record.
    bool in_error() const noexcept { return state_->in_error; }
    // Unsignaled sends and writes (send_options::signaled = false): one in this many is
    // posted signaled. A quarter of the send queue's capacity, at most 64, at least 1.
    std::uint32_t signal_interval() const noexcept { return state_->signal_interval; }
    const qp_counters& counters() const noexcept { return state_->counters; }
    // The first error completion (other than a flush) of an unsignaled or forced-signaled
    // request, if one came: its await had already ended, so this is where it is reported.
    const std::optional<ibv_wc>& unsignaled_failure() const noexcept {
        return state_->unsignaled_failure;
    }
    // Moves the QP to the error state: every outstanding request completes with
    // IBV_WC_WR_FLUSH_ERR (bounded by qp_options::flush_timeout). Throws std::system_error
    // naming ibv_modify_qp.
    void to_error();

    // SEND (with immediate data, inline, solicited, unsignaled per `o`). Gives the completion
    // (for an unsignaled send: made up at its await, see send_options::signaled).
    request send(local_buffer data, send_options o = {}, wait_options w = {}) noexcept;
    // RECV into `into`: gives the completion (byte_len, imm_data, wc_flags). The peer chose
    // what it says: with opcode IBV_WC_RECV_RDMA_WITH_IMM nothing was written into `into`
    // (byte_len is what the peer's WRITE put into a remote-writable region of its choice);
    // check opcode and byte_len before reading `into` (recv_ring does).
    request recv(local_buffer into, wait_options w = {}) noexcept;
    // RDMA WRITE of `data` to `to` (with immediate data, unsignaled per `o`).
    request write(local_buffer data, remote_buffer to, send_options o = {},
                  wait_options w = {}) noexcept;
    // RDMA READ of `from` into `into`.
    request read(local_buffer into, remote_buffer from, wait_options w = {}) noexcept;
    // Atomic compare-and-swap of the 8 bytes at `at`; the old value lands in `old_value`
    // (8 bytes, registered).
    request compare_swap(local_buffer old_value, remote_buffer at, std::uint64_t compare,
                         std::uint64_t swap, wait_options w = {}) noexcept;
    // Atomic fetch-and-add on the 8 bytes at `at`; the old value lands in `old_value`.
    request fetch_add(local_buffer old_value, remote_buffer at, std::uint64_t add,
                      wait_options w = {}) noexcept;

    // Posts a chain of send requests in one ibv_post_send and awaits them together: the await
    // ends with the completion of the last one (which is made signaled); earlier ones may be
    // unsignaled (selective signaling). Their wr_ids are overwritten. Completions of the chain
    // are copied to `each` (in order, as many as fit) when given. The first failure throws.
    request post_send(ibv_send_wr& chain, std::span<ibv_wc> each = {},
                      wait_options w = {}) noexcept;
    // The same for a chain of receives in one ibv_post_recv: ends with the last one's
    // completion; every receive produces one, copied to `each`.
    request post_recv(ibv_recv_wr& chain, std::span<ibv_wc> each = {},
                      wait_options w = {}) noexcept;

    // co_await q.close(): the graceful, awaited end. With requests owed, moves the QP to the
    // error state and resumes once every one of them has ended (by its flush, or by the
    // bounded flush); then destroying the qp leaves nothing behind. Returns at once when
    // nothing is owed. Throws std::system_error "qp::close" with timed_out or
    // operation_canceled per `w` (the requests still end later, as after ~qp).
    close_awaitable close(wait_options w = {}) noexcept;

  private:
    friend class recv_ring;
    static std::shared_ptr<detail::srq_state> shared_state(const qp_options& o);
    std::shared_ptr<detail::qp_state> state_;
};

// qp::request: one posted work request (or chain), returned by qp::send, recv, write, read,
// compare_swap, fetch_add, post_send and post_recv. `co_await` it (it is posted then, unless
// post() did it before) and it gives the request's ibv_wc; a failed completion throws
// completion_error, a timeout or stop std::system_error (timed_out / operation_canceled), a
// post failure std::system_error naming the verb ("ibv_post_recv: ..."). What happened after
// the post names the request and its qp ("the receive (ibv_post_recv) on qp 17: no completion
// within its wait_options timeout ..."; a completion_error adds what its status usually
// means). Lives in the awaiting coroutine's frame; its
// address is the requests' wr_id (tagged), so a completion resumes exactly this coroutine,
// with no allocation and no lookup.
//
// Invariants:
// - It is resumed only after the completion of the chain's last request arrived (the QP
//   processes its queues in order, so that completion is the last one the chain produces) and
//   its timer, if any, delivered its CQE. No buffer of the request is written after.
// - A stop request or timeout cannot recall a posted request: it moves the QP to the error
//   state, which flushes every outstanding request of the QP (IBV_WC_WR_FLUSH_ERR); the
//   awaiter then resumes on its flush completion with operation_canceled / timed_out.
class qp::request : detail::wr_op, detail::wait_core {
  public:
    // Made in place (a prvalue) and never moved: the wr_id is its address.
    request(const request&) = delete;
    request& operator=(const request&) = delete;
    // A request posted with post() must be awaited before the awaiter goes; if it is not,
    // the destructor moves the QP to the error state and resets it without waiting (no
    // completion can name the awaiter after that; the QP's other owed requests end with their
    // flush or a made-up IBV_WC_WR_FLUSH_ERR) and says so on stderr. Connect the QP again to
    // reuse it.
    ~request() {
        if (stage_ == stage::posted || stage_ == stage::abandoned) [[unlikely]]
            abandon_unawaited();
    }

    // Posts the request now instead of at co_await (pre-posting receives, pipelining):
    //   auto r = q.recv(buf); r.post(); ...; ibv_wc wc = co_await r;
    // Throws std::system_error naming the verb (ENOMEM: queue full). The timeout and the
    // stop_token start counting at co_await.
    void post();

    // May throw: an unsignaled request is posted here (it is done once posted, so the
    // coroutine does not suspend).
    bool await_ready() {
        if (stage_ == stage::cancelled_early) return true;
        if (stage_ == stage::built) {
            if (options_.stop.stop_requested() || ctx_->shutting_down()) {
                stage_ = stage::cancelled_early;
                return true;
            }
            if (!signaled_) post_unsignaled_at_await();
        }
        return stage_ == stage::done;
    }
    // Does not suspend when the request ended inside its own post (the QP reset meanwhile).
    bool await_suspend(std::coroutine_handle<> h);
    ibv_wc await_resume() {
        // An unsignaled request done at its post never waited: nothing to finish or throw.
        if (done_at_post_) return made_up_completion();
        return await_resume_waited();
    }

  private:
    friend class qp;
    enum class kind { send, recv };
    // Where the request is. built -> posted -> done; built -> cancelled_early (stopped before
    // it was posted: nothing owed, the await throws ECANCELED); built or posted -> abandoned
    // (its awaiter gives up on it, abandon(): its completions are only counted) -> done.
    // An unsignaled send goes from built to done at its post (its completion made up).
    enum class stage : std::uint8_t { built, cancelled_early, posted, abandoned, done };
    // What its completions said: ok, or the first failure (first_error_), flushed after its
    // connection ended (closed: connection_reset) or not (failed).
    enum class outcome : std::uint8_t { ok, failed, closed };

    request(detail::qp_state* qp, kind k, const char* name, const detail::wr_request& r,
            wait_options options) noexcept;
    // A send, write or read of one buffer, built from its fields (the common requests: no
    // wr_request to fill and copy).
    request(detail::qp_state* qp, const char* name, ibv_wr_opcode opcode, local_buffer local,
            remote_buffer remote, unsigned send_flags, std::optional<std::uint32_t> imm,
            bool signaled, wait_options options) noexcept;

    static void completed(wr_op* op, const ibv_wc& wc, bool last) noexcept;
    // The deadline or the stop while the request is owed: a posted request cannot be
    // recalled, so the QP goes to the error state and the flush decides the wait.
    static bool interrupted_by(wait_core* core, int reason) noexcept;
    void abandon() noexcept;
    void abandon_unawaited() noexcept;
    void start_send(ibv_wr_opcode opcode, std::uint32_t length, unsigned send_flags,
                    std::optional<std::uint32_t> imm) noexcept;
    ibv_wc await_resume_waited();
    // An unsignaled request's completion, made up at its await: built here, inline, so that a
    // caller that reads only its status costs no copy.
    ibv_wc made_up_completion() const noexcept {
        ibv_wc wc{};
        wc.status = IBV_WC_SUCCESS;
        wc.opcode =
            send_wr_.opcode == IBV_WR_RDMA_WRITE || send_wr_.opcode == IBV_WR_RDMA_WRITE_WITH_IMM
                ? IBV_WC_RDMA_WRITE
                : IBV_WC_SEND;
        wc.qp_num = result_.qp_num; // set by post_unsignaled()
        return wc;
    }
    inline bool post_unsignaled(); // defined (and only used) in qp_request.cpp
    inline void post_signaled();   // the same
    void post_unsignaled_at_await();
    [[gnu::noinline, gnu::cold]] void post_throttled();
    [[noreturn, gnu::noinline, gnu::cold]] void
    unsignaled_post_failed(int rc, const ibv_send_wr* bad, bool forced);
    // Throws for a send whose doorbell was refused after the provider queued it (rc, no
    // request named bad), once the caller has reset the QP.
    [[noreturn]] void refused_doorbell(int rc) const;

    // The qp's state is alive while this request is owed a completion (a destroyed qp keeps
    // its state until then); once done, only ctx_ is touched, never qp_.
    detail::qp_state* qp_;
    io_context* ctx_;
    kind kind_;
    union { // by kind_; the constructor zeroes the one in use
        ibv_send_wr send_wr_;
        ibv_recv_wr recv_wr_;
    };
    ibv_sge sge_{};
    ibv_send_wr* send_chain_ = nullptr;
    ibv_recv_wr* recv_chain_ = nullptr;
    std::span<ibv_wc> each_;
    const char* name_;
    wait_options options_;
    ibv_wc result_; // written before the request is done: its last completion (unsignaled: qp_num)
    ibv_wc first_error_; // written when outcome_ leaves ok
    std::size_t seen_ = 0;
    stage stage_ = stage::built;
    outcome outcome_ = outcome::ok;
    bool signaled_ = true;      // posted signaled (else unsignaled, see send_options::signaled)
    bool done_at_post_ = false; // posted unsignaled: done without a wait (post_unsignaled)
};

// The builders of sends and writes, and what they build, are inline: an unsignaled send is done
// at its post and never waits, so constructing its request in the caller's frame (no call, no
// copy of the arguments) is a fair part of what it costs (tools/bench-cost).
inline qp::request::request(detail::qp_state* qp, const char* name, ibv_wr_opcode opcode,
                            local_buffer local, remote_buffer remote, unsigned send_flags,
                            std::optional<std::uint32_t> imm, bool signaled,
                            wait_options options) noexcept
    : qp_(qp), ctx_(qp->ctx), kind_(kind::send), name_(name), options_(std::move(options)) {
    on_wc = &qp::request::completed;
    sge_.addr = reinterpret_cast<std::uintptr_t>(local.addr);
    sge_.length = local.length;
    sge_.lkey = local.lkey;
    signaled_ = signaled;
    start_send(opcode, local.length, send_flags, imm);
    send_wr_.wr.rdma.remote_addr = remote.addr;
    send_wr_.wr.rdma.rkey = remote.rkey;
}

// What every send-queue request's work request has: its opcode, the one buffer (none when
// empty, except for an atomic, which always writes the old value), the flags (posted signaled
// unless post_unsignaled says otherwise) and the immediate.
inline void qp::request::start_send(ibv_wr_opcode opcode, std::uint32_t length, unsigned send_flags,
                                    std::optional<std::uint32_t> imm) noexcept {
    // Zeroed in two halves: GCC 12 zeroes 128 bytes at once with `rep stos` (16 counted
    // instructions and a slow start), 64 at a time with 4 vector stores each.
    static_assert(sizeof(ibv_send_wr) == 128);
    ::new (static_cast<void*>(&send_wr_)) ibv_send_wr; // the union's member in use from here
    std::memset(static_cast<void*>(&send_wr_), 0, 64);
    std::memset(reinterpret_cast<unsigned char*>(&send_wr_) + 64, 0, 64);
    send_wr_.opcode = opcode;
    send_wr_.sg_list = &sge_;
    const bool atomic =
        opcode == IBV_WR_ATOMIC_CMP_AND_SWP || opcode == IBV_WR_ATOMIC_FETCH_AND_ADD;
    send_wr_.num_sge = length > 0 || atomic ? 1 : 0;
    send_wr_.send_flags = send_flags | IBV_SEND_SIGNALED;
    if (imm) send_wr_.imm_data = htobe32(*imm);
}

namespace detail {
inline unsigned send_flags_of(const send_options& o) noexcept {
    // Without a branch per flag.
    return (o.inline_data ? unsigned{IBV_SEND_INLINE} : 0u) |
           (o.solicited ? unsigned{IBV_SEND_SOLICITED} : 0u) |
           (o.fence ? unsigned{IBV_SEND_FENCE} : 0u);
}
} // namespace detail

inline qp::request qp::send(local_buffer data, send_options o, wait_options w) noexcept {
    const bool imm = o.imm.has_value();
    const char* name = imm ? "ibv_post_send(SEND_WITH_IMM)" : "ibv_post_send(SEND)";
    const ibv_wr_opcode op = imm ? IBV_WR_SEND_WITH_IMM : IBV_WR_SEND;
    return {state_.get(), name,       op,          data, {}, detail::send_flags_of(o),
            o.imm,        o.signaled, std::move(w)};
}

inline qp::request qp::write(local_buffer data, remote_buffer to, send_options o,
                             wait_options w) noexcept {
    const bool imm = o.imm.has_value();
    const char* name = imm ? "ibv_post_send(RDMA_WRITE_WITH_IMM)" : "ibv_post_send(RDMA_WRITE)";
    const ibv_wr_opcode op = imm ? IBV_WR_RDMA_WRITE_WITH_IMM : IBV_WR_RDMA_WRITE;
    return {state_.get(), name,       op,          data, to, detail::send_flags_of(o),
            o.imm,        o.signaled, std::move(w)};
}

// qp::close_awaitable: returned by qp::close(); co_await it (gives nothing, throws as close()
// says). Awaited in place, not moved.
class qp::close_awaitable : detail::waiter {
  public:
    close_awaitable(const close_awaitable&) = delete;
    close_awaitable& operator=(const close_awaitable&) = delete;
    bool await_ready() noexcept {
        if (state_->pending_count == 0) return true;
        state_->to_error();
        return state_->pending_count == 0;
    }
    void await_suspend(std::coroutine_handle<> h) {
        wait_in(state_->close_waiters, *state_->ctx, options_, h);
    }
    // Decided or not, *state_ is not read: the qp may be gone by now.
    void await_resume() {
        const int err = decided() ? error() : 0;
        if (err != 0) throw_system_error(err, "qp::close");
    }

  private:
    friend class qp;
    close_awaitable(detail::qp_state* state, wait_options options) noexcept
        : state_(state), options_(std::move(options)) {}

    detail::qp_state* state_;
    wait_options options_;
};

inline qp::close_awaitable qp::close(wait_options w) noexcept {
    return {state_.get(), std::move(w)};
}

} // namespace ringverbs
