// echo_server: every message a client SENDs comes back unchanged with a SEND. Each thread is
// one io_context: rdma_cm events, completions and signals all arrive through its io_uring ring.
//
//   echo_server [--address IP] [--port N] [--device NAME] [--max-size BYTES] [--depth N]
//               [--mode events|hybrid|busy] [--max-connections N] [--idle-timeout SECONDS]
//               [--threads N] [--srq-depth N | --no-srq]
//
// By default every thread receives through one shared receive queue (SRQ) per device, with a
// registered pool of --srq-depth / --threads buffers of --max-size bytes, and one CQ for its
// connections' sends and receives: registered memory does not grow with connections. Each
// buffer has its own coroutine, which receives a message into it, from any connection, and
// sends it back from it on that connection:
//
//   ibv_wc received = co_await srq.recv(buffer); // resumes on this receive's own completion,
//   co_await qp.send(message);                   // which names the QP; then on this send's
//
// With --no-srq each connection gets its own CQ, QP and a pool of --depth buffers, all posted
// as receives before the connection is accepted, one coroutine per buffer likewise
// (co_await qp.recv(buffer)).
//
// --threads N: N threads, each with its own io_context, completion channel, rdma_cm channel and
// SRQ + CQ. The main thread (one of the N) listens, and hands every accepted request to the
// thread serving the fewest connections: cm_id::migrate moves it to that thread's rdma_cm
// channel, where the connection lives until it closes.
//
// A connection that fails (the client vanished, sent more than --max-size, ...) or stays
// silent for --idle-timeout seconds is closed and its resources released; the others go on.
// Beyond --max-connections open connections, a request is rejected with the reason in the
// reject's private data ("busy: ..."), before anything is allocated for it. A request its thread
// cannot set up for (the shared receive pool cannot be registered, e.g. under RLIMIT_MEMLOCK)
// is rejected with the verb and errno ("server error: ..."); a later one tries again. SIGINT or
// SIGTERM closes every connection and exits 0.
#include "echo_common.hpp"

#include <ringverbs/cm/cm_id.hpp>
#include <ringverbs/engine/nothrow.hpp>
#include <ringverbs/engine/signal_set.hpp>
#include <ringverbs/engine/timer.hpp>
#include <ringverbs/engine/when_all.hpp>
#include <ringverbs/rdma/channel.hpp>
#include <ringverbs/rdma/completion_error.hpp>
#include <ringverbs/rdma/cq.hpp>
#include <ringverbs/rdma/device_events.hpp>
#include <ringverbs/rdma/qp.hpp>
#include <ringverbs/rdma/srq.hpp>

#include <arpa/inet.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

using namespace ringverbs;
using namespace std::chrono_literals;

namespace {

const char* const usage =
    "usage: echo_server [--address IP] [--port N] [--device NAME] [--max-size BYTES] [--depth N]\n"
    "                   [--mode events|hybrid|busy] [--max-connections N]\n"
    "                   [--idle-timeout SECONDS] [--threads N] [--srq-depth N | --no-srq]\n"
    "  --address   IPv4 or IPv6 address to listen on (default 0.0.0.0: every RDMA device)\n"
    "  --port      port (default 18515)\n"
    "  --device    serve only connections arriving on this RDMA device (default: any)\n"
    "  --max-size  largest message taken, the size of each posted receive (default 4096)\n"
    "  --depth     receives posted per connection (default 64)\n"
    "  --mode      how the completion channel waits (default events)\n"
    "  --max-connections  connections open at once; beyond, requests are rejected with the\n"
    "              reason \"busy: N connections\" (default 1024; 0: no limit)\n"
    "  --idle-timeout  close a connection that sent no message for this many seconds\n"
    "              (default 60; 0: never)\n"
    "  --threads   threads serving connections, each with its own ring, channels and shared\n"
    "              receive queue (default 1)\n"
    "  --srq-depth buffers of the shared receive queues, split over the threads (default 4096:\n"
    "              16 MiB registered with --max-size 4096, whatever the connections)\n"
    "  --no-srq    no shared receive queue: each connection gets its own CQ and --depth\n"
    "              receives (--depth * --max-size bytes registered per connection)\n";

struct server_options {
    std::string address = "0.0.0.0";
    std::uint16_t port = echo::default_port;
    std::string device;
    std::uint32_t max_size = echo::default_max_size;
    std::uint32_t depth = 64;
    polling_mode mode = polling_mode::events;
    std::uint32_t max_connections = 1024; // 0: no limit
    std::uint32_t idle_timeout = 60;      // seconds; 0: never
    bool srq = true;                      // receive through one shared receive queue per device
    std::uint32_t srq_depth = 4096;       // their buffers, over all threads
    std::uint32_t threads = 1;
};

class connection;

// One shared receive queue of the device with its registered pool of buffers, and one CQ
// for every connection's sends and receives: registered memory does not grow with connections.
struct shared_receives {
    cq completions;
    std::optional<srq> queue; // dropped at the server's end (retire_shared_receives)
    std::vector<std::byte> pool;
    verbs::memory_region mr;
    std::map<std::uint32_t, connection*> by_qp; // the connections, by the QP number a receive names
    int sending = 0;          // shared loops inside an echo send (the state outlives them)
    bool device_gone = false; // said once: every shared loop ends when the device goes
    shared_receives(io_context& io, channel& ch, const verbs::protection_domain& pd, int cq_entries,
                    std::uint32_t depth, std::uint32_t max_size)
        : completions(ch, cq_options{.entries = cq_entries}),
          queue(std::in_place, io, pd, srq_options{.max_wr = depth}),
          pool(std::size_t{depth} * max_size), mr(pd, pool) {}
};

// What one thread's connections of one device share: its protection domain, completion
// channel, and (unless --no-srq) the shared receives.
struct device_resources {
    verbs::context context;
    verbs::protection_domain pd{context};
    channel completion_channel;
    std::unique_ptr<shared_receives> shared;
    device_resources(io_context& io, verbs::context device, polling_mode mode)
        : context(std::move(device)),
          completion_channel(io, context, channel_options{.mode = mode}) {}
};

struct echo_server;

// One thread's share of the connections: its io_context, its rdma_cm channel (where the ids of
// its connections live: the accept loop migrates them here), its resources per device, and
// its counts. Worker 0 is the main thread, whose channel is the listener's.
struct worker {
    echo_server& server;
    int index = 0;
    io_context* io = nullptr; // set before the accept loop runs, by the worker's thread
    cm_channel* cm = nullptr;
    std::map<ibv_context*, std::unique_ptr<device_resources>> devices;
    std::atomic<int> open{0}; // connections handed to it whose resources are not yet released
    int served = 0;           // what it did (read after its thread ended)
    std::uint64_t messages = 0, bytes = 0;
    // Migrated ids the accept loop handed over, not yet adopted by the worker's thread.
    struct handoff {
        cm_id::in_transit id;
        int number;
    };
    std::mutex inbox_lock;
    std::vector<handoff> inbox;
    std::thread thread; // none for worker 0
    worker(echo_server& server, int index) : server(server), index(index) {}
};

// What the whole server shares: the rdma_cm event channel of the listener, the watch on each
// device's asynchronous events (a port going down, a CQ overrun, a fatal QP error), the
// workers, the stop that SIGINT/SIGTERM requests, and the counts for the log.
struct echo_server {
    echo_server(io_context& io, server_options options) : io(io), options(std::move(options)) {}
    // Never with a thread still running (std::terminate): stops the server and waits for them.
    ~echo_server();
    io_context& io;
    server_options options;
    cm_channel cm{io};
    std::map<ibv_context*, std::unique_ptr<device_events>> device_watches;
    std::vector<std::unique_ptr<worker>> workers;
    std::stop_source stopping;
    std::atomic<int> open{0};        // connections admitted whose resources are not yet freed
    std::uint64_t rejected = 0;      // requests rejected as over --max-connections
    std::atomic<bool> failed{false}; // an exception escaped a task (run_to_end): exit 1
};

// How a connection ended, for its log line.
struct summary {
    std::string why;
    std::uint64_t messages = 0, bytes = 0;
};

// One client's connection: a pool of buffers, its CQ and QP. Every buffer has its own echo
// loop, a coroutine that receives a message into it and sends it back from it, again and
// again; the first failure closes the connection and ends the other loops. With the SRQ (the
// default) the connection has no buffers or CQ of its own: the device's shared_echo_loops receive
// for every connection and echo through echo_shared().
class connection {
  public:
    // Throws std::system_error naming the verb that failed (memory region, CQ, QP).
    connection(worker& owner, device_resources& device, cm_id id);

    // Accepts the client and echoes until the connection is closed. When it returns, no
    // request is owed a completion: the connection may be destroyed.
    task<summary> serve();

    // With the SRQ, for the device's shared loops: a message arrived for this connection; its echo
    // (the await may outlive the connection: look it up again after); what the echo did; a
    // failure that closes the connection (through its own watch, which outlives the close).
    bool closing() const noexcept { return closing_; }
    void received() noexcept { last_message_ = std::chrono::steady_clock::now(); }
    qp::request echo(local_buffer message) noexcept { return qp_.send(message); }
    void echoed(std::uint32_t bytes) noexcept {
        ++summary_.messages;
        summary_.bytes += bytes;
    }
    void fail(std::string why);
    std::string receive_failure(ibv_wc_status status) const {
        return failure(request::receive, status);
    }
    // An echo's failed completion: fail(), or cut_off() for one the client's end may explain.
    void echo_failed(const completion_error& e) {
        if (ended_mid_send(request::echo_send, e.status()))
            cut_off(failure(request::echo_send, e.status()));
        else
            fail(std::string("echo send failed: ") + e.what());
    }

  private:
    enum class request { receive, echo_send };

    task<void> accept();
    task<void> echo_loop(std::uint32_t slot);
    task<void> watch_idle();
    task<void> watch_disconnect();
    task<void> close(std::string why);
    task<void> disconnect();
    std::string failure(request failed, ibv_wc_status status) const;
    bool ended_mid_send(request failed, ibv_wc_status status) const;
    void cut_off(std::string why);
    local_buffer buffer(std::uint32_t slot, std::uint32_t length);
    qp make_qp();

    worker& worker_;
    echo_server& server_;
    device_resources& device_;
    cm_id id_;
    const std::uint32_t max_size_; // bytes of each buffer: the largest message taken
    const std::uint32_t depth_;    // buffers, each with its own echo loop (0 with the SRQ)
    std::vector<std::byte> pool_;  // declared before the QP, so that it outlives it
    std::optional<verbs::memory_region> mr_;
    std::optional<cq> completions_;
    qp qp_;
    summary summary_;
    bool accepted_ = false;
    bool closing_ = false;
    std::stop_source
        ending_; // requested by close() and fail(): ends the idle and disconnect watches
    std::optional<std::string> failure_; // fail()'s reason
    bool cut_off_ = false;  // failure_ is an echo cut off in flight: the client's end, if it came
    bool watching_ = false; // watch_disconnect runs: it closes for a cut_off()
    // With the SRQ: no receive of this connection carries the server's stop, so the stop ends the
    // watches (and watch_disconnect closes the connection).
    struct request_stop_of {
        std::stop_source* source;
        void operator()() const noexcept { source->request_stop(); }
    };
    std::optional<std::stop_callback<request_stop_of>> forward_stop_;
    std::chrono::steady_clock::time_point last_message_ = std::chrono::steady_clock::now();
    std::size_t never_flushed_ = 0; // requests the device never flushed after the close
};

connection::connection(worker& owner, device_resources& device, cm_id id)
    : worker_(owner), server_(owner.server), device_(device), id_(std::move(id)),
      max_size_(server_.options.max_size), depth_(device.shared ? 0 : server_.options.depth),
      pool_(std::size_t{depth_} * max_size_), qp_(make_qp()) {}

// Its own buffers and CQ (--no-srq), or the device's shared receive queue and CQ. A shared CQ
// serves up to --max-connections QPs: their queues together may exceed it, hence the
// overcommit (a QP error flushes at most its --depth sends).
qp connection::make_qp() {
    const std::uint32_t sends = server_.options.depth;
    if (device_.shared) {
        shared_receives& shared = *device_.shared;
        return id_.make_qp(
            device_.pd, shared.completions, shared.completions,
            verbs::qp_caps{.max_send_wr = sends, .max_recv_wr = 0},
            qp_options{.allow_cq_overcommit = true, .shared_receive_queue = &*shared.queue});
    }
    mr_.emplace(device_.pd, pool_);
    completions_.emplace(device_.completion_channel,
                         cq_options{.entries = static_cast<int>(2 * depth_)});
    return id_.make_qp(device_.pd, *completions_, *completions_,
                       verbs::qp_caps{.max_send_wr = sends, .max_recv_wr = depth_});
}

task<summary> connection::serve() {
    if (device_.shared) {
        device_.shared->by_qp[qp_.qp_num()] = this;
        forward_stop_.emplace(server_.stopping.get_token(), request_stop_of{&ending_});
    }
    std::vector<task<void>> work;
    for (std::uint32_t slot = 0; slot < depth_; ++slot)
        work.push_back(echo_loop(slot));
    work.push_back(watch_idle());
    work.push_back(watch_disconnect());
    // Last: when_all starts its tasks in order, each up to its first co_await, so every
    // buffer's receive is posted before the client may send.
    work.push_back(accept());
    co_await when_all(std::move(work));
    if (device_.shared) device_.shared->by_qp.erase(qp_.qp_num());
    if (never_flushed_ > 0)
        summary_.why +=
            "; " + std::to_string(never_flushed_) + " request(s) never flushed by the device";
    co_return summary_;
}

// Tells the client what the server takes (in the accept's private data), then lets it send.
task<void> connection::accept() {
    const echo::server_hello hello{htonl(max_size_), htonl(depth_)};
    const wait_options bound(10s);
    const result<void> answered =
        co_await nothrow(id_.accept_connection(std::as_bytes(std::span(&hello, 1)), bound));
    if (!answered) {
        co_await close(answered.what());
        co_return;
    }
    accepted_ = true;
    if (closing_) co_await disconnect(); // closed (by the server's stop) while accepting
}

// One buffer's life: receive a message into it, send it back from it, repeat. Each co_await
// resumes on the completion of its own request, so the buffer is free again when the send's
// await returns.
task<void> connection::echo_loop(std::uint32_t slot) {
    std::string why;
    bool explainable = false; // by the client's end of the connection (below)
    request current = request::receive;
    try {
        while (!closing_) {
            current = request::receive;
            const ibv_wc received = co_await qp_.recv(buffer(slot, max_size_),
                                                      wait_options(server_.stopping.get_token()));
            if (closing_) break;
            last_message_ = std::chrono::steady_clock::now();
            current = request::echo_send;
            co_await qp_.send(buffer(slot, received.byte_len));
            ++summary_.messages;
            summary_.bytes += received.byte_len;
        }
    } catch (const connection_reset&) {
        // Flushed by a connection end the server did not cause (close() keeps the server's own
        // reason when it closed first): on iWARP the QP fails as the client's TCP stream ends,
        // before the DISCONNECTED event says so.
        why = "the client disconnected";
    } catch (const completion_error& e) {
        why = failure(current, e.status());
        // An echo cut off in flight (iWARP), or a flush another request's failure caused.
        explainable = ended_mid_send(current, e.status()) || e.status() == IBV_WC_WR_FLUSH_ERR;
    } catch (const std::system_error& e) {
        // The bounded flush (qp_options::flush_timeout) ended it: the device never flushed it.
        if (closing_ && e.code() == std::errc::io_error) ++never_flushed_;
        why = e.what(); // ibv_post_*, named with its errno; or cancelled by the server's stop
        // A post the QP refused because it already failed (siw: ENOTCONN once the client's
        // stream ended).
        explainable = !closing_ && e.code() != std::errc::operation_canceled &&
                      e.code() != std::errc::io_error;
    }
    // What the client's end may explain: while the disconnect watch runs, it closes and names
    // it (the client's end if DISCONNECTED follows soon); once it has seen that end, the end is
    // the reason.
    if (explainable && !closing_) {
        if (watching_) {
            cut_off(std::move(why));
            co_return;
        }
        if (id_.is_disconnected()) why = "the client disconnected";
    }
    co_await close(std::move(why));
}

// --idle-timeout: closes the connection once no message arrived for that long (counted from
// the last message received, or from the request before the first).
task<void> connection::watch_idle() {
    const std::chrono::seconds limit(server_.options.idle_timeout);
    if (limit.count() == 0) co_return;
    while (!closing_) {
        const auto quiet = std::chrono::steady_clock::now() - last_message_;
        if (quiet >= limit) break;
        const result<void> slept =
            co_await nothrow(sleep_for(*worker_.io, limit - quiet, ending_.get_token()));
        if (!slept) co_return; // closed for another reason
    }
    co_await close("idle: no message for " + std::to_string(limit.count()) + " s (--idle-timeout " +
                   std::to_string(limit.count()) + ")");
}

// Awaits the client's disconnect (DREQ, or its CM gone) alongside the completions: the QP is
// then in the error state, but only qp::to_error() arms the bound on its flushes, so a DREQ
// whose flushes never come still closes the connection, within flush_timeout. With the SRQ
// it also closes the connection for a failure the shared loops reported (fail()).
task<void> connection::watch_disconnect() {
    struct watch_scope { // watching_ while this runs, however it ends
        bool& flag;
        explicit watch_scope(bool& f) : flag(f) { flag = true; }
        ~watch_scope() { flag = false; }
        watch_scope(const watch_scope&) = delete;
        watch_scope& operator=(const watch_scope&) = delete;
    } const scope(watching_);
    bool gone = true;
    try {
        co_await id_.disconnected(wait_options(ending_.get_token()));
    } catch (const std::system_error&) {
        gone = false; // closed, or failed, first (operation_canceled)
    }
    if (!gone && cut_off_ && !closing_) {
        // An echo cut off in flight (iWARP): the client's end if its DISCONNECTED comes soon.
        const wait_options grace(2s);
        if ((co_await nothrow(id_.disconnected(grace))).ok()) {
            co_await close("the client disconnected (a request was cut off in flight)");
            co_return;
        }
    }
    if (gone && !device_.shared) {
        // Moving the QP to error arms the bound on its flushes, so the echo loops end even if
        // the device never flushes (siw does not flush a receive posted after the error).
        std::string failed = "the client disconnected";
        try {
            qp_.to_error();
        } catch (const std::exception& e) {
            failed += std::string("; ") + e.what();
        }
        // Its own receives say why first: a failure the client caused (an oversized message)
        // sits in the CQ before the flushes, and is delivered within this turn; one turn later
        // the disconnect is the reason (before: the loops named it, and with --depth 1 a send
        // cut off after DISCONNECTED left the connection closed by nobody).
        co_await worker_.io->schedule();
        co_await close(std::move(failed));
        co_return;
    }
    if (gone && !failure_) {
        // The shared loops may hold this connection's failure from the same loop turn (the
        // client disconnects because of it: an oversized message's completion comes before
        // its DREQ): one turn later, the failure is named instead.
        co_await worker_.io->schedule();
        // An echo cut off meanwhile is explained by the disconnect seen first.
        if (!failure_ || cut_off_) co_await close("the client disconnected");
    }
    if (!closing_ && (failure_ || server_.stopping.stop_requested())) {
        // Named, not a ?: inside the co_await: GCC 12 destroys such a temporary twice.
        std::string why = failure_ ? *failure_ : std::string("the server is shutting down");
        co_await close(std::move(why));
    }
}

void connection::fail(std::string why) {
    if (closing_ || failure_) return;
    failure_ = std::move(why);
    ending_.request_stop();
}

// iWARP: a send the device was transmitting when the client's end of the connection came
// completes with LOC_QP_OP_ERR, not a flush (siw; README, iWARP notes). siw gives that status to
// any failed send too, so it is the client's end only if DISCONNECTED follows (cut_off()).
bool connection::ended_mid_send(request failed, ibv_wc_status status) const {
    return failed == request::echo_send && status == IBV_WC_LOC_QP_OP_ERR &&
           id_.native()->verbs->device->transport_type == IBV_TRANSPORT_IWARP;
}

// fail(), for a failure that the client's end of the connection may explain: the disconnect
// watch then waits a moment for DISCONNECTED and names whichever it was.
void connection::cut_off(std::string why) {
    if (closing_ || failure_) return;
    cut_off_ = true;
    fail(std::move(why));
}

// What a failed completion says about the connection.
std::string connection::failure(request failed, ibv_wc_status status) const {
    if (status == IBV_WC_WR_FLUSH_ERR && id_.is_disconnected()) return "the client disconnected";
    // A receive too small for the message: LOC_LEN_ERR, or LOC_QP_OP_ERR on rxe.
    if (failed == request::receive &&
        (status == IBV_WC_LOC_LEN_ERR || status == IBV_WC_LOC_QP_OP_ERR))
        return "a message larger than " + std::to_string(max_size_) +
               " bytes (receive failed: " + ibv_wc_status_str(status) + ")";
    return std::string(failed == request::receive ? "receive" : "echo send") +
           " failed: " + ibv_wc_status_str(status);
}

// Closes the connection once, for the first reason given (or the server's shutdown): tells
// the client, and moves the QP to the error state, so that every request still posted ends
// with a flush, or after qp_options::flush_timeout (5 s) if the device never delivers it
// (Soft-RoCE on Linux 6.1 never flushes a send that was waiting for the peer's ACK).
task<void> connection::close(std::string why) {
    if (closing_) co_return;
    closing_ = true;
    ending_.request_stop();
    summary_.why =
        server_.stopping.stop_requested() ? "the server is shutting down" : std::move(why);
    if (accepted_) co_await disconnect();
    try {
        qp_.to_error(); // also after rdma_disconnect, which the qp does not see: arms the bound
    } catch (const std::exception& e) {
        summary_.why += std::string("; ") + e.what();
    }
}

// rdma_disconnect: the QP goes to the error state and the client learns it.
task<void> connection::disconnect() {
    try {
        co_await id_.disconnect(wait_options(2s));
    } catch (const std::exception&) {
        // The client is gone without a word: the flush comes all the same.
    }
}

local_buffer connection::buffer(std::uint32_t slot, std::uint32_t length) {
    return local_buffer(*mr_, std::span(pool_).subspan(std::size_t{slot} * max_size_, length));
}

// Serves one connection, on its worker's thread, from its accept to its log line.
task<void> serve(worker& owner, device_resources& device, cm_id id, int number) {
    echo_server& server = owner.server;
    const std::string peer = echo::text_of(rdma_get_peer_addr(id.native()));
    summary result; // (the opens were counted by the accept loop, which admitted it)
    try {
        connection client(owner, device, std::move(id));
        result = co_await client.serve();
    } catch (const std::exception& e) {
        result.why = e.what();
    }
    ++owner.served;
    owner.messages += result.messages;
    owner.bytes += result.bytes;
    const int open = --server.open;
    const std::string thread =
        server.options.threads > 1 ? " (thread " + std::to_string(owner.index) + ")" : "";
    std::printf("echo_server: connection %d from %s closed (%s) after %llu messages, %llu bytes; "
                "its resources released%s; %d open\n",
                number, peer.c_str(), result.why.c_str(),
                static_cast<unsigned long long>(result.messages),
                static_cast<unsigned long long>(result.bytes), thread.c_str(), open);
    std::fflush(stdout);
    --owner.open; // last: the worker's end waits for it
}

// Logs the device's asynchronous events until the server stops. The runtime has already
// routed each one to the object it names, on whichever thread owns it (a CQ overrun fails that
// CQ, a fatal QP error flushes that QP), so the connection concerned ends on its own.
task<void> log_device_events(echo_server& server, device_events& watch, std::string name) {
    for (;;) {
        async_event event;
        try {
            event = co_await watch.next(wait_options(server.stopping.get_token()));
        } catch (const std::system_error&) {
            co_return; // shutting down
        }
        std::printf("echo_server: device %.*s: %s%s\n", static_cast<int>(name.size()), name.data(),
                    event.name(), event.routed ? " (its connection is closed)" : "");
        std::fflush(stdout);
    }
}

// One buffer of the device's shared pool. Its receive may be taken by any connection's
// QP (the completion names it); the message is echoed from the buffer on that connection, then
// the buffer is posted again. Ends when the shared queue goes (its receive is flushed with no QP
// named), at the server's end.
task<void> shared_echo_loop(device_resources& device, std::uint32_t slot, std::uint32_t size) {
    // Lives until the server's end, after every shared loop (retire_shared_receives drops only
    // the queue; the flushes of its last receives may name QPs: by_qp must still be there).
    shared_receives& shared = *device.shared;
    const auto buffer = [&](std::uint32_t length) {
        return local_buffer(shared.mr,
                            std::span(shared.pool).subspan(std::size_t{slot} * size, length));
    };
    const auto find = [&](std::uint32_t qp_num) -> connection* {
        auto it = shared.by_qp.find(qp_num);
        return it == shared.by_qp.end() ? nullptr : it->second;
    };
    for (;;) {
        ibv_wc received{};
        std::optional<completion_error> failed;
        try {
            received = co_await shared.queue->recv(buffer(size));
        } catch (const completion_error& e) {
            failed = e;
        } catch (const std::system_error& e) {
            const bool gone = e.code() == std::errc::no_such_device;
            if (!gone || !shared.device_gone)
                std::fprintf(stderr, "echo_server: %s\n", e.what()); // ibv_post_srq_recv
            shared.device_gone = shared.device_gone || gone;
            co_return;
        }
        if (failed) {
            if (failed->qp_num() == 0) co_return; // the shared queue went: the server's end
            if (connection* c = find(failed->qp_num()))
                c->fail(c->receive_failure(failed->status()));
            continue; // that connection's flush, or its oversized message: the buffer goes on
        }
        connection* c = find(received.qp_num);
        if (c == nullptr || c->closing()) continue; // its connection is gone or going: dropped
        c->received();
        std::string echo_failed;
        std::optional<completion_error> cut_off;
        ++shared.sending;
        try {
            ibv_wc sent = co_await c->echo(buffer(received.byte_len));
            (void)sent;
        } catch (const connection_reset&) {
            // Flushed by a connection end the server did not cause (fail() ignores a closing
            // connection): on iWARP the QP fails as the client's TCP stream ends, before the
            // DISCONNECTED event says so.
            echo_failed = "the client disconnected";
        } catch (const completion_error& e) {
            cut_off = e; // named by its connection, if it is still there
        } catch (const std::exception& e) {
            echo_failed = std::string("echo send failed: ") + e.what();
        }
        --shared.sending;
        // The connection may have closed (and gone) meanwhile: look it up again.
        if (connection* again = find(received.qp_num)) {
            if (cut_off)
                again->echo_failed(*cut_off);
            else if (echo_failed.empty())
                again->echoed(received.byte_len);
            else
                again->fail(std::move(echo_failed));
        }
    }
}

// A worker's life until the server's end: it keeps the worker's io_context running until the
// stop, then waits until every connection handed to the worker is gone (their QPs too) and no
// shared loop is inside a send, and drops each shared receive queue; its last owner (the last
// QP state, once its flushes came) flushes the receives still posted, which ends the shared
// loops, and io_context::run() returns. The rest of the shared receives goes with the worker.
task<void> retire(worker& owner) {
    try {
        for (;;)
            co_await sleep_for(*owner.io, std::chrono::hours(1), owner.server.stopping.get_token());
    } catch (const std::system_error&) {
        // the stop: SIGINT, SIGTERM, or the accept loop failing
    }
    const auto busy = [&] {
        if (owner.open > 0) return true;
        for (auto& [native, device] : owner.devices)
            if (device->shared && device->shared->sending > 0) return true;
        return false;
    };
    while (busy())
        co_await sleep_for(*owner.io, std::chrono::milliseconds(10));
    for (auto& [native, device] : owner.devices)
        if (device->shared) device->shared->queue.reset();
}

// The worker's PD, completion channel and shared receives for `context`, made at its first
// connection on that device (on the worker's thread). Throws what a verb threw (e.g. ibv_reg_mr
// ENOMEM under RLIMIT_MEMLOCK), having kept nothing: the next connection tries again.
device_resources& resources_for(worker& owner, verbs::context context) {
    if (auto found = owner.devices.find(context.native()); found != owner.devices.end())
        return *found->second;
    const server_options& options = owner.server.options;
    ibv_context* const native = context.native();
    auto resources =
        std::make_unique<device_resources>(*owner.io, std::move(context), options.mode);
    std::uint32_t depth = 0;
    if (options.srq) {
        // This thread's share of the buffers; every connection's sends (--depth each) and
        // the shared receives on one CQ, within what the device allows.
        depth = std::max<std::uint32_t>(options.srq_depth / options.threads, 1);
        ibv_device_attr attr{};
        const int max_cqe =
            ibv_query_device(resources->context.native(), &attr) == 0 ? attr.max_cqe : 4096;
        const std::uint64_t want =
            std::uint64_t{depth} +
            std::uint64_t{options.depth} * std::max<std::uint32_t>(options.max_connections, 64);
        const int entries = static_cast<int>(std::min<std::uint64_t>(want, max_cqe));
        resources->shared =
            std::make_unique<shared_receives>(*owner.io, resources->completion_channel,
                                              resources->pd, entries, depth, options.max_size);
    }
    // Kept only whole: kept without its shared receives, it would serve as --no-srq.
    device_resources& made = *owner.devices.emplace(native, std::move(resources)).first->second;
    for (std::uint32_t slot = 0; slot < depth; ++slot)
        owner.io->spawn(shared_echo_loop(made, slot, options.max_size));
    return made;
}

// The main thread logs each device's asynchronous events (one watch per device: the threads'
// QPs are all on librdmacm's one context of it).
void watch_device(echo_server& server, const verbs::context& device) {
    auto& watch = server.device_watches[device.native()];
    if (!watch) {
        watch = std::make_unique<device_events>(server.io, device);
        server.io.spawn(log_device_events(server, *watch, std::string(device.name())));
    }
}

// A request admitted to `owner` that it cannot serve: its resources for the device could not
// be made (resources_for). Rejected with the reason, which the client prints, and logged; it is
// no longer counted. The server goes on: a later request may find the resources it needs.
void refuse(worker& owner, cm_id& request, const std::string& failure) {
    const std::string why = "server error: " + failure;
    const std::string thread = owner.server.options.threads > 1
                                   ? " (thread " + std::to_string(owner.index) + ")"
                                   : std::string();
    std::printf("echo_server: request from %s rejected (%s)%s\n",
                echo::text_of(rdma_get_peer_addr(request.native())).c_str(), why.c_str(),
                thread.c_str());
    std::fflush(stdout);
    try {
        request.reject(echo::reject_data(why));
    } catch (const std::exception& e) {
        std::fprintf(stderr, "echo_server: %s\n", e.what()); // the request goes anyway
    }
    --owner.server.open;
    --owner.open;
}

// On the worker's thread: adopts the ids the accept loop migrated to it and serves them.
void adopt_handed_over(worker& owner) {
    std::vector<worker::handoff> taken;
    {
        std::lock_guard lock(owner.inbox_lock);
        taken.swap(owner.inbox);
    }
    for (worker::handoff& h : taken) {
        std::optional<cm_id> id;
        try {
            id.emplace(*owner.cm, std::move(h.id));
        } catch (const std::exception& e) {
            std::fprintf(stderr, "echo_server: connection %d: %s\n", h.number, e.what());
            --owner.server.open;
            --owner.open;
            continue;
        }
        try {
            device_resources& device = resources_for(owner, id->device());
            owner.io->spawn(serve(owner, device, std::move(*id), h.number));
        } catch (const std::exception& e) {
            refuse(owner, *id, e.what());
        }
    }
}

// Admits a request: serves it on the thread with the fewest connections; on another thread
// than this one, the id migrates to that thread's rdma_cm channel first.
void admit(echo_server& server, cm_id request, verbs::context device, int number) {
    worker* least = server.workers.front().get();
    for (auto& w : server.workers)
        if (w->open < least->open) least = w.get();
    ++server.open;
    ++least->open;
    if (least->index == 0) {
        try {
            device_resources& resources = resources_for(*least, std::move(device));
            server.io.spawn(serve(*least, resources, std::move(request), number));
        } catch (const std::exception& e) {
            refuse(*least, request, e.what());
        }
        return;
    }
    try {
        worker::handoff h{std::move(request).migrate(*least->cm), number};
        {
            std::lock_guard lock(least->inbox_lock);
            least->inbox.push_back(std::move(h));
        }
        least->io->post([least] { adopt_handed_over(*least); });
    } catch (const std::exception& e) {
        std::fprintf(stderr, "echo_server: connection %d not handed to thread %d: %s\n", number,
                     least->index, e.what());
        --server.open;
        --least->open;
    }
}

// Answers one request, without suspending: rejected when it came on another device than
// --device, or when --max-connections are open; else admitted as connection `number`. Returns
// whether it was admitted.
bool answer(echo_server& server, cm_id request, int number) {
    const std::uint32_t limit = server.options.max_connections;
    verbs::context device = request.device();
    if (!server.options.device.empty() && device.name() != server.options.device) {
        request.reject(echo::reject_data("not served on device " + std::string(device.name())));
        return false;
    }
    if (limit != 0 && server.open.load() >= static_cast<int>(limit)) {
        const std::string why =
            "busy: " + std::to_string(limit) + " connections, the server's limit";
        ++server.rejected;
        std::printf("echo_server: request from %s rejected (%s; --max-connections %u)\n",
                    echo::text_of(rdma_get_peer_addr(request.native())).c_str(), why.c_str(),
                    limit);
        std::fflush(stdout);
        try {
            request.reject(echo::reject_data(why));
        } catch (const std::exception& e) {
            std::fprintf(stderr, "echo_server: %s\n", e.what()); // the request goes anyway
        }
        return false;
    }
    watch_device(server, device);
    admit(server, std::move(request), std::move(device), number);
    return true;
}

// The accept backlog stays bounded. The kernel holds at most the listen backlog (128, given to
// rdma_listen) of requests that this process has not read yet, and refuses the rest. The
// runtime's cm channel reads every pending event at once into the listener's queue, from
// which this loop takes each request at its next turn: the loop awaits nothing but accept()
// (reject, resources_for and spawn do not suspend), so that queue holds at most one read's
// worth. A request is answered at once: admitted (its connection is spawned, and counted in
// server.open until its resources are released), or rejected when --max-connections are open.
// The request goes to the thread serving the fewest connections (admit), which rejects it with
// the reason if it cannot make its resources for the device (refuse).
// Nothing waits in a queue of ours for a connection to close.
task<void> accept_loop(echo_server& server, cm_id& listener) {
    for (int number = 1;;) {
        std::optional<cm_id> request;
        try {
            request.emplace(co_await listener.accept(wait_options(server.stopping.get_token())));
        } catch (const std::system_error& e) {
            if (e.code() != std::errc::operation_canceled) {
                // The listener failed (ENODEV: its device went away): the server stops, and
                // exits non-zero.
                std::fprintf(stderr, "echo_server: %s%s\n", e.what(),
                             e.code() == std::errc::no_such_device ? " (the RDMA device went away)"
                                                                   : "");
                server.failed = true;
                server.stopping.request_stop();
            }
            co_return;
        }
        // The stop won the race with this accept: nothing more is admitted (a worker may
        // have ended already). Dropping the request rejects it.
        if (server.stopping.stop_requested()) co_return;
        // A failure here is this request's alone (dropped, it is rejected): the loop goes on.
        const std::string peer = echo::text_of(rdma_get_peer_addr(request->native()));
        try {
            if (answer(server, std::move(*request), number)) ++number;
        } catch (const std::exception& e) {
            std::fprintf(stderr, "echo_server: request from %s dropped: %s\n", peer.c_str(),
                         e.what());
        }
    }
}

// The first SIGINT or SIGTERM stops the server; the watch also ends when the server stops for
// another reason (its stop cancels the wait).
task<void> watch_signals(echo_server& server, signal_set& signals) {
    int signal_number = 0;
    try {
        signal_number = co_await signals.wait(wait_options(server.stopping.get_token()));
    } catch (const std::system_error& e) {
        if (e.code() != std::errc::operation_canceled) throw;
        co_return;
    }
    std::printf("echo_server: %s: closing %d connection(s)\n", strsignal(signal_number),
                server.open.load());
    std::fflush(stdout);
    server.stopping.request_stop();
}

server_options parse(int argc, char** argv) {
    server_options options;
    if (const char* device = std::getenv("RINGVERBS_DEVICE")) options.device = device;
    for (int i = 1; i < argc; ++i) {
        const std::string flag = argv[i];
        if (flag == "--help" || flag == "-h") throw echo::usage_error("");
        if (flag == "--no-srq") {
            options.srq = false;
            continue;
        }
        if (i + 1 >= argc) throw echo::usage_error(flag + " needs a value (or is unknown)");
        const std::string value = argv[++i];
        if (flag == "--address")
            options.address = value;
        else if (flag == "--port")
            options.port = static_cast<std::uint16_t>(echo::number(flag, value, 1, 65535));
        else if (flag == "--device")
            options.device = value;
        else if (flag == "--max-size")
            options.max_size = static_cast<std::uint32_t>(echo::number(flag, value, 1, 1u << 30));
        else if (flag == "--depth")
            options.depth = static_cast<std::uint32_t>(echo::number(flag, value, 1, 4096));
        else if (flag == "--mode")
            options.mode = echo::mode_of(value);
        else if (flag == "--max-connections")
            options.max_connections =
                static_cast<std::uint32_t>(echo::number(flag, value, 0, 1u << 20));
        else if (flag == "--threads")
            options.threads = static_cast<std::uint32_t>(echo::number(flag, value, 1, 64));
        else if (flag == "--srq-depth")
            options.srq_depth = static_cast<std::uint32_t>(echo::number(flag, value, 1, 1u << 20));
        else if (flag == "--idle-timeout")
            options.idle_timeout =
                static_cast<std::uint32_t>(echo::number(flag, value, 0, 1u << 30));
        else
            throw echo::usage_error("unknown option " + flag);
    }
    return options;
}

// The listening id, announced on stdout. Throws "cannot listen on ADDRESS: ..." (e.g. address in
// use).
cm_id listen_on(echo_server& server, const sockaddr_storage& address) {
    const auto* at = reinterpret_cast<const sockaddr*>(&address);
    cm_id listener(server.cm);
    try {
        listener.listen(at, 128);
    } catch (const std::system_error& e) {
        throw std::runtime_error("cannot listen on " + echo::text_of(at) + ": " + e.what());
    }
    // Bound to one device's address: its watch, and the main thread's PD and channel now, so
    // the first client waits less.
    if (listener.native()->verbs != nullptr) {
        watch_device(server, listener.device());
        resources_for(*server.workers.front(), listener.device());
    }
    const server_options& options = server.options;
    const std::string most =
        options.max_connections ? std::to_string(options.max_connections) : "no limit";
    const std::string idle =
        options.idle_timeout ? std::to_string(options.idle_timeout) + " s" : "never";
    const std::uint32_t per_thread =
        std::max<std::uint32_t>(options.srq_depth / options.threads, 1);
    const std::string receives =
        options.srq
            ? "a shared receive queue of " + std::to_string(per_thread) +
                  " buffers per device and thread (" +
                  std::to_string(std::uint64_t{per_thread} * options.threads * options.max_size >>
                                 10) +
                  " KiB registered, whatever the connections)"
            : std::to_string(options.depth) + " receives per connection (" +
                  std::to_string(std::uint64_t{options.depth} * options.max_size >> 10) +
                  " KiB registered each)";
    std::printf("echo_server: listening on %s (messages up to %u bytes, %s, %s mode; connections "
                "at most %s, closed when idle %s; %u thread(s))\n",
                echo::text_of(at).c_str(), options.max_size, receives.c_str(),
                to_string(options.mode), most.c_str(), idle.c_str(), options.threads);
    std::fflush(stdout);
    return listener;
}

// Runs a thread's io_context until its work is done: at the server's end, once every connection
// is closed and every task has ended. An exception escaping a task (none should: a request's or
// a connection's failure is handled where it happens) is logged and stops the server, which
// still ends in order: leaving run() for good would destroy the tasks' objects (CQs, channels,
// SRQ states) after their io_context, or while their coroutines are still suspended.
void run_to_end(echo_server& server, io_context& io, int thread) {
    for (;;) {
        try {
            io.run();
            return;
        } catch (const std::exception& e) {
            std::fprintf(stderr, "echo_server: thread %d: %s; stopping\n", thread, e.what());
        } catch (...) {
            std::fprintf(stderr, "echo_server: thread %d: unknown exception; stopping\n", thread);
        }
        server.failed = true;
        server.stopping.request_stop();
    }
}

// Starts workers 1..N-1, each on its own thread with its own io_context and rdma_cm channel,
// running until the server's end (retire). Returns once every one is ready to take
// connections. Throws what a worker's setup threw (~echo_server joins the others).
void start_workers(echo_server& server) {
    for (std::uint32_t i = 1; i < server.options.threads; ++i) {
        auto w = std::make_unique<worker>(server, static_cast<int>(i));
        std::promise<void> ready;
        std::future<void> started = ready.get_future();
        w->thread = std::thread([&owner = *w, &ready] {
            std::optional<io_context> io;
            std::optional<cm_channel> cm;
            try {
                io.emplace();
                cm.emplace(*io);
                owner.io = &*io;
                owner.cm = &*cm;
                io->spawn(retire(owner));
            } catch (...) {
                ready.set_exception(std::current_exception());
                return;
            }
            ready.set_value(); // (`ready` is gone once the main thread goes on)
            run_to_end(owner.server, *io, owner.index);
            owner.devices.clear(); // on this thread, before its channel and ring go
        });
        server.workers.push_back(std::move(w));
        started.get();
    }
}

// Waits for the workers' threads (after the main thread's ring ran dry: the server stopped).
void join_workers(echo_server& server) {
    for (auto& w : server.workers)
        if (w->thread.joinable()) w->thread.join();
}

echo_server::~echo_server() {
    stopping.request_stop();
    join_workers(*this);
}

} // namespace

int main(int argc, char** argv) {
    server_options options;
    if (auto status = echo::parse_options("echo_server", usage, parse, argc, argv, options))
        return *status;
    try {
        echo::check_device(options.device);
        const sockaddr_storage address = echo::address_of(options.address, options.port);
        io_context io;
        // Blocked in this thread before the workers' threads start, which inherit the mask.
        signal_set signals(io, {SIGINT, SIGTERM});
        echo_server server(io, options);
        server.workers.push_back(std::make_unique<worker>(server, 0));
        server.workers.front()->io = &io;
        server.workers.front()->cm = &server.cm;
        // From here on, a failure to start still lets the main thread's tasks end (the device
        // watch, the shared receive loops: retire drops their queue) before their objects go.
        io.spawn(retire(*server.workers.front()));
        std::optional<cm_id> listener;
        try {
            listener.emplace(listen_on(server, address));
            start_workers(server);
        } catch (...) {
            server.stopping.request_stop();
            run_to_end(server, io, 0);
            throw;
        }
        io.spawn(watch_signals(server, signals));
        io.spawn(accept_loop(server, *listener));
        // Until a signal: the accept loop, then every connection, then the signal watch end;
        // then the other threads, once their connections are gone.
        run_to_end(server, io, 0);
        join_workers(server);
        int served = 0;
        std::uint64_t messages = 0, bytes = 0;
        for (auto& w : server.workers) {
            served += w->served;
            messages += w->messages;
            bytes += w->bytes;
        }
        std::printf(
            "echo_server: shut down: %d connection(s) served, %llu messages, %llu bytes echoed, "
            "%llu request(s) rejected as busy\n",
            served, static_cast<unsigned long long>(messages),
            static_cast<unsigned long long>(bytes),
            static_cast<unsigned long long>(server.rejected));
        return server.failed ? 1 : 0;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "echo_server: %s\n", e.what());
        return 1;
    }
}
