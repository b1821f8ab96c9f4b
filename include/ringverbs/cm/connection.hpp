// connection and listener: an RDMA connection in a few lines. connect() and listener::accept()
// resolve an address (rdma_getaddrinfo), run every rdma_cm step with a bound, and make what a
// connection needs (protection domain, completion channel, CQ, qp), shared per device where it
// can be; cm_channel and cm_id stay reachable underneath.
#pragma once

#include <ringverbs/config.hpp>

#include <ringverbs/cm/cm_channel.hpp>
#include <ringverbs/cm/cm_id.hpp>
#include <ringverbs/engine/io_context.hpp>
#include <ringverbs/engine/task.hpp>
#include <ringverbs/rdma/buffers.hpp>
#include <ringverbs/rdma/channel.hpp>
#include <ringverbs/rdma/channel_options.hpp>
#include <ringverbs/rdma/cq.hpp>
#include <ringverbs/rdma/qp.hpp>
#include <ringverbs/rdma/recv_ring.hpp>
#include <ringverbs/verbs/context.hpp>
#include <ringverbs/verbs/protection_domain.hpp>
#include <ringverbs/verbs/queue_pair.hpp>

#include <sys/socket.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <stop_token>
#include <string>
#include <string_view>
#include <vector>

namespace ringverbs {

// What connect() and listener make for each connection. An aggregate of trivially
// destructible members (safe as a temporary in a co_await expression, even with GCC 12).
struct connection_options {
    // The qp's capacities (send / receive requests, SGEs, inline bytes).
    verbs::qp_caps caps = {};
    // The connection's CQ (send and receive completions both go there). 0: the qp's send plus
    // receive capacity, rounded up to a power of two, so that a flush of everything fits. On
    // a shared receive queue (queue.shared_receive_queue) the receive part is the SRQ's
    // capacity instead: any of its receives may complete on this connection's CQ.
    int cq_entries = 0;
    // How the completion channel learns of completions (events, busy, hybrid). The channel is
    // shared by every connection of this thread (io_context) on the same device with equal
    // channel_options.
    channel_options completion = {};
    // Passed to the qp (flush_timeout; allow_cq_overcommit; shared_receive_queue: an srq of
    // the device the connection lands on).
    qp_options queue = {};
    // RDMA read / atomic depth and the retry counts (cm_conn_options).
    cm_conn_options conn = {};
    // The bound of every step, each on its own: connect()'s host-name lookup, address and route
    // resolution, connect (until the peer accepted), accept (until the connection is
    // established). A step that takes longer fails with std::system_error(errc::timed_out)
    // naming its call (rdma_getaddrinfo, rdma_*). wait_options::no_timeout does not make the
    // steps unbounded: it stands for the rdma_cm channel's own bound (cm_channel_options::
    // step_timeout, 15 s), for every step alike, the lookup included (an unbounded connect
    // would wait on IB CM's retries for minutes; give a longer duration instead). Waiting for
    // the next request, listener::accept(), is not a step: it is bounded by its own
    // wait_options.
    std::chrono::nanoseconds step_timeout = std::chrono::seconds(15);
    // When not 0: the connection keeps this many receives posted in a recv_ring of its own
    // (receive_size bytes each, registered once), made before the connection is established so
    // that the peer's first message finds one, and read with connection::next_message(). The qp's
    // receive capacity is raised to it when smaller.
    std::uint32_t receive_slots = 0;
    std::uint32_t receive_size = 4096;
    // Sent with the connect request (connect(): <= 56 bytes on IB/RoCE) or with the accept
    // (listener: <= 196 bytes on IB/RoCE, the REP's room). connect() reads it when the task
    // runs: keep it alive until its co_await ends. A listener copies it. Too long: the call
    // throws EINVAL (a listener from accept(), naming rdma_accept).
    std::span<const std::byte> private_data = {};
    // Listener: requests whose handshake is under way at once (the qp made, the accept sent,
    // the peer's RTU awaited, each bounded by step_timeout). Handshakes run concurrently, so a
    // peer that never completes its own costs only one of these. A request beyond the bound is
    // rejected at once with the private data "busy: too many handshakes under way".
    std::uint32_t max_handshakes = 64;
    // Listener: of those, at most this many from one peer host (detail::peer_host: its IPv4
    // address, or its IPv6 /64; any port), so
    // that one host holding unfinished handshakes (stopped clients, a flood) leaves room for
    // the others. Beyond it its requests are rejected with "busy: too many handshakes under way
    // from your address". 0 (the default): no per-host bound. Off by default: a well-behaved
    // client on the same host as a flood (siw, every test here) then competes for a few slots
    // instead of max_handshakes, and was starved in CI; set it where clients come from many
    // hosts. (A host's established connections are not bounded here.)
    std::uint32_t max_handshakes_per_peer = 0;
    // Listener: established connections accept() has not taken yet. While that many wait (or
    // that many, handshakes included, are pending) a new request is rejected with "busy: too
    // many connections not yet accepted".
    std::uint32_t accept_queue = 128;
};

// One established, reliable connection and what it owns: its rdma_cm id, its qp, its CQ,
// and shares of its device's protection domain and completion channel. Post on it as on a qp:
//
//   connection c = co_await connect(io, "198.18.0.1:7471");
//   verbs::memory_region mr(c.pd(), buf);        // c.pd() serves every connection on the device
//   co_await c.send(local_buffer(mr, buf));
//   ibv_wc wc = co_await c.recv(local_buffer(mr, buf));
//
// When the peer disconnects (or its process dies), every request still posted fails with
// connection_reset; disconnected() resumes. Move-only. Destroying it without disconnect()
// disconnects too (rdma_destroy_id) and never blocks: requests still owed end as ~qp says.
// Destroy before the io_context, on its thread.
class connection {
  public:
    connection(connection&&) noexcept;
    connection& operator=(connection&&) noexcept;
    ~connection();

    // Empty after a move.
    explicit operator bool() const noexcept { return parts_ != nullptr; }

    // Post and await, as the qp's calls of the same names (qp.hpp).
    qp::request send(local_buffer data, send_options o = {}, wait_options w = {}) noexcept {
        return queue_pair().send(data, o, std::move(w));
    }
    qp::request recv(local_buffer into, wait_options w = {}) noexcept {
        return queue_pair().recv(into, std::move(w));
    }
    qp::request write(local_buffer data, remote_buffer to, send_options o = {},
                      wait_options w = {}) noexcept {
        return queue_pair().write(data, to, o, std::move(w));
    }
    qp::request read(local_buffer into, remote_buffer from, wait_options w = {}) noexcept {
        return queue_pair().read(into, from, std::move(w));
    }

    // co_await c.next_message(): the next message of the connection's recv_ring
    // (connection_options::receive_slots), its bytes valid until the next next_message().
    // Throws as recv_ring::next (connection_reset when the connection ended), or EINVAL naming
    // connection::next_message when the connection has no ring. (recv() above is one receive
    // request of your own buffer, as on a qp.)
    recv_ring::next_awaitable next_message(wait_options w = {});
    [[deprecated("renamed next_message() in 0.3.0")]] recv_ring::next_awaitable
    receive(wait_options w = {}) {
        return next_message(std::move(w));
    }

    // co_await c.disconnect(): ends the connection (rdma_disconnect; the peer learns it at
    // once) and resumes when it is gone. co_await c.disconnected(): resumes when the peer (or
    // this side) ended it. As cm_id's calls of the same names.
    cm_id::disconnect_awaitable disconnect(wait_options w = {}) noexcept;
    cm_id::disconnect_awaitable disconnected(wait_options w = {}) noexcept;
    bool is_disconnected() const noexcept;

    // The protection domain of the connection's device, shared by every connection made by
    // connect() or a listener on that device in this process: a memory region registered on it
    // serves all of them.
    const verbs::protection_domain& pd() const noexcept;
    // The device (librdmacm's context of it) the connection runs on.
    const verbs::context& device() const noexcept;
    // The private data the peer sent: its accept's (connect()) or its request's (accept()),
    // zero-padded by IB CM.
    std::span<const std::byte> peer_data() const noexcept;
    // The peer's address and port, as text ("198.18.0.2:40123", "[fe80::1]:7471").
    std::string peer_address() const;

    // The pieces underneath, for what this layer does not do.
    qp& queue_pair() noexcept;
    cq& completions() noexcept;
    // The completion channel of completions(): shared by the connections of this io_context on
    // the same device with equal connection_options::completion (its counters(), its
    // event_path(), its error() count for all of them); once it failed (error() != 0), new
    // connections get a fresh one.
    channel& completion_channel() noexcept;
    // The connection's recv_ring (null without connection_options::receive_slots).
    recv_ring* message_ring() noexcept;
    [[deprecated("renamed message_ring() in 0.3.0")]] recv_ring* receives() noexcept {
        return message_ring();
    }
    cm_id& id() noexcept;
    // The rdma_cm event channel of id(): connect()'s of this thread, or the listener's.
    cm_channel& events() noexcept;

    // What connect() and listener make (opaque).
    struct parts;
    explicit connection(std::unique_ptr<parts> p) noexcept;

  private:
    std::unique_ptr<parts> parts_;
};

// co_await connect(io, "host:port"): resolves the address with rdma_getaddrinfo ("198.18.0.1:7471",
// "[fe80::1%eth0]:7471", "server.example:7471"; a host name is looked up on a thread of its
// own, so the loop does not block: at most detail::max_lookup_threads of them in the process at
// once, each until its lookup ends even when connect() gave up on it), then the address and
// route on the device that reaches it,
// makes the qp and connects, each step bounded by options.step_timeout (15 s). On siw it then
// settles the connection (a zero-length RDMA READ, answered by the peer's kernel: a first
// message sent at once would otherwise be left unread by siw; docs/design.md, "Transports and
// providers"), bounded by step_timeout (then the QP's flush bound). `stop` cancels whichever
// step is under way. A name with several
// addresses: the first one rdma_getaddrinfo gives is tried. Throws:
// - std::system_error(EINVAL) naming ringverbs::connect for an address it cannot parse (or
//   without a host: ":7471", "7471"); naming rdma_getaddrinfo (with gai_strerror's text) for
//   a name it cannot resolve; EAGAIN naming rdma_getaddrinfo, at once, when
//   detail::max_lookup_threads host-name lookups are under way already (retry later, or give
//   a numeric address: those need no thread);
// - connection_rejected when the peer refused (nothing listens on that port, or rdma_reject);
// - std::system_error naming the rdma_* step that failed or timed out (timed_out: nobody
//   answered at that address within step_timeout), or operation_canceled on `stop`;
// - what making the CQ and qp throws (EMFILE, ENOMEM, EINVAL naming the verb);
// - on siw, std::system_error naming "ringverbs::connect (the zero-length RDMA READ that
//   settles a siw connection failed: ...)" with the READ's failure.
task<connection> connect(io_context& io, std::string address, connection_options options = {},
                         std::stop_token stop = {});

// Listens on an address and hands out established connections:
//
//   listener l(io, ":7471");                   // every address of every RDMA device
//   connection c = co_await l.accept();        // the next established connection
//
// "host:port", ":port" or "port" (any address, IPv4 and IPv6), "0.0.0.0:port", "[::]:port";
// port 0 picks one (port() tells which). When listening on any address the device is known only at
// each request: each connection gets the PD and channel of the device its request came on.
//
// From construction on, the listener takes every request itself (a task spawned on `io`, so
// requests are answered whenever the loop runs, whether or not an accept() waits) and runs the
// handshakes concurrently, at most connection_options::max_handshakes at once, each bounded by
// step_timeout: a peer that sends its request and never completes the handshake delays nobody
// else, and (when set) one host holds at most max_handshakes_per_peer of them. Established
// connections wait for accept() in a queue of connection_options::accept_queue; requests beyond
// these bounds, and, once the listener has made a connection, requests the process or device has no
// resources for (making their CQ, QP or receive buffers failed with ENOMEM, EMFILE, ENFILE,
// ENOSPC, ENOBUFS, EAGAIN, EDQUOT or std::bad_alloc: e.g. the memlock limit reached), are
// rejected with a "busy: ..." reason (the peer gets connection_rejected with it as private
// data, and may come back later), logged to the diagnostics sink and counted by rejected().
//
// Owns its cm_channel; destroy before the io_context, on its thread. Destroying it ends the
// accept()s waiting (operation_canceled), the handshakes under way (their requests are
// dropped) and the connections not taken yet (disconnected).
class listener {
  public:
    // rdma_getaddrinfo (numeric addresses only: no lookup blocks the thread here), then
    // rdma_bind_addr and rdma_listen. Throws std::system_error naming the call (EINVAL naming
    // ringverbs::listener for an address it cannot parse; EADDRINUSE; EADDRNOTAVAIL: no RDMA
    // device has that address).
    listener(io_context& io, std::string_view address, connection_options options = {},
             int backlog = 128);
    ~listener();
    listener(const listener&) = delete;
    listener& operator=(const listener&) = delete;

    // co_await l.accept(): the next established connection, in the order their handshakes
    // ended. A request whose handshake fails on the peer's side (it went away, timed out,
    // rejected our accept: connection_rejected naming rdma_accept, never sent its RTU within
    // step_timeout) is dropped and reported to the diagnostics sink;
    // accept() never sees it. Throws std::system_error: "listener::accept" with timed_out /
    // operation_canceled per `w` (only this wait ends: handshakes go on; the timeout counts
    // from the call, also when another accept() took what this one was woken for; a stop
    // requested before the co_await wins over a connection ready, which stays queued for the
    // next accept()), operation_canceled
    // when the listener is destroyed, the channel's errno when the rdma_cm event channel
    // failed; and the listener's own failures, once per request they failed (that request
    // rejected, the listener stays usable): what making the CQ or qp throws (running out of
    // resources only before the first connection was made: a setup that cannot make even one,
    // e.g. a memlock limit too small; after it, a "busy" rejection, above), or what rdma_accept /
    // the QP's move to RTS refused in the options (EINVAL: private data too long, initiator_depth
    // or responder_resources above the device's).
    task<connection> accept(wait_options w = {});

    // The port listened on, in host order.
    std::uint16_t port() const noexcept;
    // The listening id and its event channel. The listener accepts on the id itself: do not
    // call id().accept().
    cm_id& id() noexcept;
    cm_channel& events() noexcept;
    // Handshakes under way now, and established connections waiting for accept().
    std::uint32_t handshakes() const noexcept;
    std::uint32_t waiting() const noexcept;
    // Requests rejected with a "busy: ..." reason so far (the bounds, or no resources).
    std::uint64_t rejected() const noexcept;

    struct state;

  private:
    std::shared_ptr<state> state_; // shared with accept()s under way
};

namespace detail {
// "host:port", "[v6]:port", ":port", "port" (listening only) split into host (empty: any) and
// port. Throws std::system_error(EINVAL) naming `who` and the text when there is no port or it
// is not a number in 0..65535.
void split_host_port(std::string_view text, std::string& host, std::string& port, const char* who);
// An address as text: "198.18.0.2:40123", "[fe80::1]:7471" (and "?" for other families).
std::string address_text(const sockaddr* a);
// The host an address belongs to, for connection_options::max_handshakes_per_peer: an IPv4
// address (also IPv4-mapped IPv6) as itself, "198.18.0.2"; an IPv6 address as its /64,
// "fd00::/64" (a host's privacy addresses share it); "?" for other families.
std::string peer_host(const sockaddr* a);
// The bound connect() gives each of its steps for connection_options::step_timeout:
// no_timeout stands for cm_channel_options' default step_timeout (15 s), else it is itself.
std::chrono::nanoseconds connect_step_bound(std::chrono::nanoseconds step_timeout) noexcept;
// Host-name lookups connect() runs at once, each on a thread of its own, in the whole process;
// one more throws EAGAIN. Bounded since a lookup cannot be cancelled: its thread runs until
// the resolver gives up, and a burst of connect()s to a name whose DNS hangs would pile them
// up without a bound.
inline constexpr unsigned max_lookup_threads = 8;
// Those under way now.
unsigned lookup_threads() noexcept;
} // namespace detail

} // namespace ringverbs
