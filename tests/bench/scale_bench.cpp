// scale_bench: ringverbs as the number of queue pairs and completion queues grows, on one thread
// (issue #14). tools/bench-scale runs it in the Soft-RoCE VM next to perftest.
//
//   scale_bench rate --qps N --mode events|busy --cq shared|per_qp [options]
//   scale_bench cqs --count 4096 [options]
//
// rate: two processes, like rdma_bench rate (a socketpair and a fork; each process opens the
//   device itself and has ONE io_context and ONE channel). N RC QP pairs, connected over the
//   socketpair. The client keeps --window 64-byte sends in flight on EVERY QP, as post_send
//   chains of --chain requests (the last one signaled: selective signaling), one coroutine per
//   chain; the server keeps --recv-depth receives posted on every QP as post_recv chains,
//   likewise. --cq shared: each process puts all its QPs on one CQ; per_qp: one CQ per QP.
//   Every QP carries the same number of messages (--iters and --warmup are totals over all
//   QPs). Messages per second are counted at both ends between the end of the warmup and the
//   last message (the sender's is the headline, as ib_send_bw's MsgRate). Each side counts
//   global operator new calls (alloc_counter.hpp), the channel's counters and CPU time in the
//   timed part only; exit status 3 when the timed part allocated.
// cqs: one process, one io_context, one channel (--mode, events by default) and --count CQs of
//   --entries entries each. count / 2 QPs (fewer with --qps), each with its own send CQ and its
//   own receive CQ, connected to each other in pairs through the device (loopback). A burst
//   posts one receive and then one signaled send on every QP: each of the 2 x QPs CQs gets
//   exactly one completion, which one coroutine per CQ takes with co_await cq.next(). Measured
//   per burst (--bursts, the first one a warmup): completions delivered (must equal the posted
//   ones), the channel's wakeups and events, and the time from the first send posted to the
//   last completion delivered. JSON on stdout.
//
// The device is $RINGVERBS_DEVICE (default rxe0), GID index $RINGVERBS_GID_INDEX (default 1),
// port 1. A side that waits longer than --timeout (default 120 s) is killed by SIGALRM.

// GCC 12 sees a coroutine frame made by the replaced operator new and freed by the replaced
// operator delete (malloc/free underneath) as mismatched once both are inlined: a false positive.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#include "alloc_counter.hpp"
#include "bench_common.hpp"

#include <ringverbs/engine/io_context.hpp>
#include <ringverbs/engine/task.hpp>
#include <ringverbs/engine/when_all.hpp>
#include <ringverbs/rdma/channel.hpp>
#include <ringverbs/rdma/cq.hpp>
#include <ringverbs/rdma/qp.hpp>
#include <ringverbs/verbs.hpp>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <coroutine>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <exception>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

namespace {

using namespace ringverbs;
using clock_type = std::chrono::steady_clock;
using window = bench::window<bench::steady_timer>;

// ---------------------------------------------------------------------------------------------
// Options

enum class test_kind { rate, cqs };

// warmup: rate, -1 by default: max(2048, 2 x window x qps), every window filled twice.
struct config : bench::common_options {
    config()
        : common_options{.iters = 20000,
                         .warmup = -1,
                         .size = 64,
                         .window = 32,
                         .chain = 8,
                         .recv_depth = 128} {}
    test_kind test = test_kind::rate;
    bool shared_cq = true;
    unsigned qps = 16;     // rate: QP pairs; cqs: at most this many QPs (0: count / 2)
    unsigned count = 4096; // cqs: completion queues
    int entries = 4;       // cqs: entries per CQ
    unsigned bursts = 6;   // cqs: bursts (the first is a warmup)
};

[[noreturn]] void usage() {
    std::fprintf(
        stderr,
        "usage: scale_bench rate [--qps N] [--mode events|busy|hybrid] [--cq shared|per_qp]\n"
        "         [--iters N] [--warmup N] [--size BYTES] [--window N] [--chain N]\n"
        "         [--recv-depth N] [--timeout SECONDS] [--device NAME] [--gid-index N]\n"
        "       scale_bench cqs [--count N] [--entries N] [--qps N] [--bursts N]\n"
        "         [--mode events|busy|hybrid] [--timeout SECONDS] [--device NAME]\n"
        "         [--gid-index N]\n");
    std::exit(2);
}

// rate or cqs (whose --qps is 0 by default: count / 2 QPs); false for another name.
bool set_test(config& c, std::string_view t) {
    if (t == "rate")
        c.test = test_kind::rate;
    else if (t == "cqs") {
        c.test = test_kind::cqs;
        c.qps = 0;
    } else
        return false;
    return true;
}

// One of scale_bench's own options; false for a name it does not know.
bool parse_option(config& c, std::string_view a, const std::string& v) {
    auto num = [&] { return std::stol(v); };
    if (a == "--cq") {
        if (v == "shared")
            c.shared_cq = true;
        else if (v == "per_qp")
            c.shared_cq = false;
        else
            usage();
    } else if (a == "--qps")
        c.qps = static_cast<unsigned>(num());
    else if (a == "--count")
        c.count = static_cast<unsigned>(num());
    else if (a == "--entries")
        c.entries = static_cast<int>(num());
    else if (a == "--bursts")
        c.bursts = static_cast<unsigned>(num());
    else
        return false;
    return true;
}

config parse(int argc, char** argv) {
    config c;
    bench::parse_command_line(argc, argv, c, usage, set_test, parse_option);
    if (c.size == 0 || c.size > 4096) usage();
    if (c.test == test_kind::rate) {
        if (c.warmup < 0) c.warmup = std::max<long>(2048, 2L * c.window * c.qps);
        if (c.qps == 0 || c.iters < 1 || c.chain == 0 || c.window < c.chain || c.window % c.chain ||
            c.recv_depth < c.window || c.recv_depth % c.chain)
            usage();
    } else if (c.count < 2 || c.entries < 1 || c.bursts < 2) {
        usage();
    }
    return c;
}

// ---------------------------------------------------------------------------------------------
// rate: the run queue, primed

// Many coroutines released together. The io_context's run queue grows to its peak once, the
// first time that many coroutines are ready in the same turn; with hundreds of chain coroutines
// that peak may first come after a short warmup, so (rate) every coroutine is made ready at once
// a few times before the traffic starts: the timed part then runs on grown queues.
struct prime_gate {
    io_context* io;
    std::vector<std::coroutine_handle<>> waiters;
    static constexpr int rounds = 3;
    auto wait() noexcept {
        struct awaiter {
            prime_gate& g;
            bool await_ready() noexcept { return false; }
            void await_suspend(std::coroutine_handle<> c) { g.waiters.push_back(c); }
            void await_resume() noexcept {}
        };
        return awaiter{*this};
    }
    void release() {
        for (std::coroutine_handle<> h : waiters)
            ringverbs::detail::loop(*io).ready(h);
        waiters.clear();
    }
    // Resumes after everything made ready before it.
    auto yield() noexcept {
        struct awaiter {
            io_context* io;
            bool await_ready() noexcept { return false; }
            void await_suspend(std::coroutine_handle<> c) { ringverbs::detail::loop(*io).ready(c); }
            void await_resume() noexcept {}
        };
        return awaiter{io};
    }
};

// ---------------------------------------------------------------------------------------------
// rate: one process of the pair.

struct rate_chain : bench::wr_chain {
    std::size_t qp_index = 0;
};

struct rate_side : bench::process_runtime {
    const config& cfg;
    bool client;
    int sock;
    std::deque<cq> cqs;
    std::vector<qp> qps;
    bench::region buf;
    std::vector<rate_chain> chains;
    std::vector<long> claimed; // per QP: messages whose chain was posted (or is about to be)
    long per_qp = 0;           // messages per QP
    long total = 0;            // over all QPs
    long warmup = 0;
    long done = 0; // messages whose chain completed, over all QPs
    prime_gate prime;
    bench::side_stats stats;
    window win;

    rate_side(const config& k, bool is_client, int s)
        : process_runtime(k, true, channel_options{.priority = 0, .mode = k.mode}), cfg(k),
          client(is_client), sock(s),
          buf(pd, std::max<std::size_t>(k.size, 64), std::byte{'s'}), prime{&io, {}} {
        win.ch = &ch;
        win.out = &stats;
        // Whole chains on every QP, the same count on each.
        const long want = (k.warmup + k.iters + k.qps - 1) / k.qps;
        per_qp = (want + k.chain - 1) / k.chain * k.chain;
        total = per_qp * k.qps;
        warmup = k.warmup;
        claimed.assign(k.qps, 0);
        const std::uint32_t send_wr = client ? k.window : k.chain;
        const std::uint32_t recv_wr = client ? k.chain : k.recv_depth;
        // A CQ holds what its QPs can have outstanding in this benchmark (a window of sends,
        // recv_depth receives per QP), not what their queues could flush at once: rxe rounds
        // every queue up, and with 128 QPs on one CQ that would pass the device's max_cqe.
        // Hence allow_cq_overcommit (a QP error would overrun the CQ; this benchmark has none).
        const long per_qp_entries = static_cast<long>(send_wr + recv_wr) + 16;
        const int ncq = k.shared_cq ? 1 : static_cast<int>(k.qps);
        const long entries = k.shared_cq ? per_qp_entries * k.qps + 64 : per_qp_entries;
        const ibv_device_attr da = dev.query_device();
        for (int i = 0; i < ncq; ++i)
            cqs.emplace_back(ch, cq_options{.entries = static_cast<int>(
                                                std::min<long>(entries, std::max(da.max_cqe, 64))),
                                            .comp_vector = -1,
                                            .solicited_only = false});
        qps.reserve(k.qps);
        for (unsigned i = 0; i < k.qps; ++i) {
            cq& c = cqs[k.shared_cq ? 0 : i];
            qps.emplace_back(pd, c, c,
                             verbs::qp_caps{.max_send_wr = send_wr,
                                            .max_recv_wr = recv_wr,
                                            .max_send_sge = 1,
                                            .max_recv_sge = 1,
                                            .max_inline_data = 0},
                             qp_options{.allow_cq_overcommit = true});
        }
    }

    // INIT -> RTR -> RTS, every QP against the other process's QP of the same index.
    void connect() {
        std::vector<verbs::queue_pair*> native(qps.size());
        for (std::size_t i = 0; i < qps.size(); ++i)
            native[i] = &qps[i].native_qp();
        // As perftest: retry for ever when a receive queue ran dry (the receiver's coroutines
        // repost behind the device, which acks as it consumes), instead of failing the QP.
        bench::connect_qps(native, dev, cfg, sock, 7);
    }

    void account(long n) {
        done += n;
        if (done >= warmup) win.begin(static_cast<std::uint64_t>(done));
        if (done >= total) win.end(static_cast<std::uint64_t>(done));
    }

    // One chain's loop on either side: after the priming rounds, posts its chain (a send chain
    // at the client, a receive chain at the server) until the QP's share is claimed.
    task<void> chain_loop(rate_chain& c, bool sending) {
        qp& q = qps[c.qp_index];
        long& mine = claimed[c.qp_index];
        for (int r = 0; r < prime_gate::rounds; ++r)
            co_await prime.wait();
        while (mine < per_qp) {
            mine += cfg.chain;
            if (sending)
                bench::check(co_await q.post_send(c.swr[0]), "send chain");
            else
                bench::check(co_await q.post_recv(c.rwr[0]), "recv chain");
            account(cfg.chain);
        }
    }

    // Primes the run queue (prime_gate), then lets the chains go: once it resumes from the
    // last yield, every chain coroutine has posted its first chain. The server then tells the
    // client that its receives are posted.
    task<void> start() {
        for (int r = 0; r < prime_gate::rounds; ++r) {
            prime.release();
            co_await prime.yield();
        }
        if (!client) bench::sync_with_peer(sock);
    }

    void run() {
        const unsigned k = cfg.chain;
        const unsigned per = (client ? cfg.window : cfg.recv_depth) / k; // chains per QP
        chains.resize(static_cast<std::size_t>(per) * qps.size());
        const ibv_sge one{reinterpret_cast<std::uintptr_t>(buf.bytes.data()), cfg.size,
                          buf.mr.lkey()};
        for (std::size_t j = 0; j < chains.size(); ++j) {
            rate_chain& c = chains[j];
            c.qp_index = j % qps.size(); // round robin: every QP's first chains start first
            if (client)
                c.make_sends(k, one, 0);
            else
                c.make_recvs(k, one);
        }
        std::vector<task<void>> tasks;
        tasks.reserve(chains.size());
        prime.waiters.reserve(chains.size());
        for (rate_chain& c : chains)
            tasks.push_back(chain_loop(c, client));
        connect();
        // The client waits until the server's receives are posted (its barrier in start()).
        if (client) bench::sync_with_peer(sock);
        // when_all starts its tasks in order, each up to its first suspension (the prime gate),
        // then start().
        io.run(when_all(when_all(std::move(tasks)), start()));
        if (done != total) throw std::runtime_error("not every message completed");
    }
};

int run_rate_process(const config& cfg, bool client, int sock, bench::side_stats& mine,
                     bench::side_stats& server) {
    return bench::run_side("scale_bench", client, sock, mine, server, [&] {
        const auto t0 = clock_type::now();
        rate_side s(cfg, client, sock);
        s.stats.setup_us = static_cast<std::uint64_t>(bench::since_us(t0, clock_type::now()));
        s.run();
        mine = s.stats;
    });
}

void print_side(const char* name, const bench::side_stats& s, bool last) {
    const double m = s.messages ? static_cast<double>(s.messages) : 1.0;
    std::printf("  \"%s\": {\"allocations\": %" PRIu64 ", \"messages\": %" PRIu64
                ", \"seconds\": %.6f, \"mpps\": %.6f, \"wakeups\": %" PRIu64
                ", \"events\": %" PRIu64 ", \"arms\": %" PRIu64 ", \"polls\": %" PRIu64
                ", \"empty_polls\": %" PRIu64 ", \"completions\": %" PRIu64
                ", \"voluntary_ctx_switches\": %" PRIu64
                ", \"wakeups_per_message\": %.4f, \"cpu_us_per_message\": %.3f, \"setup_ms\": "
                "%.1f}%s\n",
                name, s.allocations, s.messages, s.seconds,
                s.seconds > 0 ? static_cast<double>(s.messages) / s.seconds / 1e6 : 0.0,
                s.ch.wakeups, s.ch.events, s.ch.arms, s.ch.polls, s.ch.empty_polls,
                s.ch.completions, s.vcsw, static_cast<double>(s.ch.wakeups) / m, s.cpu_us / m,
                static_cast<double>(s.setup_us) / 1000.0, last ? "" : ",");
}

int main_rate(const config& cfg) {
    bench::side_stats cst, sst; // the server hands its own over the socket
    const int rc = bench::run_pair(cfg.timeout_s, [&](bool client, int sock) {
        if (client) return run_rate_process(cfg, true, sock, cst, sst);
        bench::side_stats st, unused;
        return run_rate_process(cfg, false, sock, st, unused);
    });
    if (rc != 0) {
        std::fprintf(stderr, "scale_bench: rate --qps %u --mode %s --cq %s failed\n", cfg.qps,
                     to_string(cfg.mode), cfg.shared_cq ? "shared" : "per_qp");
        return 1;
    }
    const std::uint64_t allocs = cst.allocations + sst.allocations;
    std::printf(
        "{\n  \"test\": \"rate\",\n  \"qps\": %u,\n  \"mode\": \"%s\",\n  \"cq\": \"%s\",\n",
        cfg.qps, to_string(cfg.mode), cfg.shared_cq ? "shared" : "per_qp");
    std::printf("  \"bytes\": %u,\n  \"window_per_qp\": %u,\n  \"chain\": %u,\n  "
                "\"recv_depth_per_qp\": %u,\n",
                cfg.size, cfg.window, cfg.chain, cfg.recv_depth);
    std::printf("  \"mpps\": %.6f,\n  \"receiver_mpps\": %.6f,\n",
                cst.seconds > 0 ? static_cast<double>(cst.messages) / cst.seconds / 1e6 : 0.0,
                sst.seconds > 0 ? static_cast<double>(sst.messages) / sst.seconds / 1e6 : 0.0);
    std::printf("  \"allocations\": %" PRIu64 ",\n", allocs);
    print_side("client", cst, false);
    print_side("server", sst, true);
    std::printf("}\n");
    if (allocs != 0) {
        std::fprintf(stderr,
                     "scale_bench: the timed part allocated %" PRIu64
                     " times: the hot path must not allocate\n",
                     allocs);
        return 3;
    }
    return 0;
}

// ---------------------------------------------------------------------------------------------
// cqs: many CQs on one channel.

struct burst_stats {
    std::uint64_t posted = 0;
    std::uint64_t delivered = 0;
    double drain_us = 0;
    std::uint64_t allocations = 0;
    channel_counters ch{};
};

struct cqs_side : bench::process_runtime {
    const config& cfg;
    std::deque<cq> cqs;
    std::vector<qp> qps;
    std::string qp_limit; // why fewer QPs than count / 2 were made, if so
    bench::region buf;
    std::vector<ibv_sge> sge;
    std::vector<ibv_send_wr> swr;
    std::vector<ibv_recv_wr> rwr;
    bench::handoff h;
    std::uint64_t delivered = 0;
    std::uint64_t target = 0;
    clock_type::time_point last{};
    std::vector<burst_stats> bursts;
    double create_cqs_ms = 0, create_qps_ms = 0, connect_ms = 0;

    explicit cqs_side(const config& k)
        : process_runtime(k, true, channel_options{.priority = 0, .mode = k.mode}), cfg(k),
          buf(pd, 2 * std::max<std::size_t>(k.size, 64), std::byte{'s'}), h{&io, {}, 0} {
        auto t0 = clock_type::now();
        for (unsigned i = 0; i < k.count; ++i)
            cqs.emplace_back(ch, cq_options{.entries = k.entries, .comp_vector = -1});
        auto t1 = clock_type::now();
        create_cqs_ms = bench::since_us(t0, t1) / 1000.0;
        unsigned want = k.count / 2;
        if (k.qps != 0) want = std::min(want, k.qps);
        want &= ~1u; // whole loopback pairs
        qps.reserve(want);
        for (unsigned i = 0; i < want; ++i) {
            try {
                qps.emplace_back(pd, cqs[2 * i], cqs[2 * i + 1],
                                 verbs::qp_caps{.max_send_wr = 1,
                                                .max_recv_wr = 1,
                                                .max_send_sge = 1,
                                                .max_recv_sge = 1,
                                                .max_inline_data = 0});
            } catch (const std::system_error& e) {
                // The device's limit (ENOMEM): go on with what it gave, and say so.
                qp_limit = std::string("QP ") + std::to_string(i) + ": " + e.what();
                break;
            }
        }
        if (qps.size() % 2) qps.pop_back();
        if (qps.size() < 2) throw std::runtime_error("fewer than 2 QPs: " + qp_limit);
        auto t2 = clock_type::now();
        create_qps_ms = bench::since_us(t1, t2) / 1000.0;
        for (std::size_t i = 0; i + 1 < qps.size(); i += 2)
            verbs::connect_loopback(qps[i].native_qp(), qps[i + 1].native_qp(), k.port,
                                    k.gid_index);
        connect_ms = bench::since_us(t2, clock_type::now()) / 1000.0;
        // One receive and one send per QP, each with an untagged wr_id (its QP's index): the
        // completions go to cq::next().
        const std::size_t n = qps.size();
        sge.assign(2 * n, ibv_sge{reinterpret_cast<std::uintptr_t>(buf.bytes.data()), k.size,
                                  buf.mr.lkey()});
        for (std::size_t i = 0; i < n; ++i)
            sge[n + i].addr += buf.bytes.size() / 2; // receives land in the second half
        swr.assign(n, ibv_send_wr{});
        rwr.assign(n, ibv_recv_wr{});
        for (std::size_t i = 0; i < n; ++i) {
            swr[i].wr_id = i;
            swr[i].sg_list = &sge[i];
            swr[i].num_sge = 1;
            swr[i].opcode = IBV_WR_SEND;
            swr[i].send_flags = IBV_SEND_SIGNALED;
            rwr[i].wr_id = i;
            rwr[i].sg_list = &sge[n + i];
            rwr[i].num_sge = 1;
        }
    }

    // One per busy CQ: one completion per burst.
    task<void> reaper(cq& c, const char* what) {
        for (unsigned b = 0; b < cfg.bursts; ++b) {
            const ibv_wc wc = co_await c.next();
            bench::check(wc, what);
            if (++delivered == target) {
                last = clock_type::now();
                h.signal();
            }
        }
    }

    task<void> driver() {
        const std::size_t n = qps.size();
        for (unsigned b = 0; b < cfg.bursts; ++b) {
            burst_stats s;
            for (std::size_t i = 0; i < n; ++i)
                qps[i].native_qp().post_recv(rwr[i]);
            const channel_counters k0 = ch.counters();
            const std::uint64_t d0 = delivered;
            target = d0 + 2 * n;
            const std::uint64_t a0 = bench::allocations.load(std::memory_order_relaxed);
            const auto t0 = clock_type::now();
            for (std::size_t i = 0; i < n; ++i)
                qps[i].native_qp().post_send(swr[i]);
            co_await h.wait();
            s.allocations = bench::allocations.load(std::memory_order_relaxed) - a0;
            s.posted = 2 * n;
            s.delivered = delivered - d0;
            s.drain_us = bench::since_us(t0, last);
            s.ch = bench::counters_since(k0, ch.counters());
            bursts.push_back(s); // reserved: no allocation in the next burst's window
        }
    }

    void run() {
        bursts.reserve(cfg.bursts);
        std::vector<task<void>> tasks;
        tasks.reserve(2 * qps.size());
        for (std::size_t i = 0; i < qps.size(); ++i) {
            tasks.push_back(reaper(cqs[2 * i], "send"));
            tasks.push_back(reaper(cqs[2 * i + 1], "recv"));
        }
        io.run(when_all(when_all(std::move(tasks)), driver()));
    }
};

double median(std::vector<double> v) {
    if (v.empty()) return 0;
    std::sort(v.begin(), v.end());
    const std::size_t m = v.size() / 2;
    return v.size() % 2 ? v[m] : (v[m - 1] + v[m]) / 2;
}

int main_cqs(const config& cfg) {
    ::alarm(cfg.timeout_s);
    try {
        cqs_side s(cfg);
        const ibv_device_attr da = s.dev.query_device();
        s.run();
        // The first burst is a warmup; the others are measured.
        std::uint64_t posted = 0, delivered = 0, allocs = 0;
        channel_counters sum{};
        std::vector<double> drain_ms, wakeups, events;
        for (std::size_t b = 1; b < s.bursts.size(); ++b) {
            const burst_stats& x = s.bursts[b];
            posted += x.posted;
            delivered += x.delivered;
            allocs += x.allocations;
            sum.wakeups += x.ch.wakeups;
            sum.events += x.ch.events;
            sum.polls += x.ch.polls;
            sum.empty_polls += x.ch.empty_polls;
            sum.arms += x.ch.arms;
            drain_ms.push_back(x.drain_us / 1000.0);
            wakeups.push_back(static_cast<double>(x.ch.wakeups));
            events.push_back(static_cast<double>(x.ch.events));
        }
        const std::size_t measured = s.bursts.size() - 1;
        const double per_burst = static_cast<double>(delivered) / static_cast<double>(measured);
        std::printf("{\n  \"test\": \"cqs\",\n  \"mode\": \"%s\",\n", to_string(cfg.mode));
        std::printf("  \"cqs\": %u,\n  \"cq_entries\": %d,\n  \"cq_capacity\": %d,\n", cfg.count,
                    cfg.entries, s.cqs.front().capacity());
        std::printf("  \"qps\": %zu,\n  \"busy_cqs\": %zu,\n", s.qps.size(), 2 * s.qps.size());
        std::printf("  \"qp_limit\": \"%s\",\n", s.qp_limit.c_str());
        std::printf(
            "  \"device_max_cq\": %d,\n  \"device_max_qp\": %d,\n  \"device_max_cqe\": %d,\n",
            da.max_cq, da.max_qp, da.max_cqe);
        std::printf("  \"bursts_measured\": %zu,\n", measured);
        std::printf("  \"posted_per_burst\": %" PRIu64 ",\n", s.bursts.back().posted);
        std::printf("  \"completions\": %.0f,\n", per_burst);
        std::printf("  \"completions_total\": %" PRIu64 ",\n  \"posted_total\": %" PRIu64 ",\n",
                    delivered, posted);
        std::printf("  \"all_delivered\": %s,\n", delivered == posted ? "true" : "false");
        std::printf("  \"wakeups\": %.1f,\n  \"events\": %.1f,\n", median(wakeups), median(events));
        std::printf("  \"wakeups_per_completion\": %.5f,\n",
                    static_cast<double>(sum.wakeups) / static_cast<double>(delivered));
        std::printf("  \"events_per_completion\": %.5f,\n",
                    static_cast<double>(sum.events) / static_cast<double>(delivered));
        std::printf("  \"polls_per_completion\": %.4f,\n  \"arms_per_completion\": %.4f,\n",
                    static_cast<double>(sum.polls) / static_cast<double>(delivered),
                    static_cast<double>(sum.arms) / static_cast<double>(delivered));
        std::printf("  \"drain_ms\": %.3f,\n", median(drain_ms));
        std::printf("  \"drain_ms_min\": %.3f,\n  \"drain_ms_max\": %.3f,\n",
                    *std::min_element(drain_ms.begin(), drain_ms.end()),
                    *std::max_element(drain_ms.begin(), drain_ms.end()));
        std::printf("  \"warmup_drain_ms\": %.3f,\n", s.bursts.front().drain_us / 1000.0);
        std::printf("  \"allocations\": %" PRIu64 ",\n", allocs);
        std::printf("  \"setup_ms\": {\"create_cqs\": %.1f, \"create_qps\": %.1f, \"connect\": "
                    "%.1f},\n",
                    s.create_cqs_ms, s.create_qps_ms, s.connect_ms);
        std::printf("  \"per_burst\": [");
        for (std::size_t b = 0; b < s.bursts.size(); ++b) {
            const burst_stats& x = s.bursts[b];
            std::printf("%s{\"posted\": %" PRIu64 ", \"delivered\": %" PRIu64
                        ", \"drain_ms\": %.3f, \"wakeups\": %" PRIu64 ", \"events\": %" PRIu64
                        ", \"polls\": %" PRIu64 ", \"empty_polls\": %" PRIu64 ", \"arms\": %" PRIu64
                        ", \"allocations\": %" PRIu64 "}",
                        b ? ", " : "", x.posted, x.delivered, x.drain_us / 1000.0, x.ch.wakeups,
                        x.ch.events, x.ch.polls, x.ch.empty_polls, x.ch.arms, x.allocations);
        }
        std::printf("]\n}\n");
        std::fflush(stdout);
        if (delivered != posted) {
            std::fprintf(stderr, "scale_bench: %" PRIu64 " of %" PRIu64 " completions delivered\n",
                         delivered, posted);
            return 1;
        }
        return 0;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "scale_bench: cqs: %s\n", e.what());
        return 1;
    }
}

} // namespace

int main(int argc, char** argv) {
    const config cfg = parse(argc, argv);
    return cfg.test == test_kind::rate ? main_rate(cfg) : main_cqs(cfg);
}
