// echo_server: one client's connection. With --no-srq it has its own buffers, CQ and one echo
// loop per buffer; with the shared receive queue (the default) the device's shared loops echo
// for it (shared_receives.cpp) and it watches the client's end, the idle timeout and closing.
#include "connection.hpp"

namespace echo {

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

namespace {

// Sets a flag for its lifetime.
struct raised_while_alive {
    bool& flag;
    explicit raised_while_alive(bool& f) : flag(f) { flag = true; }
    ~raised_while_alive() { flag = false; }
    raised_while_alive(const raised_while_alive&) = delete;
    raised_while_alive& operator=(const raised_while_alive&) = delete;
};

// Counts itself in `count` for its lifetime.
struct counted_while_alive {
    std::uint32_t& count;
    explicit counted_while_alive(std::uint32_t& c) : count(c) { ++count; }
    ~counted_while_alive() { --count; }
    counted_while_alive(const counted_while_alive&) = delete;
    counted_while_alive& operator=(const counted_while_alive&) = delete;
};

} // namespace

// One buffer's life: receive a message into it, send it back from it, repeat. Each co_await
// resumes on the completion of its own request, so the buffer is free again when the send's
// await returns.
task<void> connection::echo_loop(std::uint32_t slot) {
    const counted_while_alive running(loops_running_);
    std::exception_ptr failed;
    request current = request::receive;
    while (!closing_) {
        current = request::receive;
        const result<ibv_wc> received = co_await nothrow(
            qp_.recv(buffer(slot, max_size_), wait_options(server_.stopping.get_token())));
        failed = received.exception();
        if (failed || closing_) break;
        last_message_ = std::chrono::steady_clock::now();
        current = request::echo_send;
        failed = (co_await nothrow(qp_.send(buffer(slot, received->byte_len)))).exception();
        if (failed) break;
        ++summary_.messages;
        summary_.bytes += received->byte_len;
    }
    if (!failed) {
        co_await close("");
        co_return;
    }
    loop_end end = ended_by(failed, current);
    // What the client's end may explain: while the disconnect watch runs, it closes and names
    // it (the client's end if DISCONNECTED follows soon); once it has seen that end, the end is
    // the reason.
    if (end.explainable && !closing_) {
        if (watching_) {
            cut_off(std::move(end.why), end.grace);
            co_return;
        }
        if (id_.is_disconnected()) end.why = "the client disconnected";
    }
    co_await close(std::move(end.why));
}

connection::loop_end connection::ended_by(const std::exception_ptr& error, request current) {
    try {
        std::rethrow_exception(error);
    } catch (const connection_reset&) {
        // Flushed by a connection end the server did not cause (close() keeps the server's own
        // reason when it closed first): on iWARP the QP fails as the client's TCP stream ends,
        // before the DISCONNECTED event says so.
        return {"the client disconnected", false};
    } catch (const completion_error& e) {
        // A failed echo send, or a flush another request's failure caused (cut_off()).
        return {failure(current, e.status()),
                current == request::echo_send || e.status() == IBV_WC_WR_FLUSH_ERR,
                grace_after(e.status())};
    } catch (const std::system_error& e) {
        // The bounded flush (qp_options::flush_timeout) ended it: the device never flushed it.
        // Counted once the connection is closing or the client's disconnect was seen (--no-srq:
        // watch_disconnect waits for the loops then, and the disconnect is the reason).
        const bool never_flushed = e.code() == std::errc::io_error;
        if ((closing_ || disconnect_seen_) && never_flushed) ++never_flushed_;
        // ibv_post_*, named with its errno; or cancelled by the server's stop. A post the QP
        // refused because it already failed (siw: ENOTCONN once the client's stream ended) is
        // explainable.
        return {e.what(),
                !closing_ && e.code() != std::errc::operation_canceled &&
                    (!never_flushed || disconnect_seen_),
                grace_after(e.code() == std::errc::not_connected)};
    }
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
    const raised_while_alive scope(watching_); // watching_ while this runs, however it ends
    const result<void> ended =
        co_await nothrow(id_.disconnected(wait_options(ending_.get_token())));
    const bool gone = ended.ok(); // else closed, or failed, first (operation_canceled)
    std::string watch_failed; // the CM events failed (not ended by us): nothing else would close
    if (ended.error() == std::errc::no_such_device)
        watch_failed = "the RDMA device went away";
    else if (!gone && ended.error() != std::errc::operation_canceled)
        watch_failed = std::string("its connection events failed: ") + ended.what();
    if (!watch_failed.empty() && !closing_) {
        co_await close(std::move(watch_failed));
        co_return;
    }
    if (!gone && cut_off_ && !closing_) {
        // An echo cut off in flight (a client killed mid-stream; on iWARP its QP fails as the
        // stream ends): the client's end if its DISCONNECTED comes within the grace
        // (grace_after). The server's stop ends it.
        const wait_options grace(grace_, server_.stopping.get_token());
        if ((co_await nothrow(id_.disconnected(grace))).ok()) {
            co_await close("the client disconnected (a request was cut off in flight)");
            co_return;
        }
    }
    if (gone && !device_.shared) {
        // Moving the QP to error arms the bound on its flushes, so the echo loops end even if
        // the device never flushes (siw does not flush a receive posted after the error).
        std::string failed = "the client disconnected";
        disconnect_seen_ = true;
        try {
            qp_.to_error();
        } catch (const std::exception& e) {
            failed += std::string("; ") + e.what();
        }
        // Its own receives say why first: a failure the client caused (an oversized message)
        // sits in the CQ before the flushes, and its loop names it; once every loop ended (with
        // the flushes, which to_error() bounded) the disconnect is the reason. Before: one loop
        // turn, which on a loaded host came before the CQ's event was read (echo_test's
        // oversized on rxe, once: "the client disconnected"); and before that the loops named
        // it, and with --depth 1 a send cut off after DISCONNECTED left the connection closed
        // by nobody. A request the device never flushes ends at flush_timeout (5 s) as
        // explainable (disconnect_seen_), counted in the summary, not as the reason.
        const auto until = std::chrono::steady_clock::now() + 6s; // flush_timeout 5 s, and 1
        while (loops_running_ > 0 && !closing_ && std::chrono::steady_clock::now() < until)
            co_await sleep_for(*worker_.io, 5ms);
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

// fail(), for a failure that the client's end of the connection may explain: the disconnect
// watch then waits a moment for DISCONNECTED and names whichever it was. Every failed echo send
// is one: a client killed mid-stream fails the sends in flight with REM_OP_ERR (its QP in
// error while its kernel tears it down: seen on rxe) or RETRY_EXC (gone), and on iWARP a send
// being transmitted when the stream ended completes with LOC_QP_OP_ERR, not a flush (siw gives
// that status to any failed send). A flush is one too: another request's failure caused it.
void connection::cut_off(std::string why, std::chrono::seconds grace) {
    if (closing_ || failure_) return;
    cut_off_ = true;
    grace_ = grace;
    fail(std::move(why));
}

// How long a connection cut off with `status` waits for the client's DISCONNECTED. 30 s on
// iWARP when the connection's own end raised the failure: a send the stream's end cut off
// (LOC_QP_OP_ERR), the flushes after it, and a post refused with ENOTCONN (ended_by). siw then
// raises the CM's close itself (siw_qp_cm_drop), so DISCONNECTED comes; only its delivery may be
// late: more than 10 s once, in a guest loaded by the hostile test and two busy processes
// (echo_test's max_connections; and once in CI). 10 s for the rest: what a peer that stopped
// answering gives (RETRY_EXC, RNR_RETRY_EXC, a remote error), whose DISCONNECTED may never come
// (a partition: cluster_test), and every failure on IB/RoCE, where nothing local raises it (a
// peer's WRITE with a made-up rkey fails the server's QP and flushes its requests: helper-59);
// a longer wait would only hold the slot. Not 2 s: siw in a loaded 2-vCPU guest delivered it
// later (echo_test's killed_client_reason).
std::chrono::seconds connection::grace_after(bool own_end) const noexcept {
    const bool iwarp = device_.context.native()->device->transport_type == IBV_TRANSPORT_IWARP;
    return iwarp && own_end ? own_end_grace : peer_grace;
}
std::chrono::seconds connection::grace_after(ibv_wc_status status) const noexcept {
    return grace_after(status == IBV_WC_LOC_QP_OP_ERR || status == IBV_WC_WR_FLUSH_ERR);
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

} // namespace echo
