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

constexpr const char* device_gone = "the RDMA device is gone (removed, or failed for good)";

// One connection's life, in named steps: connect (retrying what another attempt may pass),
// start (the first receives and the first window of messages), then the exchange of --count
// messages, each reply checked byte for byte, beside a watch for the server's disconnect;
// then the close. Slot s of each half of the buffers: the message k = s (mod window) going
// out, and a reply coming in.
class session {
  public:
    session(client& cl, int number)
        : cl_(cl), cfg_(cl.cfg), number_(number), size_(cl.cfg.size), window_(cl.cfg.inflight),
          where_(echo::text_of(reinterpret_cast<const sockaddr*>(&cl.server))),
          stop_(cl.stopping.get_token()), buffers_(2 * std::size_t{window_} * size_),
          sent_at_(window_), done_(window_, 0) {}
    session(const session&) = delete;
    session& operator=(const session&) = delete;

    // Throws std::runtime_error saying why the connection failed; returns when it ended well or
    // SIGINT stopped it.
    task<void> run();

  private:
    task<bool> connect_with_retries();
    void start();
    task<void> exchange();
    task<void> watch_disconnect();
    task<void> close(std::string why);
    std::string interrupted_reason();
    std::string failed_reason(const ibv_wc& wc);
    task<void> grace_for_disconnect(const ibv_wc& wc);
    bool on_iwarp() const {
        return conn_->device().native()->device->transport_type == IBV_TRANSPORT_IWARP;
    }
    std::string take_reply(const ibv_wc& wc);
    std::string send_ready();
    std::string oversize_note() const;
    std::string post_failed(const std::system_error& e);
    void post_receive(std::uint64_t slot);
    void post_message(std::uint64_t k);
    std::byte* out() noexcept { return buffers_.data(); }
    std::byte* in() noexcept { return buffers_.data() + std::size_t{window_} * size_; }

    client& cl_;
    const config& cfg_;
    const int number_;
    const std::uint32_t size_, window_;
    const std::string where_;
    const std::stop_token stop_;
    // Declared before the connection, so that they outlive its QP.
    std::vector<std::byte> buffers_;
    std::vector<clock_type::time_point> sent_at_;
    // A slot is free for its next message when the reply is back (+1) and the send is done (+1).
    std::vector<int> done_;
    std::optional<verbs::memory_region> mr_;
    // Each attempt makes its own connection (id, CQ and QP, on the device's shared PD and
    // completion channel: connect()); the next one (or the session's end) destroys it.
    std::optional<ringverbs::connection> conn_;
    std::uint32_t server_max_ = 0, server_depth_ = 0; // what the server said it takes
    ibv_sge sge_{};
    std::uint64_t next_ = 0;     // the next message to send
    std::uint64_t received_ = 0; // replies verified
    std::uint64_t receives_ = 0; // receives posted so far
    std::size_t posted_ = 0;     // requests owed a completion
    std::string post_error_;     // why the last post failed (posted through verbs, which throw)
    std::string error_;          // why the connection closed ("" when it ended well)
    bool closing_ = false;
    // The completion wait ends on SIGINT and on the server's disconnect (wake_); the watch of
    // the disconnect ends with the exchange (exchanged_).
    std::stop_source wake_, exchanged_;
};

task<void> session::run() {
    const bool connected = co_await connect_with_retries();
    if (!connected) co_return; // SIGINT while waiting for a turn
    start();
    std::stop_callback forward_stop(cl_.stopping.get_token(),
                                    [this]() noexcept { wake_.request_stop(); });
    co_await when_all(exchange(), watch_disconnect());
    // Every request is back (flushed ones too, after a close): the buffers are ours again.
    if (!closing_) co_await close("");
    if (!error_.empty()) {
        throw std::runtime_error("connection " + std::to_string(number_) + " to " + where_ + ": " +
                                 error_ + " after " + std::to_string(received_) + " of " +
                                 std::to_string(cfg_.count) + " messages");
    }
}

// Waits for a turn (--connect-concurrency), then connects; a failure another attempt may pass
// (busy, a timeout) is tried again after a backoff, the turn going to the next connection
// meanwhile. Returns false on SIGINT while waiting for a turn; throws why it cannot connect.
task<bool> session::connect_with_retries() {
    connection_options options;
    options.caps = verbs::qp_caps{.max_send_wr = window_, .max_recv_wr = window_};
    options.completion.mode = cfg_.mode;
    options.step_timeout = 10s;
    turn my_turn;
    co_await cl_.connecting.acquire();
    my_turn.hold(cl_.connecting);
    if (stop_.stop_requested()) co_return false;
    const auto first_turn = clock_type::now();
    for (int attempt = 1;; ++attempt) {
        conn_.reset();
        bool established = false, reached = true;
        setup_failure failure;
        try {
            conn_.emplace(co_await connect(cl_.io, where_, options, stop_));
            established = true;
        } catch (const connection_rejected& e) {
            failure = classify(e);
        } catch (const std::system_error& e) {
            failure = classify(e);
            // Failed before the route to the server was known.
            reached = failure.text.find("rdma_resolve_") == std::string::npos;
        }
        if (established) break;
        if (stop_.stop_requested())
            throw std::runtime_error("connection " + std::to_string(number_) +
                                     ": interrupted before it was established");
        if (!failure.retry || attempt >= cfg_.connect_attempts) {
            ++cl_.connect_failures[failure.reason];
            throw std::runtime_error(
                std::string(reached ? "cannot connect to " : "cannot reach ") + where_ + ": " +
                failure.text +
                (attempt > 1 ? " (" + std::to_string(attempt) + " attempts)" : std::string()));
        }
        ++cl_.retries;
        my_turn.give_back();
        const result<void> slept =
            co_await nothrow(sleep_for(cl_.io, backoff(cl_, attempt), stop_));
        if (!slept)
            throw std::runtime_error("connection " + std::to_string(number_) +
                                     ": interrupted before it was established");
        co_await cl_.connecting.acquire();
        my_turn.hold(cl_.connecting);
        if (stop_.stop_requested()) co_return false;
    }
    my_turn.give_back();
    if (!cfg_.device.empty() && conn_->device().name() != cfg_.device)
        throw std::runtime_error("the route to " + where_ + " goes through device " +
                                 std::string(conn_->device().name()) + ", not " + cfg_.device);
    mr_.emplace(conn_->pd(), buffers_);
    ++cl_.connected;
    cl_.connect_time.add(
        std::chrono::duration<double, std::micro>(clock_type::now() - first_turn).count());
    co_return true;
}

// The connection is up: what the server takes (its accept's private data), warned about when
// exceeded; the receives first (the server sends nothing but replies), then the first window
// of messages.
void session::start() {
    echo::server_hello hello{};
    if (const auto data = conn_->peer_data(); data.size() >= sizeof hello)
        std::memcpy(&hello, data.data(), sizeof hello);
    server_max_ = ntohl(hello.max_size);
    server_depth_ = ntohl(hello.depth);
    const bool iwarp = on_iwarp();
    if (server_depth_ != 0 && iwarp && std::uint64_t{2} * window_ > server_depth_)
        // The server posts a buffer's receive again once its echo's send completed, while the
        // echo's arrival already lets this side send the next message.
        std::fprintf(stderr,
                     "echo_client: connection %d: --inflight %u is more than half the %u receives "
                     "the server posts: on iWARP (no RNR) a message that arrives before the "
                     "server posted its receive again ends the connection\n",
                     number_, window_, server_depth_);
    else if (server_depth_ != 0 && window_ > server_depth_)
        std::fprintf(
            stderr,
            "echo_client: connection %d: --inflight %u exceeds the %u receives the server posts: "
            "receiver-not-ready retries will slow it down a lot\n",
            number_, window_, server_depth_);
    if (server_max_ != 0 && size_ > server_max_)
        std::fprintf(stderr,
                     "echo_client: connection %d: --size %u exceeds the %u bytes the server takes: "
                     "it will close the connection\n",
                     number_, size_, server_max_);
    receives_ = std::min<std::uint64_t>(window_, cfg_.count);
    for (std::uint64_t slot = 0; slot < receives_; ++slot)
        post_receive(slot);
    posted_ = receives_;
    for (; next_ < std::min<std::uint64_t>(window_, cfg_.count); ++next_, ++posted_)
        post_message(next_);
}

// Until every request posted is back: each completion read, a reply checked and its slot's
// next message sent; the first failure closes the connection, and the flushes are awaited.
task<void> session::exchange() {
    struct end_watch { // also if the exchange throws: when_all ends
        std::stop_source& exchanged;
        ~end_watch() { exchanged.request_stop(); }
    } const ended{exchanged_};
    cq& completions = conn_->completions();
    while (posted_ > 0) {
        // Once closing, only the flushes are awaited, and not forever (see
        // echo_server/connection.cpp). Before, nothing completing for --reply-timeout closes the
        // connection: a peer cut off by a partition may never send the DREQ that would flush
        // our receives.
        const std::chrono::seconds quiet(cfg_.reply_timeout);
        const wait_options wait = closing_            ? wait_options(5s)
                                  : quiet.count() > 0 ? wait_options(quiet, wake_.get_token())
                                                      : wait_options(wake_.get_token());
        const result<ibv_wc> polled = co_await nothrow(completions.next(wait));
        // The device went away: that is why the connection ends, whatever was seen first (a
        // post to its QP refused, completions flushed).
        if (polled.error() == std::errc::no_such_device) post_error_ = error_ = polled.what();
        if (!polled) {
            if (closing_) break;
            if (polled.error() == std::errc::timed_out) {
                co_await close("no reply for " + std::to_string(quiet.count()) +
                               " s (--reply-timeout)");
                continue;
            }
            std::string why = interrupted_reason();
            co_await close(std::move(why));
            continue;
        }
        const ibv_wc& wc = *polled;
        --posted_;
        std::string why;
        if (wc.status != IBV_WC_SUCCESS) {
            co_await grace_for_disconnect(wc);
            why = failed_reason(wc);
        } else if (closing_)
            continue;
        else if (wc.opcode == IBV_WC_RECV)
            why = take_reply(wc);
        else
            ++done_[wc.wr_id & ~send_bit];
        if (why.empty()) why = send_ready();
        if (!why.empty()) co_await close(std::move(why));
    }
}

// On iWARP a request posted after the TCP stream ended never completes: siw (Linux 6.1) fails
// the QP and flushes what is posted then (siw_qp_llp_close), but a receive posted later sits
// in the queue it shares with us, and a send's doorbell on a QP in ERROR flushes nothing
// (siw_post_send), so a client that did not run between its last completion and the close
// (stopped, or slow) waits for nothing. rdma_cm's DISCONNECTED does come: it wakes the wait.
task<void> session::watch_disconnect() {
    const wait_options until_exchanged(exchanged_.get_token());
    const result<void> gone = co_await nothrow(conn_->id().disconnected(until_exchanged));
    if (gone) wake_.request_stop(); // else the exchange ended first
}

// Closes once, for the first reason (none: the exchange ended well); what is posted flushes.
task<void> session::close(std::string why) {
    if (closing_) co_return;
    closing_ = true;
    error_ = std::move(why);
    const result<void> ended = co_await nothrow(conn_->id().disconnect(wait_options(2s)));
    (void)ended; // the server is gone without a word: the flush comes all the same
}

// Why the completion wait ended without a completion (not its timeout).
std::string session::interrupted_reason() {
    if (!post_error_.empty()) return post_error_;
    if (conn_->completions().device_lost()) return device_gone + oversize_note();
    if (cl_.stopping.stop_requested()) return "interrupted";
    if (conn_->id().is_disconnected()) return "the server closed the connection" + oversize_note();
    return "interrupted";
}

// On iWARP the QP fails as the TCP stream ends, and a send being transmitted then fails with a
// status of its own (siw: local QP operation error) before rdma_cm's DISCONNECTED is read: such
// a send's failure waits up to 2 s for it, so that the server's close reads as that. Not a
// receive's: siw drops the connection itself on a receive error (a reply longer than the
// buffer), and that DISCONNECTED would hide the real failure.
task<void> session::grace_for_disconnect(const ibv_wc& wc) {
    if (!on_iwarp() || closing_ || (wc.wr_id & send_bit) == 0 || wc.status == IBV_WC_WR_FLUSH_ERR ||
        conn_->id().is_disconnected())
        co_return;
    const result<void> gone = co_await nothrow(conn_->id().disconnected(wait_options(2s)));
    (void)gone; // timed out: a local failure after all
}

// A failed completion while not closing (no request failed first).
std::string session::failed_reason(const ibv_wc& wc) {
    if (conn_->completions().device_lost()) return device_gone + oversize_note();
    // A flush we did not cause: on iWARP the QP fails as the TCP stream ends, before rdma_cm's
    // DISCONNECTED: the server closed the connection. On IB/RoCE the QP goes to error only when
    // DISCONNECTED is read (the runtime answers it with rdma_disconnect), so a flush before it
    // is a local failure of the QP.
    if (conn_->id().is_disconnected() || (on_iwarp() && wc.status == IBV_WC_WR_FLUSH_ERR))
        return "the server closed the connection" + oversize_note();
    return std::string(wc.wr_id & send_bit ? "send" : "receive") +
           " failed: " + ibv_wc_status_str(wc.status) +
           (wc.status == IBV_WC_WR_FLUSH_ERR ? " (the QP went to the error state)" : "") +
           oversize_note();
}

// A reply: checked byte for byte against the message it answers, timed, and its slot's receive
// posted again. Returns why the connection must close, or "".
std::string session::take_reply(const ibv_wc& wc) {
    const std::uint64_t slot = wc.wr_id & ~send_bit;
    const std::byte* got = in() + slot * size_;
    bool same = wc.byte_len == size_;
    for (std::size_t i = 0; same && i < size_; ++i)
        same = got[i] == pattern(number_, received_, i);
    if (!same) return "reply " + std::to_string(received_) + " differs from the message sent";
    cl_.latency.add(
        std::chrono::duration<double, std::micro>(clock_type::now() - sent_at_[received_ % window_])
            .count());
    ++cl_.verified;
    ++done_[received_ % window_];
    ++received_;
    if (receives_ < cfg_.count) {
        try {
            post_receive(slot);
        } catch (const std::system_error& e) {
            return post_failed(e);
        }
        ++receives_;
        ++posted_;
    }
    return {};
}

// Sends the next message in every slot whose reply and send are both back. Returns why the
// connection must close (a post failed), or "".
std::string session::send_ready() {
    while (next_ < cfg_.count && done_[next_ % window_] == 2) {
        done_[next_ % window_] = 0;
        try {
            post_message(next_);
        } catch (const std::system_error& e) {
            return post_failed(e);
        }
        ++next_;
        ++posted_;
    }
    return {};
}

std::string session::post_failed(const std::system_error& e) {
    post_error_ = e.what();
    return conn_->completions().device_lost() ? std::string(device_gone) : post_error_;
}

// Why the server may have closed: messages larger than it takes.
std::string session::oversize_note() const {
    if (server_max_ == 0 || size_ <= server_max_) return {};
    return " (messages of " + std::to_string(size_) + " bytes, the server takes " +
           std::to_string(server_max_) + ")";
}

void session::post_receive(std::uint64_t slot) {
    sge_ = {reinterpret_cast<std::uintptr_t>(in() + slot * size_), size_, mr_->native()->lkey};
    ibv_recv_wr wr{.wr_id = slot, .next = nullptr, .sg_list = &sge_, .num_sge = 1};
    conn_->queue_pair().native_qp().post_recv(wr);
}

void session::post_message(std::uint64_t k) {
    const std::uint64_t slot = k % window_;
    for (std::size_t i = 0; i < size_; ++i)
        out()[slot * size_ + i] = pattern(number_, k, i);
    sge_ = {reinterpret_cast<std::uintptr_t>(out() + slot * size_), size_, mr_->native()->lkey};
    ibv_send_wr wr{};
    wr.wr_id = slot | send_bit;
    wr.sg_list = &sge_;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_SEND;
    wr.send_flags = IBV_SEND_SIGNALED;
    sent_at_[slot] = clock_type::now();
    conn_->queue_pair().native_qp().post_send(wr);
}

task<void> run_connection(client& cl, int number) {
    session s(cl, number);
    co_await s.run();
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
