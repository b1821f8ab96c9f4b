// rdma_bench: ringverbs over a real RDMA device, measured the way perftest measures, so that
// tools/bench-rdma can put the two side by side in one VM boot.
//
//   rdma_bench lat  --mode events|busy|hybrid [options]   2-byte RC send/recv ping-pong
//   rdma_bench rate --mode events|busy|hybrid [options]   one-way stream of sends, many in flight
//   rdma_bench tsc                                          the TSC rate (MHz) it measures with
//
// Two processes, like perftest's server and client: the program makes a socketpair and forks;
// each process opens the device itself, makes its own io_context, channel, CQ and RC QP, and
// the two exchange QPN, PSN and GID over the socketpair and connect. The device is
// $RINGVERBS_DEVICE (default rxe0), GID index $RINGVERBS_GID_INDEX (default 1), port 1.
//
// lat: the client stamps the TSC just before posting each ping and reports, like ib_send_lat,
//   half the time between consecutive posts (a round trip / 2): median ("typical"), mean, min,
//   p99. Pings and pongs are co_await q.send() with send_options::signaled = false (--send
//   unsignaled, the default): like ib_send_lat, which signals one send in many, the await
//   ends at the post and the qp signals one in signal_interval() itself. --send await waits
//   for every send's own completion instead; --send raw posts the sends with the verbs call,
//   unsignaled but 1 in 32, outside the runtime, for comparison only. Receives are pre-posted
//   with the verbs call and taken with co_await cq.next() (--recv next, the default), or with
//   cq::try_next, yielding to the loop between tries (--recv poll: the coroutine polls on its
//   own, busy mode's way without an awaiter per message; it spins in every mode), or
//   awaited one by one with co_await q.recv() by a receiver coroutine that hands each to the
//   sender (--recv await). In events mode the CQ is armed solicited-only and messages go out
//   solicited (--solicited 1, the default there): a send completion then raises no event of
//   its own and is reaped by the wakeup the pong causes, one wakeup per round trip, as in
//   ib_send_lat -e. --raw 1 runs the same ping-pong with plain verbs and no runtime at all
//   (busy or events), the floor of this harness. --samples FILE (client) also writes every
//   half round trip those statistics come from (the timed iterations only, in microseconds,
//   one a line, in the order measured) to FILE, after the run and its report. --stats 0
//   reports no percentiles: their sorting, after the run, grows faster than the run
//   (tools/bench-cost counts instructions without it). --event-read syscall reads the CQ events
//   with ibv_get_cq_event after a poll of the channel's fd instead of through the ring
//   (channel_options::read).
// rate: the client keeps --window sends in flight as post_send chains of --chain requests (the
//   last one signaled: selective signaling), the server keeps --recv-depth receives posted as
//   post_recv chains. Messages per second are counted at the sender between the completion of
//   the warmup and the completion of the last message, like ib_send_bw's MsgRate.
//
// Across two hosts (tools/bench-cluster): `--listen ADDR:PORT` runs only the server, on one
// TCP connection accepted at ADDR:PORT (the exchange the socketpair carries otherwise), and
// `--connect ADDR:PORT` only the client, which prints the JSON; the device and GID index are
// each host's own ($RINGVERBS_DEVICE, $RINGVERBS_GID_INDEX).
//
// Both processes count global operator new calls (alloc_counter.hpp) and the channel's
// counters, context switches and CPU time during the timed part only. The JSON on stdout has
// them per side; the exit status is 3 when the timed part allocated anything, 1 on any other
// failure (a side that waits longer than --timeout, default 120 s, is killed by SIGALRM).

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

#include <arpa/inet.h>
#include <fcntl.h>
#include <liburing.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>
#include <x86intrin.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

namespace {

using namespace ringverbs;
using namespace std::chrono_literals;

// ---------------------------------------------------------------------------------------------
// Options

enum class test_kind { lat, rate };
enum class recv_style { next, poll, await };
enum class send_style { await, unsignaled, raw };

struct config : bench::common_options {
    config()
        : common_options{.iters = 2000,
                         .warmup = 200,
                         .size = 2,
                         .window = 128,
                         .chain = 16,
                         .recv_depth = 1024} {}
    test_kind test = test_kind::lat;
    bool inline_data = false; // perftest on rxe reports "Max inline data: 0[B]": it does not inline
    int solicited = -1;       // -1: on for lat in events mode, off otherwise
    recv_style recv = recv_style::next;
    send_style send = send_style::unsignaled;
    long hybrid_spin_us = 50;
    long hybrid_spin_max_us = 0; // channel_options::hybrid_spin_max (0: fixed window)
    bool single_issuer = true;   // io_context_options::single_issuer (DEFER_TASKRUN)
    bool raw = false;            // lat: plain verbs, no runtime (the harness's floor)
    bool raw_uring = false;      // --raw 1, events: wait in a bare liburing poll, then read
    unsigned ack_batch = 64;
    unsigned poll_batch = 32;
    event_read read = event_read::ring; // channel_options::read (events and hybrid)
    std::string listen;                 // ADDR:PORT: the server alone, across hosts
    std::string connect;                // ADDR:PORT: the client alone, across hosts
    std::string samples; // lat: FILE for every half round trip (us), written after the run
    bool stats = true;   // lat: the percentiles (--stats 0: none, for tools/bench-cost's counts)
};

[[noreturn]] void usage() {
    std::fprintf(
        stderr,
        "usage: rdma_bench lat|rate [--mode events|busy|hybrid] [--iters N] [--warmup N]\n"
        "         [--size BYTES] [--inline 0|1] [--solicited 0|1] [--recv next|poll|await]\n"
        "         [--send unsignaled|await|raw]\n"
        "         [--window N] [--chain N] [--recv-depth N] [--hybrid-spin-us N]\n"
        "         [--hybrid-spin-max-us N]\n"
        "         [--ack-batch N] [--poll-batch N] [--device NAME] [--gid-index N]\n"
        "         [--ring defer|coop] [--event-read ring|syscall] [--raw 0|1]\n"
        "         [--raw-wait read|uring]\n"
        "         [--timeout SECONDS] [--stats 0|1]\n"
        "         [--listen ADDR:PORT | --connect ADDR:PORT] [--samples FILE (lat)]\n");
    std::exit(2);
}

// lat or rate, and what rate changes of lat's defaults; false for another name.
bool set_test(config& c, std::string_view t) {
    if (t == "lat")
        c.test = test_kind::lat;
    else if (t == "rate") {
        c.test = test_kind::rate;
        c.size = 64;
        c.iters = 20000;
        c.warmup = 2048;
    } else
        return false;
    return true;
}

// One of rdma_bench's own options; false for a name it does not know.
bool parse_option(config& c, std::string_view a, const std::string& v) {
    auto num = [&] { return std::stol(v); };
    if (a == "--inline")
        c.inline_data = num() != 0;
    else if (a == "--solicited")
        c.solicited = num() != 0;
    else if (a == "--recv") {
        if (v == "next")
            c.recv = recv_style::next;
        else if (v == "poll")
            c.recv = recv_style::poll;
        else if (v == "await")
            c.recv = recv_style::await;
        else
            usage();
    } else if (a == "--send") {
        if (v == "await")
            c.send = send_style::await;
        else if (v == "unsignaled")
            c.send = send_style::unsignaled;
        else if (v == "raw")
            c.send = send_style::raw;
        else
            usage();
    } else if (a == "--hybrid-spin-us")
        c.hybrid_spin_us = num();
    else if (a == "--hybrid-spin-max-us")
        c.hybrid_spin_max_us = num();
    else if (a == "--ack-batch")
        c.ack_batch = static_cast<unsigned>(num());
    else if (a == "--poll-batch")
        c.poll_batch = static_cast<unsigned>(num());
    else if (a == "--stats")
        c.stats = num() != 0;
    else if (a == "--raw")
        c.raw = num() != 0;
    else if (a == "--raw-wait") {
        if (v == "read")
            c.raw_uring = false;
        else if (v == "uring")
            c.raw_uring = true;
        else
            usage();
    } else if (a == "--event-read") {
        const auto r = parse_event_read(v);
        if (!r) usage();
        c.read = *r;
    } else if (a == "--ring") {
        if (v == "defer")
            c.single_issuer = true;
        else if (v == "coop")
            c.single_issuer = false;
        else
            usage();
    } else if (a == "--listen")
        c.listen = v;
    else if (a == "--connect")
        c.connect = v;
    else if (a == "--samples")
        c.samples = v;
    else
        return false;
    return true;
}

config parse(int argc, char** argv) {
    config c;
    bench::parse_command_line(argc, argv, c, usage, set_test, parse_option);
    if (c.solicited < 0) c.solicited = c.test == test_kind::lat && c.mode == polling_mode::events;
    if (c.send == send_style::raw && c.recv == recv_style::await) usage();
    if (c.recv == recv_style::poll && (c.test != test_kind::lat || c.raw)) usage();
    if (c.raw && (c.test != test_kind::lat || c.mode == polling_mode::hybrid)) usage();
    if (!c.samples.empty() && c.test != test_kind::lat) usage();
    if (c.iters < 2 || c.warmup < 0 || c.size == 0 || c.size > 4096) usage();
    if (c.test == test_kind::rate) {
        if (c.chain == 0 || c.window < c.chain || c.window % c.chain || c.recv_depth < c.chain ||
            c.recv_depth % c.chain)
            usage();
        // Whole chains only, at both ends.
        c.iters = (c.iters + c.chain - 1) / c.chain * c.chain;
        c.warmup = (c.warmup + c.chain - 1) / c.chain * c.chain;
    }
    return c;
}

// ---------------------------------------------------------------------------------------------
// Time: the TSC, as perftest does (the guest's clocksource is the emulated HPET, which makes
// every clock_gettime a trap), calibrated against steady_clock once, before the fork.

double tsc_per_us = 0;
unsigned ring_flags = 0; // the io_uring setup flags the kernel granted (client)

double calibrate_tsc() {
    auto t0 = std::chrono::steady_clock::now();
    std::uint64_t c0 = __rdtsc();
    std::this_thread::sleep_for(200ms);
    auto t1 = std::chrono::steady_clock::now();
    std::uint64_t c1 = __rdtsc();
    double us = std::chrono::duration<double, std::micro>(t1 - t0).count();
    return static_cast<double>(c1 - c0) / us;
}

// What one steady_clock::now() costs here (hybrid mode reads the clock every spin turn).
double clock_now_ns() {
    constexpr int n = 2000;
    std::uint64_t c0 = __rdtsc();
    for (int i = 0; i < n; ++i) {
        auto t = std::chrono::steady_clock::now();
        asm volatile("" : : "r"(&t) : "memory");
    }
    return static_cast<double>(__rdtsc() - c0) / tsc_per_us * 1000.0 / n;
}

// The timed part's clock: the TSC, for window<>.
struct tsc_timer {
    using time_point = std::uint64_t;
    static time_point now() noexcept { return __rdtsc(); }
    static double seconds(time_point c0, time_point c1) {
        return static_cast<double>(c1 - c0) / tsc_per_us / 1e6;
    }
};
using window = bench::window<tsc_timer>;

// INIT -> RTR -> RTS against the other process's QP, whose QPN, PSN and GID come over the
// socket.
void connect_qp(verbs::queue_pair& qp, const verbs::context& dev, const config& cfg, int sock) {
    verbs::queue_pair* const one[] = {&qp};
    bench::connect_qps(one, dev, cfg, sock);
}

// ---------------------------------------------------------------------------------------------
// One process: device, runtime objects, connection, then the test.

struct side : bench::process_runtime {
    const config& cfg;
    bool client;
    int sock;
    cq c;
    qp q;
    bench::side_stats stats;
    window win;

    side(const config& k, bool is_client, int s)
        : process_runtime(
              k, k.single_issuer,
              channel_options{.priority = 0,
                              .mode = k.mode,
                              .hybrid_spin = std::chrono::microseconds(k.hybrid_spin_us),
                              .ack_batch = k.ack_batch,
                              .poll_batch = k.poll_batch,
                              .hybrid_spin_max = std::chrono::microseconds(k.hybrid_spin_max_us),
                              .read = k.read}),
          cfg(k), client(is_client), sock(s),
          // What the QP's two queues can hold at once (the qp refuses a smaller CQ).
          c(ch, cq_options{.entries = k.test == test_kind::rate
                                          ? static_cast<int>(k.window + k.recv_depth) + 33
                                          : 256,
                           .comp_vector = -1,
                           .solicited_only = k.solicited != 0}),
          q(pd, c, c,
            verbs::qp_caps{.max_send_wr = k.test == test_kind::rate ? k.window + 16 : 64,
                           .max_recv_wr = k.test == test_kind::rate ? k.recv_depth + 16 : 64,
                           .max_send_sge = 1,
                           .max_recv_sge = 1,
                           .max_inline_data =
                               k.inline_data ? std::max<std::uint32_t>(k.size, 64) : 0}) {
        win.ch = &ch;
        win.out = &stats;
    }

    void connect() { connect_qp(q.native_qp(), dev, cfg, sock); }

    void barrier() { bench::sync_with_peer(sock); }

    // --- lat ---------------------------------------------------------------------------------

    static constexpr unsigned lat_slots = 16;

    struct lat_state {
        bench::region sbuf;
        bench::region rbuf;
        ibv_sge rsge[lat_slots]{};
        ibv_recv_wr rwr[lat_slots]{};
        std::vector<std::uint64_t> stamps;
        bench::handoff h;
        lat_state(side& s)
            : sbuf(s.pd, std::max<std::size_t>(s.cfg.size, 64)),
              rbuf(s.pd, std::max<std::size_t>(s.cfg.size, 64) * lat_slots),
              stamps(static_cast<std::size_t>(s.cfg.warmup + s.cfg.iters + 1)), h{&s.io, {}, 0} {
            std::memset(sbuf.bytes.data(), s.client ? 'p' : 'P', sbuf.bytes.size());
            const std::size_t stride = std::max<std::size_t>(s.cfg.size, 64);
            for (unsigned i = 0; i < lat_slots; ++i) {
                local_buffer b = rbuf.at(i * stride, stride);
                rsge[i] = {reinterpret_cast<std::uintptr_t>(b.addr), b.length, b.lkey};
                rwr[i].wr_id = i; // untagged: the completion goes to cq::next()
                rwr[i].sg_list = &rsge[i];
                rwr[i].num_sge = 1;
            }
        }
    };

    local_buffer lat_payload(lat_state& ls) {
        return cfg.inline_data ? local_buffer::inline_data(
                                     std::span<const std::byte>(ls.sbuf.bytes.data(), cfg.size))
                               : ls.sbuf.at(0, cfg.size);
    }
    // --send unsignaled: the payload is never written during the run, so a non-inline
    // unsignaled send is safe too (its buffer is only read, and stays untouched).
    send_options lat_send_options() const {
        return send_options{.imm = {},
                            .inline_data = cfg.inline_data,
                            .solicited = cfg.solicited != 0,
                            .fence = false,
                            .signaled = cfg.send != send_style::unsignaled};
    }

    // The client's last message: unsignaled (no completion to wait for, so nothing is left
    // pending whatever the arming), posted with the verbs call. It lets the server's last pong
    // complete in solicited-only mode, where only a solicited receive raises an event.
    void post_fin(lat_state& ls) {
        ibv_sge sge{reinterpret_cast<std::uintptr_t>(ls.sbuf.bytes.data()), cfg.size,
                    ls.sbuf.mr.lkey()};
        ibv_send_wr wr{};
        wr.wr_id = 0;
        wr.sg_list = &sge;
        wr.num_sge = 1;
        wr.opcode = IBV_WR_SEND;
        wr.send_flags = IBV_SEND_SOLICITED;
        q.native_qp().post_send(wr);
    }

    // --send raw (for comparison only: what perftest does, outside the runtime): the send is posted
    // with the verbs call, unsignaled but for one in 32 (to free send queue slots), and nobody
    // awaits it; its rare completion is skipped by the cq.next() consumer.
    static constexpr std::uint64_t raw_send_id = 0xffffffffu;
    long raw_sends = 0;
    ibv_sge raw_sge{};
    ibv_send_wr raw_wr{};
    void post_raw_send(lat_state& ls) {
        raw_sge = {reinterpret_cast<std::uintptr_t>(ls.sbuf.bytes.data()), cfg.size,
                   ls.sbuf.mr.lkey()};
        raw_wr = {};
        raw_wr.wr_id = raw_send_id;
        raw_wr.sg_list = &raw_sge;
        raw_wr.num_sge = 1;
        raw_wr.opcode = IBV_WR_SEND;
        raw_wr.send_flags = (cfg.solicited ? IBV_SEND_SOLICITED : 0) |
                            (cfg.inline_data ? IBV_SEND_INLINE : 0) |
                            (++raw_sends % 32 == 0 ? IBV_SEND_SIGNALED : 0);
        q.native_qp().post_send(raw_wr);
    }
    // Whether `wc` is the completion of a raw send (to skip).
    static bool raw_send_done(const ibv_wc& wc) {
        if (wc.wr_id != raw_send_id) return false;
        bench::check(wc, "raw send");
        return true;
    }

    // --recv next: receives are posted with the verbs call, their completions (untagged
    // wr_ids) taken with co_await cq.next() (--recv poll: with cq::try_next and yield).
    task<void> lat_client_next(lat_state& ls) {
        const long total = cfg.warmup + cfg.iters;
        const local_buffer payload = lat_payload(ls);
        const send_options so = lat_send_options();
        for (long i = 0; i < total; ++i) {
            if (i == cfg.warmup) win.begin();
            ls.stamps[static_cast<std::size_t>(i)] = __rdtsc();
            ibv_wc wc;
            if (cfg.send != send_style::raw) {
                bench::check(co_await q.send(payload, so), "ping send");
                if (cfg.recv == recv_style::next)
                    wc = co_await c.next();
                else
                    while (!c.try_next(wc))
                        co_await io.yield();
            } else {
                post_raw_send(ls);
                do
                    if (cfg.recv == recv_style::next)
                        wc = co_await c.next();
                    else
                        while (!c.try_next(wc))
                            co_await io.yield();
                while (raw_send_done(wc));
            }
            bench::check(wc, "pong recv");
            q.native_qp().post_recv(ls.rwr[wc.wr_id]);
        }
        ls.stamps[static_cast<std::size_t>(total)] = __rdtsc();
        win.end(static_cast<std::uint64_t>(cfg.iters));
        post_fin(ls);
    }

    task<void> lat_server_next(lat_state& ls) {
        const long total = cfg.warmup + cfg.iters;
        const local_buffer payload = lat_payload(ls);
        const send_options so = lat_send_options();
        for (long i = 0; i < total; ++i) {
            if (i == cfg.warmup) win.begin();
            ibv_wc wc;
            do
                if (cfg.recv == recv_style::next)
                    wc = co_await c.next();
                else
                    while (!c.try_next(wc))
                        co_await io.yield();
            while (raw_send_done(wc));
            bench::check(wc, "ping recv");
            q.native_qp().post_recv(ls.rwr[wc.wr_id]);
            if (cfg.send != send_style::raw)
                bench::check(co_await q.send(payload, so), "pong send");
            else
                post_raw_send(ls);
        }
        win.end(static_cast<std::uint64_t>(cfg.iters));
        ibv_wc fin;
        do
            fin = co_await c.next();
        while (raw_send_done(fin));
        bench::check(fin, "fin recv");
    }

    // --recv await: one coroutine per side awaits every receive with co_await q.recv() (one
    // posted at a time: the peer cannot send the next message before this side answered,
    // and the receiver re-posts before the answer goes out), and hands it to the sender.
    task<void> lat_receiver(lat_state& ls, long count) {
        const std::size_t stride = std::max<std::size_t>(cfg.size, 64);
        for (long i = 0; i < count; ++i) {
            bench::check(co_await q.recv(ls.rbuf.at(0, stride)), "recv");
            ls.h.signal();
        }
    }

    task<void> lat_client_await_sender(lat_state& ls) {
        const long total = cfg.warmup + cfg.iters;
        const local_buffer payload = lat_payload(ls);
        const send_options so = lat_send_options();
        for (long i = 0; i < total; ++i) {
            if (i == cfg.warmup) win.begin();
            ls.stamps[static_cast<std::size_t>(i)] = __rdtsc();
            bench::check(co_await q.send(payload, so), "ping send");
            co_await ls.h.wait();
        }
        ls.stamps[static_cast<std::size_t>(total)] = __rdtsc();
        win.end(static_cast<std::uint64_t>(cfg.iters));
        post_fin(ls);
    }

    task<void> lat_server_await_sender(lat_state& ls) {
        const long total = cfg.warmup + cfg.iters;
        const local_buffer payload = lat_payload(ls);
        const send_options so = lat_send_options();
        for (long i = 0; i < total; ++i) {
            if (i == cfg.warmup) win.begin();
            co_await ls.h.wait();
            bench::check(co_await q.send(payload, so), "pong send");
        }
        win.end(static_cast<std::uint64_t>(cfg.iters));
    }

    task<void> gate() {
        barrier(); // runs once the tasks started before it have posted their receives
        co_return;
    }

    void run_lat(std::vector<double>& half_rtt_us) {
        lat_state ls(*this);
        const long total = cfg.warmup + cfg.iters;
        connect();
        if (cfg.recv != recv_style::await) {
            for (auto& w : ls.rwr)
                q.native_qp().post_recv(w); // INIT or later: after connect()
            barrier();
            io.run(client ? lat_client_next(ls) : lat_server_next(ls));
        } else if (client) {
            barrier(); // the server's receiver posted before its barrier
            io.run(when_all(lat_receiver(ls, total), lat_client_await_sender(ls)));
        } else {
            io.run(when_all(lat_receiver(ls, total + 1), gate(), lat_server_await_sender(ls)));
        }
        if (client) {
            half_rtt_us.reserve(static_cast<std::size_t>(cfg.iters));
            for (long i = cfg.warmup; i < total; ++i) {
                auto d = ls.stamps[static_cast<std::size_t>(i + 1)] -
                         ls.stamps[static_cast<std::size_t>(i)];
                half_rtt_us.push_back(static_cast<double>(d) / tsc_per_us / 2.0);
            }
        }
    }

    // --- rate --------------------------------------------------------------------------------

    using rate_chain = bench::wr_chain;

    struct rate_state {
        bench::region buf;
        std::vector<rate_chain> chains;
        long claimed = 0; // messages whose chain was posted (or is about to be)
        long done = 0;    // messages whose chain completed
    };

    task<void> rate_sender(rate_state& rs, rate_chain& ch) {
        const long total = cfg.warmup + cfg.iters;
        while (rs.claimed < total) {
            rs.claimed += cfg.chain;
            bench::check(co_await q.post_send(ch.swr[0]), "send chain");
            rs.done += cfg.chain;
            if (rs.done >= cfg.warmup) win.begin();
            if (rs.done >= total) win.end(static_cast<std::uint64_t>(cfg.iters));
        }
    }

    task<void> rate_receiver(rate_state& rs, rate_chain& ch) {
        const long total = cfg.warmup + cfg.iters;
        while (rs.claimed < total) {
            rs.claimed += cfg.chain;
            bench::check(co_await q.post_recv(ch.rwr[0]), "recv chain");
            rs.done += cfg.chain;
            if (rs.done >= cfg.warmup) win.begin();
            if (rs.done >= total) win.end(static_cast<std::uint64_t>(cfg.iters));
        }
    }

    void run_rate() {
        const unsigned k = cfg.chain;
        const unsigned n = client ? cfg.window / k : cfg.recv_depth / k;
        rate_state rs{bench::region(pd, std::max<std::size_t>(cfg.size, 64)),
                      std::vector<rate_chain>(n)};
        std::memset(rs.buf.bytes.data(), 's', rs.buf.bytes.size());
        const ibv_sge one{reinterpret_cast<std::uintptr_t>(rs.buf.bytes.data()), cfg.size,
                          rs.buf.mr.lkey()};
        for (rate_chain& ch : rs.chains) {
            if (client)
                ch.make_sends(k, one, cfg.inline_data ? IBV_SEND_INLINE : 0);
            else
                ch.make_recvs(k, one);
        }
        std::vector<task<void>> tasks;
        tasks.reserve(n);
        for (rate_chain& ch : rs.chains)
            tasks.push_back(client ? rate_sender(rs, ch) : rate_receiver(rs, ch));
        connect();
        if (client) {
            barrier(); // the server's receives are posted (its barrier follows them)
            io.run(when_all(std::move(tasks)));
        } else {
            // when_all starts its tasks in order, each up to its first suspension: every
            // receiver has posted its chain before gate() tells the client to start.
            io.run(when_all(when_all(std::move(tasks)), gate()));
        }
    }
};

// --raw: the same ping-pong with plain verbs and no runtime, written like ib_send_lat's loop:
// unsignaled sends (1 in 32 signaled, to free send queue slots), receives re-posted as they
// complete; busy: ibv_poll_cq until something comes; events: a blocking ibv_get_cq_event, ack,
// re-arm, poll. The floor of this harness, to tell the runtime's cost from everything else.
// --raw-wait uring (events): instead of blocking in the read, wait in a bare liburing ring (the
// ring flags io_context prefers, a multishot poll on the channel's fd, io_uring_submit_and_wait)
// and read the event after: what any event loop over io_uring costs, without the runtime.
struct raw_side {
    static constexpr unsigned slots = 16;
    static constexpr std::uint64_t send_id = 0xffffffffu;
    const config& cfg;
    bool client;
    int sock;
    verbs::context dev;
    verbs::protection_domain pd;
    verbs::completion_channel chan;
    verbs::completion_queue cq;
    verbs::queue_pair qp;
    bench::region sbuf;
    bench::region rbuf;
    ibv_sge rsge[slots]{};
    ibv_recv_wr rwr[slots]{};
    ibv_sge ssge{};
    ibv_send_wr swr{};
    long sends = 0;
    std::vector<std::uint64_t> stamps;
    bench::side_stats stats;
    window win;
    bool events;
    bool uring = false;
    io_uring ring{};
    bool poll_armed = false;

    raw_side(const config& k, bool is_client, int s)
        : cfg(k), client(is_client), sock(s), dev(k.device), pd(dev), chan(dev),
          cq(dev, 256, &chan, 0, nullptr),
          qp(pd, cq, cq,
             verbs::qp_caps{.max_send_wr = 128,
                            .max_recv_wr = 64,
                            .max_send_sge = 1,
                            .max_recv_sge = 1,
                            .max_inline_data =
                                k.inline_data ? std::max<std::uint32_t>(k.size, 64) : 0}),
          sbuf(pd, std::max<std::size_t>(k.size, 64)),
          rbuf(pd, std::max<std::size_t>(k.size, 64) * slots),
          stamps(static_cast<std::size_t>(k.warmup + k.iters + 1)),
          events(k.mode == polling_mode::events) {
        win.out = &stats;
        const std::size_t stride = std::max<std::size_t>(k.size, 64);
        for (unsigned i = 0; i < slots; ++i) {
            local_buffer b = rbuf.at(i * stride, stride);
            rsge[i] = {reinterpret_cast<std::uintptr_t>(b.addr), b.length, b.lkey};
            rwr[i].wr_id = i;
            rwr[i].sg_list = &rsge[i];
            rwr[i].num_sge = 1;
        }
        ssge = {reinterpret_cast<std::uintptr_t>(sbuf.bytes.data()), k.size, sbuf.mr.lkey()};
        swr.wr_id = send_id;
        swr.sg_list = &ssge;
        swr.num_sge = 1;
        swr.opcode = IBV_WR_SEND;
        if (events && k.raw_uring) {
            io_uring_params p{};
            p.flags = IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN;
            if (io_uring_queue_init_params(8, &ring, &p) != 0) {
                p = {};
                if (int r = io_uring_queue_init_params(8, &ring, &p); r != 0)
                    throw std::runtime_error(std::string("io_uring_queue_init_params: ") +
                                             std::strerror(-r));
            }
            uring = true;
            cq.req_notify(cfg.solicited != 0);
        } else if (events) {
            // A blocking read, like perftest (the wrapper made the fd non-blocking).
            int fl = ::fcntl(chan.fd(), F_GETFL);
            ::fcntl(chan.fd(), F_SETFL, fl & ~O_NONBLOCK);
            cq.req_notify(cfg.solicited != 0);
        }
    }
    ~raw_side() {
        if (uring) io_uring_queue_exit(&ring);
    }
    raw_side(const raw_side&) = delete;
    raw_side& operator=(const raw_side&) = delete;

    // --raw-wait uring: until the channel's fd is readable, as a multishot poll reports it.
    void uring_wait() {
        if (!poll_armed) {
            io_uring_sqe* sqe = io_uring_get_sqe(&ring);
            io_uring_prep_poll_multishot(sqe, chan.fd(), POLLIN);
            poll_armed = true;
        }
        for (;;) {
            int r = io_uring_submit_and_wait(&ring, 1);
            if (r < 0 && r != -EINTR) throw std::runtime_error("io_uring_submit_and_wait failed");
            bool readable = false;
            unsigned head;
            unsigned seen = 0;
            io_uring_cqe* cqe;
            io_uring_for_each_cqe(&ring, head, cqe) {
                ++seen;
                if (cqe->res > 0) readable = true;
                if (!(cqe->flags & IORING_CQE_F_MORE)) poll_armed = false;
            }
            io_uring_cq_advance(&ring, seen);
            if (readable) return;
            if (!poll_armed) {
                io_uring_sqe* sqe = io_uring_get_sqe(&ring);
                io_uring_prep_poll_multishot(sqe, chan.fd(), POLLIN);
                poll_armed = true;
            }
        }
    }

    void post_send(bool fin = false) {
        swr.send_flags = (cfg.solicited ? IBV_SEND_SOLICITED : 0) |
                         (cfg.inline_data ? IBV_SEND_INLINE : 0) |
                         (!fin && ++sends % 32 == 0 ? IBV_SEND_SIGNALED : 0);
        qp.post_send(swr);
    }

    // The next receive completion; send completions on the way are checked and dropped.
    ibv_wc wait_recv() {
        for (;;) {
            if (events) {
                ibv_cq* ev_cq = nullptr;
                void* ev_ctx = nullptr;
                if (uring) {
                    uring_wait();
                    while (ibv_get_cq_event(chan.native(), &ev_cq, &ev_ctx) != 0) {
                        if (errno != EAGAIN) throw std::runtime_error("ibv_get_cq_event failed");
                        uring_wait();
                    }
                } else if (ibv_get_cq_event(chan.native(), &ev_cq, &ev_ctx) != 0)
                    throw std::runtime_error("ibv_get_cq_event failed");
                ibv_ack_cq_events(ev_cq, 1);
                cq.req_notify(cfg.solicited != 0);
            }
            ibv_wc wc[4];
            int n;
            do {
                n = ibv_poll_cq(cq.native(), 4, wc);
                if (n == 0) ++stats.run_empty_polls;
            } while (n == 0 && !events);
            if (n < 0) throw std::runtime_error("ibv_poll_cq failed");
            ibv_wc got{};
            bool have = false;
            for (int i = 0; i < n; ++i) {
                bench::check(wc[i], "raw completion");
                if (wc[i].wr_id == send_id) continue;
                got = wc[i];
                have = true;
            }
            if (have) return got;
        }
    }

    void run(std::vector<double>& half_rtt_us) {
        const long total = cfg.warmup + cfg.iters;
        connect_qp(qp, dev, cfg, sock);
        for (auto& w : rwr)
            qp.post_recv(w);
        bench::sync_with_peer(sock);
        if (client) {
            for (long i = 0; i < total; ++i) {
                if (i == cfg.warmup) win.begin();
                stamps[static_cast<std::size_t>(i)] = __rdtsc();
                post_send();
                ibv_wc wc = wait_recv();
                qp.post_recv(rwr[wc.wr_id]);
            }
            stamps[static_cast<std::size_t>(total)] = __rdtsc();
            win.end(static_cast<std::uint64_t>(cfg.iters));
            post_send(true);
            half_rtt_us.reserve(static_cast<std::size_t>(cfg.iters));
            for (long i = cfg.warmup; i < total; ++i)
                half_rtt_us.push_back(static_cast<double>(stamps[static_cast<std::size_t>(i + 1)] -
                                                          stamps[static_cast<std::size_t>(i)]) /
                                      tsc_per_us / 2.0);
        } else {
            for (long i = 0; i < total; ++i) {
                if (i == cfg.warmup) win.begin();
                ibv_wc wc = wait_recv();
                qp.post_recv(rwr[wc.wr_id]);
                post_send();
            }
            win.end(static_cast<std::uint64_t>(cfg.iters));
            wait_recv(); // fin
        }
    }
};

double percentile(std::vector<double> v, double p) {
    std::sort(v.begin(), v.end());
    if (v.empty()) return 0;
    // perftest's "typical" is the plain median of the sorted deltas.
    std::size_t i = static_cast<std::size_t>(p * static_cast<double>(v.size() - 1) + 0.5);
    return v[std::min(i, v.size() - 1)];
}

void print_counters(const char* name, const bench::side_stats& s, bool last) {
    std::printf("  \"%s\": {\"allocations\": %" PRIu64 ", \"messages\": %" PRIu64
                ", \"seconds\": %.6f, \"wakeups\": %" PRIu64 ", \"events\": %" PRIu64
                ", \"acks\": %" PRIu64 ", \"arms\": %" PRIu64 ", \"polls\": %" PRIu64
                ", \"empty_polls\": %" PRIu64 ", \"completions\": %" PRIu64
                ", \"voluntary_ctx_switches\": %" PRIu64 ", \"involuntary_ctx_switches\": %" PRIu64
                ", \"cpu_us_per_message\": %.3f, \"run_empty_polls\": %" PRIu64 "}%s\n",
                name, s.allocations, s.messages, s.seconds, s.ch.wakeups, s.ch.events, s.ch.acks,
                s.ch.arms, s.ch.polls, s.ch.empty_polls, s.ch.completions, s.vcsw, s.ivcsw,
                s.messages ? s.cpu_us / static_cast<double>(s.messages) : 0.0, s.run_empty_polls,
                last ? "" : ",");
}

// Runs one side. The server hands its stats to the client before either tears its QP down
// (the client's last message must reach the server before the client's QP goes).
int run_process(const config& cfg, bool client, int sock, std::vector<double>& samples,
                bench::side_stats& mine, bench::side_stats& server) {
    return bench::run_side("rdma_bench", client, sock, mine, server, [&] {
        if (cfg.raw) {
            raw_side s(cfg, client, sock);
            s.run(samples);
            mine = s.stats; // run_empty_polls: counted in wait_recv
        } else {
            side s(cfg, client, sock);
            ring_flags = s.io.setup_flags();
            if (cfg.test == test_kind::lat)
                s.run_lat(samples);
            else
                s.run_rate();
            mine = s.stats;
            mine.run_empty_polls = s.ch.counters().empty_polls;
        }
    });
}

// ADDR:PORT (IPv4) as a socket address; exits 2 on a malformed one.
sockaddr_in tcp_address(const std::string& text) {
    const auto colon = text.rfind(':');
    sockaddr_in a{};
    a.sin_family = AF_INET;
    if (colon == std::string::npos ||
        inet_pton(AF_INET, text.substr(0, colon).c_str(), &a.sin_addr) != 1)
        usage();
    a.sin_port = htons(static_cast<std::uint16_t>(std::stoul(text.substr(colon + 1))));
    return a;
}

// --listen: one TCP connection accepted at ADDR:PORT, or -1 (the error printed).
int accept_one(const std::string& where) {
    const sockaddr_in a = tcp_address(where);
    const int l = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const int on = 1;
    ::setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
    if (l < 0 || ::bind(l, reinterpret_cast<const sockaddr*>(&a), sizeof a) != 0 ||
        ::listen(l, 1) != 0) {
        std::perror("rdma_bench: listen");
        return -1;
    }
    std::printf("listening on %s\n", where.c_str());
    std::fflush(stdout);
    const int s = ::accept4(l, nullptr, nullptr, SOCK_CLOEXEC);
    ::close(l);
    if (s < 0) std::perror("rdma_bench: accept");
    return s;
}

// --connect: a TCP connection to ADDR:PORT, tried for up to 20 s (the server may be starting).
int connect_to(const std::string& where) {
    const sockaddr_in a = tcp_address(where);
    for (int attempt = 0; attempt < 200; ++attempt) {
        const int s = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (s >= 0 && ::connect(s, reinterpret_cast<const sockaddr*>(&a), sizeof a) == 0) return s;
        if (s >= 0) ::close(s);
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    std::perror("rdma_bench: connect");
    return -1;
}

// --samples: every half round trip the statistics come from, in microseconds, one a line.
bool write_samples(const std::string& path, const std::vector<double>& samples) {
    std::FILE* f = std::fopen(path.c_str(), "w");
    if (!f) {
        std::fprintf(stderr, "rdma_bench: %s: %s\n", path.c_str(), std::strerror(errno));
        return false;
    }
    for (double x : samples)
        std::fprintf(f, "%.3f\n", x);
    const bool ok = std::ferror(f) == 0;
    if (std::fclose(f) != 0 || !ok) {
        std::fprintf(stderr, "rdma_bench: %s: write failed\n", path.c_str());
        return false;
    }
    return true;
}

} // namespace

int main(int argc, char** argv) {
    // rdma_bench tsc: the TSC rate in MHz, to turn perftest's cycle counts (-C) into
    // microseconds with the same clock this program measures with.
    if (argc == 2 && std::string_view(argv[1]) == "tsc") {
        tsc_per_us = calibrate_tsc();
        std::printf("%.3f\n", tsc_per_us);
        return 0;
    }
    config cfg = parse(argc, argv);
    tsc_per_us = calibrate_tsc();
    const double now_ns = clock_now_ns();

    // The client's samples and the stats of both sides; the server hands its own over the
    // socket.
    std::vector<double> samples;
    bench::side_stats cst, sst;
    auto run_one_side = [&](bool client, int sock) {
        if (client) return run_process(cfg, true, sock, samples, cst, sst);
        std::vector<double> none;
        bench::side_stats st, unused;
        return run_process(cfg, false, sock, none, st, unused);
    };
    if (!cfg.listen.empty()) { // across hosts: this process is the server
        ::alarm(cfg.timeout_s);
        const int s = accept_one(cfg.listen);
        if (s < 0) return 1;
        return run_one_side(false, s);
    }
    int rc = 0;
    if (!cfg.connect.empty()) { // across hosts: this process is the client
        const int s = connect_to(cfg.connect);
        if (s < 0) return 1;
        ::alarm(cfg.timeout_s);
        rc = run_one_side(true, s);
    } else {
        rc = bench::run_pair(cfg.timeout_s, run_one_side);
    }
    if (rc != 0) {
        std::fprintf(stderr, "rdma_bench: %s %s failed\n",
                     cfg.test == test_kind::lat ? "lat" : "rate", to_string(cfg.mode));
        return 1;
    }

    const std::uint64_t allocs = cst.allocations + sst.allocations;
    const double per_msg = static_cast<double>(allocs) / static_cast<double>(cfg.iters);
    std::printf("{\n");
    std::printf("  \"test\": \"%s\",\n  \"mode\": \"%s\",\n",
                cfg.test == test_kind::lat ? "lat" : "rate", to_string(cfg.mode));
    std::printf("  \"bytes\": %u,\n  \"iters\": %ld,\n  \"warmup\": %ld,\n  \"inline\": %s,\n",
                cfg.size, cfg.iters, cfg.warmup, cfg.inline_data ? "true" : "false");
    std::printf("  \"solicited\": %s,\n", cfg.solicited ? "true" : "false");
    std::printf("  \"event_read\": \"%s\",\n", to_string(cfg.read));
    if (cfg.test == test_kind::lat) {
        std::printf("  \"raw\": %s,\n", cfg.raw ? "true" : "false");
        std::printf("  \"recv\": \"%s\",\n  \"send\": \"%s\",\n",
                    cfg.recv == recv_style::next   ? "next"
                    : cfg.recv == recv_style::poll ? "poll"
                                                   : "await",
                    cfg.send == send_style::await        ? "await"
                    : cfg.send == send_style::unsignaled ? "unsignaled"
                                                         : "raw");
        double sum = 0;
        for (double x : samples)
            sum += x;
        // --stats 0: no sorting after the run, whose cost grows faster than the run's.
        if (!cfg.stats) samples.assign(1, 0.0);
        std::printf("  \"unit\": \"us, half a round trip (as ib_send_lat)\",\n");
        std::printf("  \"typical_us\": %.3f,\n  \"avg_us\": %.3f,\n  \"min_us\": %.3f,\n",
                    percentile(samples, 0.5), sum / static_cast<double>(samples.size()),
                    percentile(samples, 0.0));
        std::printf("  \"p99_us\": %.3f,\n  \"p999_us\": %.3f,\n", percentile(samples, 0.99),
                    percentile(samples, 0.999));
    } else {
        const double mpps = static_cast<double>(cst.messages) / cst.seconds / 1e6;
        std::printf("  \"window\": %u,\n  \"chain\": %u,\n  \"recv_depth\": %u,\n", cfg.window,
                    cfg.chain, cfg.recv_depth);
        std::printf("  \"mpps\": %.6f,\n  \"MBps\": %.4f,\n  \"receiver_mpps\": %.6f,\n", mpps,
                    mpps * 1e6 * cfg.size / 1048576.0,
                    static_cast<double>(sst.messages) / sst.seconds / 1e6);
    }
    if (cfg.mode == polling_mode::hybrid)
        std::printf("  \"hybrid_spin_us\": %ld,\n  \"hybrid_spin_max_us\": %ld,\n",
                    cfg.hybrid_spin_us, cfg.hybrid_spin_max_us);
    std::printf("  \"ring_setup_flags\": \"0x%x\",\n", ring_flags);
    std::printf("  \"tsc_mhz\": %.1f,\n  \"steady_clock_now_ns\": %.1f,\n", tsc_per_us, now_ns);
    std::printf("  \"allocations\": %" PRIu64 ",\n  \"allocations_per_message\": %.6f,\n", allocs,
                per_msg);
    print_counters("client", cst, false);
    print_counters("server", sst, true);
    std::printf("}\n");
    // After the timed part and the report: the file only, nothing the statistics depend on.
    if (!cfg.samples.empty() && !write_samples(cfg.samples, samples)) return 1;
    if (allocs != 0) {
        std::fprintf(stderr,
                     "rdma_bench: the timed part allocated %" PRIu64
                     " times (%.4f per message): the hot path must not allocate\n",
                     allocs, per_msg);
        return 3;
    }
    return 0;
}
