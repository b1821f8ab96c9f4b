// echo_client: sends messages to examples/echo_server with SEND and checks that every one comes
// back byte for byte; prints throughput and latency percentiles. One coroutine per connection,
// all on one io_context.
//
//   echo_client --address IP [--port N] [--device NAME] [--size BYTES] [--count N]
//               [--inflight N] [--clients N] [--connect-concurrency N] [--connect-attempts N]
//               [--mode events|hybrid|busy] [--json]
//
// Each connection keeps --inflight messages on the wire: a message goes out when the reply to
// the one before it in the same buffer slot is back and that slot's send has completed. The
// server echoes in order, so the k-th reply must be the k-th message: its bytes are a pattern
// of (connection, k), checked in full. SIGINT stops early, with a clean disconnect.
//
// Connecting: at most --connect-concurrency connections are being set up (resolve, route,
// connect) at once, the others wait for their turn, so that a thousand clients do not all hit
// the server's listen backlog and the CM's timeouts together. A set-up that times out, or that
// the server rejects as busy ("busy: ..." in the reject's private data, --max-connections), is
// tried again after an exponential backoff with jitter (50 ms doubling, at most 2 s; the turn
// is given up while waiting), up to --connect-attempts in all; any other error (nothing
// listens, no route) fails the connection at once. The summary gives connect times p50/p99
// (from a connection's first turn to ESTABLISHED, retries included) and failures by reason.
#include "echo_common.hpp"

#include <ringverbs/cm/connection.hpp>
#include <ringverbs/engine/nothrow.hpp>
#include <ringverbs/engine/signal_set.hpp>

#include <arpa/inet.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <coroutine>
#include <cstdio>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <stop_token>
#include <vector>

using namespace ringverbs;
using namespace std::chrono_literals;
using clock_type = std::chrono::steady_clock;

namespace {

const char* const usage =
    "usage: echo_client --address IP [--port N] [--device NAME] [--size BYTES] [--count N]\n"
    "                   [--inflight N] [--clients N] [--connect-concurrency N]\n"
    "                   [--connect-attempts N] [--reply-timeout SECONDS]\n"
    "                   [--mode events|hybrid|busy] [--json]\n"
    "  --address   the server's IPv4 or IPv6 address (default: $RINGVERBS_ADDR)\n"
    "  --port      the server's port (default 18515)\n"
    "  --device    the RDMA device that must carry the connections (default: the route's)\n"
    "  --size      bytes per message (default 64)\n"
    "  --count     messages per connection (default 10000)\n"
    "  --inflight  messages on the wire per connection (default 1: ping-pong)\n"
    "  --clients   connections, each its own coroutine (default 1)\n"
    "  --connect-concurrency  connections being set up at once; the rest wait (default 64)\n"
    "  --connect-attempts     tries per connection when a connect times out or the server is\n"
    "              busy, with backoff from 50 ms (default 5; 1: no retry)\n"
    "  --reply-timeout  close a connection on which nothing completes for this many seconds\n"
    "              (a partitioned link, a server gone without a word; default 30; 0: never)\n"
    "  --mode      how the completion channel waits (default events)\n"
    "  --json      also print the result as one JSON object\n";

struct config {
    std::string address;
    std::uint16_t port = echo::default_port;
    std::string device;
    std::uint32_t size = 64;
    std::uint64_t count = 10000;
    std::uint32_t inflight = 1;
    int clients = 1;
    int connect_concurrency = 64;
    int connect_attempts = 5;
    std::uint32_t reply_timeout = 30; // seconds; 0: never
    polling_mode mode = polling_mode::events;
    bool json = false;
};

// Round trips in buckets 1% wide from 0.1 us to ~100 s: percentiles within 1%, fixed memory
// (a run of any length allocates nothing per message).
struct latency_histogram {
    static constexpr double base_us = 0.1, growth = 1.01;
    std::vector<std::uint64_t> counts = std::vector<std::uint64_t>(2100);
    std::uint64_t total = 0;
    void add(double us) {
        const double i = us <= base_us ? 0.0 : std::log(us / base_us) / std::log(growth);
        ++counts[std::min(counts.size() - 1, static_cast<std::size_t>(i))];
        ++total;
    }
    double percentile(double p) const { // the bucket's upper edge
        const auto rank = static_cast<std::uint64_t>(std::ceil(p * static_cast<double>(total)));
        std::uint64_t seen = 0;
        for (std::size_t i = 0; i < counts.size(); ++i)
            if ((seen += counts[i]) >= rank && seen > 0)
                return base_us * std::pow(growth, static_cast<double>(i + 1));
        return 0.0;
    }
};

// At most `free` holders at once; the others wait in FIFO order. Single-threaded (one
// io_context): a release hands the turn to the first waiter, resumed through the loop (post), so
// that a chain of releases never nests resumptions.
class turns {
  public:
    turns(io_context& io, int n) : io_(io), free_(n) {}
    struct awaiter {
        turns& t;
        bool await_ready() noexcept { return t.free_ > 0 && (--t.free_, true); }
        void await_suspend(std::coroutine_handle<> h) { t.waiting_.push_back(h); }
        void await_resume() noexcept {}
    };
    awaiter acquire() noexcept { return {*this}; }
    void release() {
        if (waiting_.empty()) {
            ++free_;
            return;
        }
        const std::coroutine_handle<> next = waiting_.front(); // the turn passes to it
        waiting_.pop_front();
        io_.post([next] { next.resume(); });
    }

  private:
    io_context& io_;
    int free_;
    std::deque<std::coroutine_handle<>> waiting_;
};

// The turn a coroutine holds (after co_await t.acquire(), hold(t)), given back when it goes,
// also when an exception leaves the coroutine.
class turn {
  public:
    turn() noexcept = default;
    turn(const turn&) = delete;
    turn& operator=(const turn&) = delete;
    ~turn() { give_back(); }
    void hold(turns& t) noexcept { t_ = &t; }
    void give_back() {
        if (t_) std::exchange(t_, nullptr)->release();
    }

  private:
    turns* t_ = nullptr;
};

struct client {
    client(io_context& i, config c, sockaddr_storage to)
        : io(i), cfg(std::move(c)), server(to), connecting(i, cfg.connect_concurrency) {}
    io_context& io;
    config cfg;
    sockaddr_storage server;
    std::stop_source stopping;
    latency_histogram latency; // every verified round trip
    std::uint64_t verified = 0;
    int failed = 0;
    turns connecting;                            // --connect-concurrency
    latency_histogram connect_time;              // us, first turn to ESTABLISHED
    int connected = 0;                           // connections established
    int retries = 0;                             // attempts after a connection's first
    std::map<std::string, int> connect_failures; // reason -> connections that never connected
    std::minstd_rand jitter{std::random_device{}()};
};

// Why a set-up failed, as a summary's reason, and whether another attempt may do better.
struct setup_failure {
    // "busy", "timeout", "rejected", "no_listener", "refused", "unreachable", "error"
    std::string reason;
    std::string text; // for the log line
    bool retry = false;
};

setup_failure classify(const connection_rejected& e) {
    // The server's reason, in the reject's private data (e.g. "busy: 4 connections, the
    // server's limit"); without one, the transport's reason (e.g. nothing listens).
    const std::string why = echo::reject_reason(e.private_data());
    if (e.by_peer_application() && !why.empty()) {
        const bool busy = why.rfind("busy:", 0) == 0;
        return {busy ? "busy" : "rejected", "the server rejected the connection: " + why, busy};
    }
    const char* reason = e.by_peer_application() ? "rejected"
                         : e.nothing_listens()   ? "no_listener"
                                                 : "refused";
    return {reason, e.what(), false};
}

setup_failure classify(const std::system_error& e) {
    // ETIMEDOUT: the CM's own timeout (rdma_connect, a resolution) or our wait's.
    if (e.code() == std::errc::timed_out) return {"timeout", e.what(), true};
    if (e.code() == std::errc::network_unreachable || e.code() == std::errc::host_unreachable)
        return {"unreachable", e.what(), false};
    return {"error", e.what(), false};
}

// Backoff before attempt `attempt` + 1: 50 ms doubling per attempt, at most 2 s, of which a
// random half (equal jitter), so that connections rejected together do not come back together.
std::chrono::microseconds backoff(client& cl, int attempt) {
    const std::int64_t full =
        std::min<std::int64_t>(50'000LL << std::min(attempt - 1, 16), 2'000'000);
    std::uniform_int_distribution<std::int64_t> half(0, full / 2);
    return std::chrono::microseconds(full / 2 + half(cl.jitter));
}

// Byte i of message k of connection c: both sides of the check compute it.
std::byte pattern(int c, std::uint64_t k, std::size_t i) {
    return static_cast<std::byte>((k * 131 + static_cast<std::uint64_t>(c) * 71 + i * 7) & 0xff);
}

constexpr std::uint64_t send_bit = std::uint64_t{1} << 32;

task<void> run_connection(client& cl, int number) {
    const config& cfg = cl.cfg;
    const std::uint32_t size = cfg.size, window = cfg.inflight;
    const std::string where = echo::text_of(reinterpret_cast<const sockaddr*>(&cl.server));
    const std::stop_token stop = cl.stopping.get_token();
    // Slot s of each half: the message k = s (mod window) going out, and a reply coming in.
    // Declared before the QP, so that they outlive it.
    std::vector<std::byte> buffers(2 * std::size_t{window} * size);
    std::optional<verbs::memory_region> mr;
    // Each attempt makes its own connection (id, CQ and QP, on the device's shared PD and
    // completion channel: connect()); the next one (or the coroutine's end) destroys it.
    std::optional<ringverbs::connection> conn;
    connection_options options;
    options.caps = verbs::qp_caps{.max_send_wr = window, .max_recv_wr = window};
    options.completion.mode = cfg.mode;
    options.step_timeout = 10s;

    echo::server_hello hello{};
    turn my_turn;
    co_await cl.connecting.acquire();
    my_turn.hold(cl.connecting);
    if (stop.stop_requested()) co_return; // SIGINT while waiting for the turn
    const auto first_turn = clock_type::now();
    for (int attempt = 1;; ++attempt) {
        conn.reset();
        bool established = false, reached = true;
        setup_failure failure;
        try {
            conn.emplace(co_await connect(cl.io, where, options, stop));
            established = true;
        } catch (const connection_rejected& e) {
            failure = classify(e);
        } catch (const std::system_error& e) {
            failure = classify(e);
            // Failed before the route to the server was known.
            reached = failure.text.find("rdma_resolve_") == std::string::npos;
        }
        if (established) break;
        if (stop.stop_requested())
            throw std::runtime_error("connection " + std::to_string(number) +
                                     ": interrupted before it was established");
        if (!failure.retry || attempt >= cfg.connect_attempts) {
            ++cl.connect_failures[failure.reason];
            throw std::runtime_error(
                std::string(reached ? "cannot connect to " : "cannot reach ") + where + ": " +
                failure.text +
                (attempt > 1 ? " (" + std::to_string(attempt) + " attempts)" : std::string()));
        }
        // Another try, later: the turn goes to the next connection meanwhile.
        ++cl.retries;
        my_turn.give_back();
        const result<void> slept = co_await nothrow(sleep_for(cl.io, backoff(cl, attempt), stop));
        if (!slept)
            throw std::runtime_error("connection " + std::to_string(number) +
                                     ": interrupted before it was established");
        co_await cl.connecting.acquire();
        my_turn.hold(cl.connecting);
        if (stop.stop_requested()) co_return;
    }
    my_turn.give_back();
    if (!cfg.device.empty() && conn->device().name() != cfg.device)
        throw std::runtime_error("the route to " + where + " goes through device " +
                                 std::string(conn->device().name()) + ", not " + cfg.device);
    mr.emplace(conn->pd(), buffers);
    if (const auto data = conn->peer_data(); data.size() >= sizeof hello)
        std::memcpy(&hello, data.data(), sizeof hello);
    qp& q = conn->queue_pair();
    cq& completions = conn->completions();
    cm_id& id = conn->id();
    ++cl.connected;
    cl.connect_time.add(
        std::chrono::duration<double, std::micro>(clock_type::now() - first_turn).count());

    std::byte* const out = buffers.data();
    std::byte* const in = buffers.data() + std::size_t{window} * size;
    ibv_sge sge{};
    std::string post_error; // why the last post failed (posted through verbs, which throw)
    const std::string gone = "the RDMA device is gone (removed, or failed for good)";
    auto post_receive = [&](std::uint64_t slot) {
        sge = {reinterpret_cast<std::uintptr_t>(in + slot * size), size, mr->native()->lkey};
        ibv_recv_wr wr{.wr_id = slot, .next = nullptr, .sg_list = &sge, .num_sge = 1};
        q.native_qp().post_recv(wr);
    };
    std::vector<clock_type::time_point> sent_at(window);
    auto post_message = [&](std::uint64_t k) {
        const std::uint64_t slot = k % window;
        for (std::size_t i = 0; i < size; ++i)
            out[slot * size + i] = pattern(number, k, i);
        sge = {reinterpret_cast<std::uintptr_t>(out + slot * size), size, mr->native()->lkey};
        ibv_send_wr wr{};
        wr.wr_id = slot | send_bit;
        wr.sg_list = &sge;
        wr.num_sge = 1;
        wr.opcode = IBV_WR_SEND;
        wr.send_flags = IBV_SEND_SIGNALED;
        sent_at[slot] = clock_type::now();
        q.native_qp().post_send(wr);
    };
    // Receives first (the server sends nothing but replies, so after the connect is in time).
    std::uint64_t receives = std::min<std::uint64_t>(window, cfg.count); // posted so far
    for (std::uint64_t slot = 0; slot < receives; ++slot)
        post_receive(slot);

    const std::uint32_t server_max = ntohl(hello.max_size), server_depth = ntohl(hello.depth);
    if (server_depth != 0 && window > server_depth)
        std::fprintf(
            stderr,
            "echo_client: connection %d: --inflight %u exceeds the %u receives the server posts: "
            "receiver-not-ready retries will slow it down a lot\n",
            number, window, server_depth);
    if (server_max != 0 && size > server_max)
        std::fprintf(stderr,
                     "echo_client: connection %d: --size %u exceeds the %u bytes the server takes: "
                     "it will close the connection\n",
                     number, size, server_max);

    // A slot is free for its next message when the reply is back (+1) and the send is done (+1).
    std::vector<int> done(window, 0);
    std::uint64_t next = 0, received = 0;
    std::size_t posted = receives; // requests owed a completion
    for (; next < std::min<std::uint64_t>(window, cfg.count); ++next, ++posted)
        post_message(next);
    std::string error;
    bool closing = false;
    auto close = [&](std::string why) -> task<void> {
        if (closing) co_return;
        closing = true;
        error = std::move(why);
        try {
            co_await id.disconnect(wait_options(2s));
        } catch (const std::exception&) {
        }
    };
    // The completion wait ends on SIGINT, and on the server's disconnect. On iWARP a request
    // posted after the TCP stream ended never completes: siw (Linux 6.1) fails the QP and
    // flushes what is posted then (siw_qp_llp_close), but a receive posted later sits in the
    // queue it shares with us, and a send's doorbell on a QP in ERROR flushes nothing
    // (siw_post_send), so a client that did not run between its last completion and the close
    // (stopped, or slow) waits for nothing. rdma_cm's DISCONNECTED does come: watched here.
    std::stop_source wake;
    std::stop_callback forward_stop(cl.stopping.get_token(),
                                    [&wake]() noexcept { wake.request_stop(); });
    std::stop_source exchanged; // the exchange below is over: ends the watch
    auto watch_disconnect = [&]() -> task<void> {
        const wait_options until_exchanged(exchanged.get_token());
        const result<void> gone = co_await nothrow(id.disconnected(until_exchanged));
        if (gone) wake.request_stop(); // else the exchange ended first
    };
    struct end_watch {
        std::stop_source& exchanged;
        ~end_watch() { exchanged.request_stop(); }
    };
    // Why the server may have closed: messages larger than it takes.
    auto oversize_note = [&]() -> std::string {
        if (server_max == 0 || size <= server_max) return {};
        return " (messages of " + std::to_string(size) + " bytes, the server takes " +
               std::to_string(server_max) + ")";
    };
    auto exchange = [&]() -> task<void> {
        const end_watch ended{exchanged}; // also if the exchange throws: when_all ends
        while (posted > 0) {
            ibv_wc wc{};
            // Once closing, only the flushes are awaited, and not forever (see echo_server.cpp).
            // Before, nothing completing for --reply-timeout closes the connection: a peer cut off
            // by a partition may never send the DREQ that would flush our receives.
            const std::chrono::seconds quiet(cfg.reply_timeout);
            const wait_options wait = closing             ? wait_options(5s)
                                      : quiet.count() > 0 ? wait_options(quiet, wake.get_token())
                                                          : wait_options(wake.get_token());
            result<ibv_wc> polled = co_await nothrow(completions.next(wait));
            const bool interrupted = !polled;
            const bool timed_out = polled.error() == std::errc::timed_out;
            // The device went away: that is why the connection ends, whatever was seen first (a
            // post to its QP refused, completions flushed).
            if (polled.error() == std::errc::no_such_device) post_error = error = polled.what();
            if (polled) wc = *polled;
            if (interrupted && closing) break;
            if (timed_out) {
                co_await close("no reply for " + std::to_string(quiet.count()) +
                               " s (--reply-timeout)");
                continue;
            }
            if (interrupted) {
                // Named first: GCC 12 mishandles a temporary of a ?: inside a co_await expression.
                std::string why = !post_error.empty()            ? post_error
                                  : cl.stopping.stop_requested() ? std::string("interrupted")
                                  : id.is_disconnected()
                                      ? std::string("the server closed the connection")
                                      : std::string("interrupted");
                if (why == "the server closed the connection") why += oversize_note();
                co_await close(std::move(why));
                continue;
            }
            --posted;
            const std::uint64_t slot = wc.wr_id & ~send_bit;
            if (wc.status != IBV_WC_SUCCESS) {
                // A flush we did not cause (not closing yet, no request failed first): on
                // iWARP the QP fails as the TCP stream ends, before rdma_cm's DISCONNECTED: the
                // server closed the connection. On IB/RoCE the QP goes to error only when
                // DISCONNECTED is read (the runtime answers it with rdma_disconnect), so a
                // flush before it is a local failure of the QP.
                const bool iwarp =
                    id.native()->verbs->device->transport_type == IBV_TRANSPORT_IWARP;
                std::string why =
                    completions.device_lost() ? gone
                    : id.is_disconnected() || (iwarp && wc.status == IBV_WC_WR_FLUSH_ERR)
                        ? "the server closed the connection"
                        : std::string(wc.wr_id & send_bit ? "send" : "receive") +
                              " failed: " + ibv_wc_status_str(wc.status) +
                              (wc.status == IBV_WC_WR_FLUSH_ERR
                                   ? " (the QP went to the error state)"
                                   : "");
                why += oversize_note();
                co_await close(why);
                continue;
            }
            if (closing) continue;
            if (wc.opcode == IBV_WC_RECV) {
                const std::byte* got = in + slot * size;
                bool same = wc.byte_len == size;
                for (std::size_t i = 0; same && i < size; ++i)
                    same = got[i] == pattern(number, received, i);
                if (!same) {
                    co_await close("reply " + std::to_string(received) +
                                   " differs from the message sent");
                    continue;
                }
                cl.latency.add(std::chrono::duration<double, std::micro>(clock_type::now() -
                                                                         sent_at[received % window])
                                   .count());
                ++cl.verified;
                ++done[received % window];
                ++received;
                if (receives < cfg.count) {
                    try {
                        post_receive(slot);
                    } catch (const std::system_error& e) {
                        post_error = e.what(); // a co_await may not be in a handler
                    }
                    if (!post_error.empty()) {
                        std::string why = completions.device_lost() ? gone : post_error;
                        co_await close(std::move(why));
                        continue;
                    }
                    ++receives;
                    ++posted;
                }
            } else {
                ++done[slot];
            }
            // Send the next message in every slot whose reply and send are both back.
            while (next < cfg.count && done[next % window] == 2) {
                done[next % window] = 0;
                try {
                    post_message(next);
                } catch (const std::system_error& e) {
                    post_error = e.what();
                    break;
                }
                ++next;
                ++posted;
            }
            if (!post_error.empty()) {
                std::string why = completions.device_lost() ? gone : post_error;
                co_await close(std::move(why));
            }
        }
    };
    co_await when_all(exchange(), watch_disconnect());
    // Every request is back (flushed ones too, after a close): the buffers are ours again.
    if (!closing) co_await close("");
    if (!error.empty()) {
        throw std::runtime_error("connection " + std::to_string(number) + " to " + where + ": " +
                                 error + " after " + std::to_string(received) + " of " +
                                 std::to_string(cfg.count) + " messages");
    }
}

task<void> guarded(client& cl, int number) {
    try {
        co_await run_connection(cl, number);
    } catch (const std::exception& e) {
        if (!cl.stopping.stop_requested()) ++cl.failed; // SIGINT is not a failure
        std::fprintf(stderr, "echo_client: %s\n", e.what());
    }
}

// SIGINT / SIGTERM stop the clients; the end of every connection stops the watch.
task<void> watch_signals(client& cl, signal_set& signals) {
    try {
        (void)co_await signals.wait(wait_options(cl.stopping.get_token()));
    } catch (const std::system_error& e) {
        if (e.code() != std::errc::operation_canceled) throw;
        co_return;
    }
    cl.stopping.request_stop();
}

task<void> all_connections(client& cl) {
    std::vector<task<void>> all;
    for (int c = 0; c < cl.cfg.clients; ++c)
        all.push_back(guarded(cl, c));
    co_await when_all(std::move(all));
    cl.stopping.request_stop(); // ends the signal watch
}

config parse(int argc, char** argv) {
    config c;
    if (const char* a = std::getenv("RINGVERBS_ADDR")) c.address = a;
    if (const char* d = std::getenv("RINGVERBS_DEVICE")) c.device = d;
    for (int i = 1; i < argc; ++i) {
        const std::string flag = argv[i];
        if (flag == "--help" || flag == "-h") throw echo::usage_error("");
        if (flag == "--json") {
            c.json = true;
            continue;
        }
        if (i + 1 >= argc) throw echo::usage_error(flag + " needs a value (or is unknown)");
        const std::string v = argv[++i];
        if (flag == "--address")
            c.address = v;
        else if (flag == "--port")
            c.port = static_cast<std::uint16_t>(echo::number(flag, v, 1, 65535));
        else if (flag == "--device")
            c.device = v;
        else if (flag == "--size")
            c.size = static_cast<std::uint32_t>(echo::number(flag, v, 1, 1u << 30));
        else if (flag == "--count")
            c.count = echo::number(flag, v, 1, 1ul << 40);
        else if (flag == "--inflight")
            c.inflight = static_cast<std::uint32_t>(echo::number(flag, v, 1, 4096));
        else if (flag == "--clients")
            c.clients = static_cast<int>(echo::number(flag, v, 1, 1024));
        else if (flag == "--connect-concurrency")
            c.connect_concurrency = static_cast<int>(echo::number(flag, v, 1, 1024));
        else if (flag == "--connect-attempts")
            c.connect_attempts = static_cast<int>(echo::number(flag, v, 1, 100));
        else if (flag == "--reply-timeout")
            c.reply_timeout = static_cast<std::uint32_t>(echo::number(flag, v, 0, 86400));
        else if (flag == "--mode")
            c.mode = echo::mode_of(v);
        else
            throw echo::usage_error("unknown option " + flag);
    }
    if (c.address.empty()) throw echo::usage_error("--address is required (or set RINGVERBS_ADDR)");
    return c;
}

} // namespace

int main(int argc, char** argv) {
    config cfg;
    if (auto status = echo::parse_options("echo_client", usage, parse, argc, argv, cfg))
        return *status;
    try {
        echo::check_device(cfg.device);
        io_context io;
        signal_set signals(io, {SIGINT, SIGTERM});
        client cl(io, cfg, echo::address_of(cfg.address, cfg.port));
        const auto t0 = clock_type::now();
        io.run(when_all(watch_signals(cl, signals), all_connections(cl)));
        const double secs = std::chrono::duration<double>(clock_type::now() - t0).count();

        auto pct = [&](double p) { return cl.latency.percentile(p); };
        const double rate = static_cast<double>(cl.verified) / secs;
        const std::uint64_t want = cfg.count * static_cast<std::uint64_t>(cfg.clients);
        std::printf(
            "echo_client: %llu of %llu messages (%llu bytes) echoed and verified byte for byte; "
            "%d connection(s), %u bytes each, %u in flight, %s mode\n",
            static_cast<unsigned long long>(cl.verified), static_cast<unsigned long long>(want),
            static_cast<unsigned long long>(cl.verified * cfg.size), cfg.clients, cfg.size,
            cfg.inflight, to_string(cfg.mode));
        std::printf("echo_client: %.0f messages/s, %.2f MB/s each way; round trip p50 %.1f us, p99 "
                    "%.1f us, p99.9 %.1f us\n",
                    rate, rate * cfg.size / 1e6, pct(0.50), pct(0.99), pct(0.999));
        // Connecting: times from a connection's first turn to ESTABLISHED (retries included),
        // and the connections that never got there, by reason.
        auto connect_ms = [&](double p) { return cl.connect_time.percentile(p) / 1000.0; };
        std::string failures, failures_json;
        for (const auto& [reason, n] : cl.connect_failures) {
            failures += (failures.empty() ? "" : ", ") + reason + " " + std::to_string(n);
            failures_json +=
                (failures_json.empty() ? "\"" : ", \"") + reason + "\": " + std::to_string(n);
        }
        std::printf("echo_client: %d of %d connection(s) established, %d set up at a time: connect "
                    "p50 %.1f ms, p99 %.1f ms; %d retried attempt(s); connect failures: %s\n",
                    cl.connected, cfg.clients, std::min(cfg.connect_concurrency, cfg.clients),
                    connect_ms(0.50), connect_ms(0.99), cl.retries,
                    failures.empty() ? "none" : failures.c_str());
        if (cfg.json)
            std::printf("{\"clients\": %d, \"size\": %u, \"inflight\": %u, \"mode\": \"%s\", "
                        "\"messages\": %llu, "
                        "\"verified\": %llu, \"seconds\": %.3f, \"messages_per_s\": %.1f, "
                        "\"p50_us\": %.2f, "
                        "\"p99_us\": %.2f, \"p999_us\": %.2f, \"connected\": %d, "
                        "\"connect_concurrency\": %d, \"connect_p50_ms\": %.2f, "
                        "\"connect_p99_ms\": %.2f, \"connect_retries\": %d, "
                        "\"connect_failures\": {%s}}\n",
                        cfg.clients, cfg.size, cfg.inflight, to_string(cfg.mode),
                        static_cast<unsigned long long>(want),
                        static_cast<unsigned long long>(cl.verified), secs, rate, pct(0.50),
                        pct(0.99), pct(0.999), cl.connected, cfg.connect_concurrency,
                        connect_ms(0.50), connect_ms(0.99), cl.retries, failures_json.c_str());
        if (cl.stopping.stop_requested() && cl.verified < want && cl.failed == 0) return 130;
        return cl.failed == 0 && cl.verified == want ? 0 : 1;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "echo_client: %s\n", e.what());
        return 1;
    }
}
