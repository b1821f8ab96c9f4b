// cm_id: an rdma_cm identifier on a cm_channel, whose steps (resolve, listen, connect, accept,
// disconnect) coroutines co_await, and the qps made on it.
#pragma once

#include <ringverbs/config.hpp>

#include <ringverbs/cm/cm_channel.hpp>
#include <ringverbs/cm/detail/cm_state.hpp>
#include <ringverbs/engine/detail/waiter.hpp>
#include <ringverbs/engine/error.hpp>
#include <ringverbs/engine/io_context.hpp>
#include <ringverbs/rdma/cq.hpp>
#include <ringverbs/rdma/qp.hpp>
#include <ringverbs/verbs/completion_queue.hpp>
#include <ringverbs/verbs/context.hpp>
#include <ringverbs/verbs/protection_domain.hpp>
#include <ringverbs/verbs/queue_pair.hpp>

#include <rdma/rdma_cma.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <system_error>
#include <vector>

namespace ringverbs {

// The peer refused the connection (RDMA_CM_EVENT_REJECTED): a std::system_error with
// errc::connection_refused whose what() names the reject reason and the call that learned of
// it: rdma_connect (the listening side refused our request: nothing listens there, or its
// rdma_reject), or rdma_accept (the connecting side refused our accept: its application
// rejected the REP, or it gave up on the connection and its IB CM sent a reject, reason 4).
class connection_rejected : public std::system_error {
  public:
    // An IB CM reject: by_peer_application() and nothing_listens() follow from the reason.
    connection_rejected(int reason, std::string reason_text, std::vector<std::byte> data,
                        const char* call = "rdma_connect");
    // Any transport, saying who refused.
    connection_rejected(int reason, std::string reason_text, std::vector<std::byte> data,
                        const char* call, bool by_peer_application, bool nothing_listens);
    // The transport's reason code. IB CM on IB/RoCE: 28 = the peer called rdma_reject, 8 = no
    // listener on that port. iWARP: the negative errno the provider reported (siw: -104
    // ECONNRESET for an MPA reject; -111 ECONNREFUSED when nothing listens).
    int reason() const noexcept { return reason_; }
    // True when the peer's application rejected (rdma_reject), not its CM.
    bool by_peer_application() const noexcept { return by_application_; }
    // True when nothing listens at that address and port (IB CM: invalid service id; iWARP:
    // the TCP connection was refused).
    bool nothing_listens() const noexcept { return nothing_listens_; }
    // The private data the peer attached to its reject. IB CM pads it to a fixed size with
    // zeros (148 bytes on RoCE): compare the prefix you sent. iWARP carries it in MPA, as sent.
    std::span<const std::byte> private_data() const noexcept { return data_; }

  private:
    int reason_;
    bool by_application_;
    bool nothing_listens_;
    std::vector<std::byte> data_;
};

// Connection parameters of connect() and accept_connection() besides the private data.
struct cm_conn_options {
    // RDMA reads/atomics outstanding as responder / as initiator (<= the device's limits).
    std::uint8_t responder_resources = 1;
    std::uint8_t initiator_depth = 1;
    std::uint8_t retry_count = 7;
    // Retries after an RNR NAK (the peer had no receive posted); then the send fails with
    // IBV_WC_RNR_RETRY_EXC_ERR. 6, the largest finite count: a peer that never posts receives
    // ends the connection instead of stalling it for ever. 7: retry forever. IB CM sends it to
    // the peer, whose QP takes it: connect() bounds the accepting side's sends, and
    // accept_connection() the connecting side's. accept_connection() also moves its own QP to
    // RTS with this count (not with the one the peer's request asked for), so a peer asking
    // for 7 still cannot stall a server's sends; on the connecting side, the accepting peer's
    // count applies.
    std::uint8_t rnr_retry_count = 6;
    // A constructor, not an aggregate, because of GCC 12's double destruction of aggregate
    // temporaries in co_await expressions.
    cm_conn_options() noexcept {}
};

// Owns an rdma_cm_id (RDMA_PS_TCP, reliable connected) on a cm_channel. A connecting id goes
//   co_await id.resolve_addr(dst); co_await id.resolve_route(); qp q = id.make_qp(pd, cq, cq);
//   co_await id.connect(private_data);
// a listening one
//   id.listen(addr); cm_id c = co_await id.accept(); qp q = c.make_qp(pd, cq, cq);
//   co_await c.accept_connection(private_data);
// and either side ends with co_await disconnect(), the other learning it from
// co_await disconnected(). When the peer disconnects (or its process dies), the id answers at
// once: its QP goes to the error state, so every request still posted on it completes with
// IBV_WC_WR_FLUSH_ERR and every await on the qp resumes. A step fails with a std::system_error
// naming the rdma_* call and its errno; the asynchronous steps also take wait_options (timed_out,
// operation_canceled: a step that timed out or was cancelled leaves the id mid-way, destroy it).
//
// One step at a time per id: resolve_addr, resolve_route, connect and accept_connection each
// wait for their own event; accept() and disconnected() may wait alongside.
//
// Lifetime: destroying the handle resumes its waiters with operation_canceled; a qp made on
// the id keeps the rdma_cm_id (rdma_destroy_qp, then rdma_destroy_id). An incoming request
// dropped unanswered is rejected. Destroy before the io_context, on its thread.
class cm_id {
  public:
    // Throws std::system_error naming rdma_create_id. On a channel that failed already
    // (cm_channel::error() != 0) no event of the id would ever be read: its steps and waits
    // fail at once with that errno.
    explicit cm_id(cm_channel& ch);
    ~cm_id();
    // Moving transfers the id; the moved-from handle is empty and may only be destroyed or
    // assigned to.
    cm_id(cm_id&& other) noexcept = default;
    cm_id& operator=(cm_id&& other) noexcept;
    cm_id(const cm_id&) = delete;
    cm_id& operator=(const cm_id&) = delete;

    explicit operator bool() const noexcept { return state_ != nullptr; }
    // The raw id (owned: do not destroy). Its context field is ringverbs'.
    rdma_cm_id* native() const noexcept { return state_->id; }

    // The device the id is bound to, as librdmacm opened it: create the PD and the channel of
    // the CQs of a qp on this id from it. Known after resolve_addr, listen on a device's
    // address, or for an accepted id. Throws std::system_error(ENODEV) naming cm_id::device
    // before, or naming rdma_get_devices.
    verbs::context device() const;
    // The port of device() the id uses (1-based).
    std::uint8_t port_num() const noexcept { return state_->id->port_num; }

    // rdma_bind_addr + rdma_listen on `addr` (port 0: any; its port then in local_port()).
    // Throws std::system_error naming the call (EADDRINUSE, EADDRNOTAVAIL).
    void listen(const sockaddr* addr, int backlog = 16);
    // The local port in host order (after listen, or once connected).
    std::uint16_t local_port() const noexcept;

    class in_transit;

    // Moves the id to another cm_channel, usually another thread's (a listener's thread handing
    // accepted requests to worker threads): rdma_migrate_id sends every later event of the id
    // to `target`, so its steps resume there. Call on this id's thread, for an id with no qp
    // and nothing awaited (an accepted request before it is answered, or a new id); then carry
    // the result to target's thread and adopt it there with cm_id(target, std::move(moving)).
    // Events that arrive in between are kept (a disconnect is sticky). Throws
    // std::system_error: EBUSY naming cm_id::migrate (a qp, a waiter, or a listener's
    // backlog), or rdma_migrate_id's errno; the id then stays where it was.
    in_transit migrate(cm_channel& target) &&;
    // Adopts an id migrated to `target`, on target's thread. Throws std::system_error(EINVAL)
    // naming cm_id::adopt when `moving` is empty or was migrated to another channel.
    cm_id(cm_channel& target, in_transit&& moving);

    class accept_awaitable;
    class step_awaitable;
    class connect_awaitable;
    class disconnect_awaitable;

    // co_await id.accept(): the next connection request on a listener, as a new cm_id with its
    // own state (request_data() has the request's private data). Answer it with
    // accept_connection() after making its qp, or reject(). Errors: std::system_error
    // "cm_id::accept" with timed_out, operation_canceled (stop_token, or the handle went), or
    // the channel's errno.
    accept_awaitable accept(wait_options options = {}) noexcept;
    // A listener's requests to a handler instead of accept(): each request as a new cm_id
    // (error 0), called on this id's thread from the loop, as the request is read (the
    // handler must not block: start a task for the handshake). Once, when no more requests can
    // come (the event channel failed, the device went), with an empty cm_id and that errno,
    // after the id's own waits were ended; that call may make and destroy ids of the channel,
    // this one included. A request the handler drops unanswered is rejected; one for which it
    // throws too.
    // Requests already in the backlog go to the handler at once. An empty handler goes back
    // to accept(). Throws std::bad_alloc.
    void on_request(std::function<void(cm_id request, int error)> handler);
    // The private data of the connection request (IB CM pads it with zeros to 56 bytes).
    std::span<const std::byte> request_data() const noexcept { return state_->request_data; }

    // co_await id.resolve_addr(dst): rdma_resolve_addr, then its event. `dst` is copied.
    // The kernel's own resolution timeout is options.timeout (2 s without one). Throws
    // std::system_error naming rdma_resolve_addr (ENETUNREACH, EHOSTUNREACH, ETIMEDOUT, ...).
    step_awaitable resolve_addr(const sockaddr* dst, wait_options options = {}) noexcept;
    // co_await id.resolve_route(): rdma_resolve_route, then its event. Throws naming
    // rdma_resolve_route.
    step_awaitable resolve_route(wait_options options = {}) noexcept;
    // co_await id.connect(data): rdma_connect with `data` as private data (<= 56 bytes on
    // RoCE; copied), then ESTABLISHED. Needs the id's qp. Gives the private data of the peer's
    // accept (zero-padded by IB CM). Throws connection_rejected when the peer refused, or
    // std::system_error naming rdma_connect (ETIMEDOUT, EHOSTUNREACH, ECONNRESET if the
    // connection went before it was established). Like every step, bounded by the channel's
    // cm_channel_options::step_timeout (15 s) unless `options` has a timeout of its own.
    connect_awaitable connect(std::span<const std::byte> data = {}, wait_options options = {},
                              cm_conn_options conn = {}) noexcept;
    // co_await c.accept_connection(data): rdma_accept of an accepted request, then
    // ESTABLISHED. Needs the id's qp. Throws std::system_error naming rdma_accept, or
    // connection_rejected naming rdma_accept when the connecting peer refused the accept.
    step_awaitable accept_connection(std::span<const std::byte> data = {},
                                     wait_options options = {}, cm_conn_options conn = {}) noexcept;
    // Refuses an accepted request; the connector gets connection_rejected with `data`
    // (<= 148 bytes on RoCE). Throws std::system_error naming rdma_reject.
    void reject(std::span<const std::byte> data = {});

    // co_await id.disconnect(): rdma_disconnect (the QP goes to the error state, flushing its
    // requests), then DISCONNECTED (the peer's answer, or IB CM giving up on it). Returns at
    // once if already disconnected, or if the connection was never established (a connect
    // refused, timed out or not answered yet: nothing is sent, no DISCONNECTED would come);
    // the id is disconnected then, and disconnected() resumes. Like a step, the wait is bounded
    // by the channel's cm_channel_options::step_timeout unless `options` has a timeout of its
    // own. Throws naming rdma_disconnect (timed_out after the bound).
    disconnect_awaitable disconnect(wait_options options = {}) noexcept;
    // co_await id.disconnected(): resumes when the connection is gone (either side
    // disconnected, or the peer vanished). Throws std::system_error "cm_id::disconnected" with
    // timed_out or operation_canceled; with ENODEV when the device went away
    // (DEVICE_REMOVAL), or the errno with which the id's event channel failed.
    disconnect_awaitable disconnected(wait_options options = {}) noexcept;
    bool is_disconnected() const noexcept { return state_->disconnected; }
    // True for an accepted request not answered yet: neither its rdma_accept nor a reject
    // went out (an accept_connection() that failed before sending its answer leaves it so).
    bool awaiting_answer() const noexcept { return state_->unanswered; }
    // Begins the disconnect of an established connection (rdma_disconnect: the QP goes to the
    // error state, the peer learns it) without waiting for it, once; for destructors. A failure
    // goes to the diagnostics sink.
    void close() noexcept;

    // The qp of this connection: created by rdma_create_qp on `pd` (of device(), else EINVAL)
    // with the cqs (whose channel must be on device() too), moved through its states by
    // connect / accept_connection, destroyed by rdma_destroy_qp once nothing is owed. The qp
    // keeps the id's state alive; this handle may go first. Throws std::system_error naming
    // rdma_create_qp, or as qp's constructor (EINVAL: overcommitted cqs, or cqs of two
    // io_contexts).
    qp make_qp(const verbs::protection_domain& pd, cq& send_cq, cq& recv_cq,
               const verbs::qp_caps& caps = {}, qp_options options = {});
    // The bare verbs QP for this id (rdma_create_qp on `pd` with the given CQs; destroyed by
    // rdma_destroy_qp), for those who post and poll themselves. Throws naming rdma_create_qp.
    // With `srq`, its receives come from that shared receive queue.
    verbs::queue_pair create_qp(const verbs::protection_domain& pd,
                                const verbs::completion_queue& send_cq,
                                const verbs::completion_queue& recv_cq,
                                const verbs::qp_caps& caps = {}, ibv_srq* srq = nullptr);

  private:
    friend struct detail::cm_channel_state;
    explicit cm_id(std::shared_ptr<detail::cm_id_state> s) noexcept : state_(std::move(s)) {}
    cm_id() noexcept = default; // empty: for on_request's failure call

    enum class step { resolve_addr, resolve_route, connect, accept_connection };
    class step_wait;

    // Starts a step (the rdma_* call) and clears the previous outcome. Throws.
    static void begin(detail::cm_id_state& s, step k, const sockaddr_storage* addr,
                      std::span<const std::byte> data, const cm_conn_options& conn,
                      const wait_options& options);
    // Turns a step's outcome into its result or exception.
    static std::vector<std::byte> outcome(step k, int wait_error,
                                          std::optional<detail::cm_event_data>& result);
    static void start_disconnect(detail::cm_id_state& s);

    std::shared_ptr<detail::cm_id_state> state_;
};

// An id between two channels (cm_id::migrate): movable, and for nothing but adoption by
// cm_id(target, std::move(moving)) on the target's thread. Dropped un-adopted, it destroys the
// id (an unanswered request is rejected): do that on the target's thread too.
class cm_id::in_transit {
  public:
    in_transit(in_transit&&) noexcept = default;
    in_transit& operator=(in_transit&&) noexcept = default;
    in_transit(const in_transit&) = delete;
    in_transit& operator=(const in_transit&) = delete;
    ~in_transit() = default;

  private:
    friend class cm_id;
    explicit in_transit(std::shared_ptr<detail::cm_id_state> s) noexcept : state_(std::move(s)) {}
    std::shared_ptr<detail::cm_id_state> state_;
};

// What resolve_addr, resolve_route, connect and accept_connection share: begins the step
// (the rdma_* call) at co_await and waits for its event.
class cm_id::step_wait : detail::cm_step_waiter {
  public:
    step_wait(const step_wait&) = delete;
    step_wait& operator=(const step_wait&) = delete;
    // The event cannot come before we suspend: events are read on this thread, by the loop.
    bool await_ready() {
        begin(*state_, step_, &addr_, data_, conn_, options_);
        return false;
    }
    void await_suspend(std::coroutine_handle<> h) {
        // Without a timeout of its own, the step is bounded by the channel's step_timeout.
        const wait_options bounded =
            options_.timeout == wait_options::no_timeout
                ? wait_options(state_->channel->step_timeout, options_.stop)
                : options_;
        wait_in(state_->step_waiters, *state_->channel->ctx, bounded, h);
    }

  protected:
    step_wait(detail::cm_id_state* state, step k, const sockaddr* dst,
              std::span<const std::byte> data, cm_conn_options conn, wait_options options) noexcept
        : state_(state), step_(k), data_(data), conn_(conn), options_(std::move(options)) {
        if (dst) {
            const std::size_t len =
                dst->sa_family == AF_INET6 ? sizeof(sockaddr_in6) : sizeof(sockaddr_in);
            std::memcpy(&addr_, dst, len);
        }
    }
    // Always suspended first, so decided here: the outcome is in this object (see
    // detail::cm_step_waiter), and *state_ is not read.
    std::vector<std::byte> take_result() {
        return outcome(step_, decided() ? error() : EIO, result);
    }

  private:
    detail::cm_id_state* state_;
    step step_;
    sockaddr_storage addr_{};
    std::span<const std::byte> data_;
    cm_conn_options conn_;
    wait_options options_;
};

// cm_id::step_awaitable: returned by resolve_addr, resolve_route and accept_connection;
// co_await ends when the step's event came (gives nothing; throws as each call says). Awaited
// in place, not moved.
class cm_id::step_awaitable : public cm_id::step_wait {
  public:
    void await_resume() { take_result(); }

  private:
    friend class cm_id;
    using step_wait::step_wait;
};

// cm_id::connect_awaitable: returned by connect(); co_await gives the private data of the
// peer's accept (throws as connect() says). Awaited in place, not moved.
class cm_id::connect_awaitable : public cm_id::step_wait {
  public:
    std::vector<std::byte> await_resume() { return take_result(); }

  private:
    friend class cm_id;
    using step_wait::step_wait;
};

// cm_id::accept_awaitable: returned by accept(); co_await gives the next connection request as
// a new cm_id (throws as accept() says). Awaited in place, not moved.
class cm_id::accept_awaitable : detail::cm_accept_waiter {
  public:
    accept_awaitable(const accept_awaitable&) = delete;
    accept_awaitable& operator=(const accept_awaitable&) = delete;
    bool await_ready() noexcept {
        if (!state_->backlog.empty()) {
            taken = std::move(state_->backlog.front().id);
            state_->backlog.pop_front();
            return true;
        }
        return state_->closed || state_->error != 0;
    }
    void await_suspend(std::coroutine_handle<> h) {
        wait_in(state_->accept_waiters, *state_->channel->ctx, options_, h);
    }
    cm_id await_resume() {
        int err = decided() ? error() : 0;
        if (!taken) {
            if (err == 0) err = state_->closed ? ECANCELED : state_->error;
            throw_system_error(err, "cm_id::accept");
        }
        return cm_id(std::move(taken));
    }

  private:
    friend class cm_id;
    accept_awaitable(detail::cm_id_state* state, wait_options options) noexcept
        : state_(state), options_(std::move(options)) {}

    detail::cm_id_state* state_;
    wait_options options_;
};

// cm_id::disconnect_awaitable: returned by disconnect() and disconnected(); co_await ends when
// the connection is gone (gives nothing; throws as each call says). Awaited in place, not
// moved.
class cm_id::disconnect_awaitable : detail::waiter {
  public:
    disconnect_awaitable(const disconnect_awaitable&) = delete;
    disconnect_awaitable& operator=(const disconnect_awaitable&) = delete;
    bool await_ready() {
        if (state_->disconnected || state_->closed || state_->error != 0) return true;
        if (initiate_) start_disconnect(*state_);
        return state_->disconnected;
    }
    void await_suspend(std::coroutine_handle<> h) {
        // disconnect() without a timeout of its own is bounded like a step (its answer is the
        // peer's CM's); disconnected() waits for the peer as long as asked.
        const wait_options bounded =
            initiate_ && options_.timeout == wait_options::no_timeout
                ? wait_options(state_->channel->step_timeout, options_.stop)
                : options_;
        wait_in(state_->disconnect_waiters, *state_->channel->ctx, bounded, h);
    }
    void await_resume() {
        // Decided: fulfilled (0: the DISCONNECTED event) or failed; *state_ is not read, since
        // a coroutine resumed before this one may have destroyed the id. Not decided: it was
        // ready at once and *state_ is alive.
        const int err = decided()              ? error()
                        : state_->disconnected ? 0
                        : state_->closed       ? ECANCELED
                                               : state_->error;
        if (err == ETIMEDOUT && initiate_)
            throw_system_error(ETIMEDOUT, "rdma_disconnect: no DISCONNECTED within the bound (its "
                                          "wait_options, else cm_channel_options::step_timeout)");
        if (err != 0)
            throw_system_error(err, initiate_ ? "rdma_disconnect" : "cm_id::disconnected");
    }

  private:
    friend class cm_id;
    disconnect_awaitable(detail::cm_id_state* state, bool initiate, wait_options options) noexcept
        : state_(state), initiate_(initiate), options_(std::move(options)) {}

    detail::cm_id_state* state_;
    bool initiate_; // disconnect(): calls rdma_disconnect first
    wait_options options_;
};

inline cm_id::accept_awaitable cm_id::accept(wait_options options) noexcept {
    return {state_.get(), std::move(options)};
}
inline cm_id::step_awaitable cm_id::resolve_addr(const sockaddr* dst,
                                                 wait_options options) noexcept {
    return {state_.get(), step::resolve_addr, dst, {}, {}, std::move(options)};
}
inline cm_id::step_awaitable cm_id::resolve_route(wait_options options) noexcept {
    return {state_.get(), step::resolve_route, nullptr, {}, {}, std::move(options)};
}
inline cm_id::connect_awaitable cm_id::connect(std::span<const std::byte> data,
                                               wait_options options,
                                               cm_conn_options conn) noexcept {
    return {state_.get(), step::connect, nullptr, data, conn, std::move(options)};
}
inline cm_id::step_awaitable cm_id::accept_connection(std::span<const std::byte> data,
                                                      wait_options options,
                                                      cm_conn_options conn) noexcept {
    return {state_.get(), step::accept_connection, nullptr, data, conn, std::move(options)};
}
inline cm_id::disconnect_awaitable cm_id::disconnect(wait_options options) noexcept {
    return {state_.get(), true, std::move(options)};
}
inline cm_id::disconnect_awaitable cm_id::disconnected(wait_options options) noexcept {
    return {state_.get(), false, std::move(options)};
}

} // namespace ringverbs
