// What rdma_bench and scale_bench share: the options both take, two processes joined by a
// socket (a socketpair and a fork, or TCP across hosts) that exchange QPN, PSN and GID to
// connect their RC QPs, registered buffers and request chains, and the timed part's counters
// (allocations, channel counters, context switches, CPU time) that each side hands the client.
//
// Includes alloc_counter.hpp, which replaces the global operator new: like it, include this in
// exactly one translation unit of a program (each benchmark is one file).
#pragma once

#include "alloc_counter.hpp"

#include <ringverbs/engine/io_context.hpp>
#include <ringverbs/rdma/buffers.hpp>
#include <ringverbs/rdma/channel.hpp>
#include <ringverbs/verbs.hpp>

#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <coroutine>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace bench {

using ringverbs::channel;
using ringverbs::channel_counters;
using ringverbs::polling_mode;
namespace verbs = ringverbs::verbs;

// ---------------------------------------------------------------------------------------------
// Options

// The options both programs take, with the same meaning in both; each program sets its own
// defaults (its config derives from this).
struct common_options {
    polling_mode mode = polling_mode::events;
    long iters = 0;
    long warmup = 0;
    std::uint32_t size = 0;  // bytes per message
    unsigned window = 0;     // rate: sends in flight (per QP)
    unsigned chain = 0;      // rate: requests per post_send / post_recv chain
    unsigned recv_depth = 0; // rate: receives posted at the server (per QP)
    unsigned timeout_s = 120;
    std::string device = "rxe0";
    std::uint32_t gid_index = 1;
    std::uint8_t port = 1;
};

// One NAME VALUE pair of the command line, when it is a common option: sets it and returns
// true; calls usage() on a bad --mode. A number that does not parse throws, as std::stol does.
inline bool parse_common_option(std::string_view name, const std::string& value, common_options& o,
                                void (*usage)()) {
    auto num = [&] { return std::stol(value); };
    if (name == "--mode") {
        const auto m = ringverbs::parse_polling_mode(value);
        if (!m) usage();
        o.mode = *m;
    } else if (name == "--iters")
        o.iters = num();
    else if (name == "--warmup")
        o.warmup = num();
    else if (name == "--size")
        o.size = static_cast<std::uint32_t>(num());
    else if (name == "--window")
        o.window = static_cast<unsigned>(num());
    else if (name == "--chain")
        o.chain = static_cast<unsigned>(num());
    else if (name == "--recv-depth")
        o.recv_depth = static_cast<unsigned>(num());
    else if (name == "--timeout")
        o.timeout_s = static_cast<unsigned>(num());
    else if (name == "--device")
        o.device = value;
    else if (name == "--gid-index")
        o.gid_index = static_cast<std::uint32_t>(num());
    else
        return false;
    return true;
}

// The command line, SUBCOMMAND [--NAME VALUE]... in both, into `c` (a common_options with the
// program's defaults): the device and GID index from the environment first ($RINGVERBS_DEVICE,
// $RINGVERBS_GID_INDEX, where set), then subcommand(c, SUBCOMMAND), which may set defaults of
// its own, then each pair in order: a common option, or option(c, NAME, VALUE). Both return
// false for a name they do not know. usage() for an unknown name or a missing value.
template <class Config>
void parse_command_line(int argc, char** argv, Config& c, void (*usage)(),
                        bool (*subcommand)(Config&, std::string_view),
                        bool (*option)(Config&, std::string_view, const std::string&)) {
    if (const char* d = std::getenv("RINGVERBS_DEVICE"); d && *d) c.device = d;
    if (const char* g = std::getenv("RINGVERBS_GID_INDEX"); g && *g)
        c.gid_index = static_cast<std::uint32_t>(std::stoul(g));
    if (argc < 2 || !subcommand(c, argv[1])) usage();
    for (int i = 2; i < argc; ++i) {
        const std::string_view name = argv[i];
        if (i + 1 >= argc) usage();
        const std::string value = argv[++i];
        if (!parse_common_option(name, value, c, usage) && !option(c, name, value)) usage();
    }
}

// ---------------------------------------------------------------------------------------------
// Time and CPU

inline double since_us(std::chrono::steady_clock::time_point t0,
                       std::chrono::steady_clock::time_point t1) {
    return std::chrono::duration<double, std::micro>(t1 - t0).count();
}

// User + system CPU time.
inline double cpu_us(const rusage& r) {
    auto us = [](const timeval& t) {
        return static_cast<double>(t.tv_sec) * 1e6 + static_cast<double>(t.tv_usec);
    };
    return us(r.ru_utime) + us(r.ru_stime);
}

// The channel counters from k0 to k (arm_retries left out).
inline channel_counters counters_since(const channel_counters& k0, const channel_counters& k) {
    channel_counters d{};
    d.wakeups = k.wakeups - k0.wakeups;
    d.events = k.events - k0.events;
    d.acks = k.acks - k0.acks;
    d.arms = k.arms - k0.arms;
    d.polls = k.polls - k0.polls;
    d.empty_polls = k.empty_polls - k0.empty_polls;
    d.completions = k.completions - k0.completions;
    return d;
}

// What one side measured in its timed part (the server sends it to the client over the
// socket: plain data, the same program at both ends).
struct side_stats {
    std::uint64_t allocations = 0;
    std::uint64_t messages = 0;
    double seconds = 0;
    channel_counters ch{};
    std::uint64_t vcsw = 0;     // voluntary context switches (sleeps)
    std::uint64_t ivcsw = 0;    // involuntary ones (preemption)
    double cpu_us = 0;          // user + system CPU time of the process
    std::uint64_t setup_us = 0; // set by the program that reports it (scale_bench)
    // Polls of the CQs that found nothing, over the whole run (not only the window): what a
    // spinning side did while it waited, for tools/bench-cost to take out of its count.
    std::uint64_t run_empty_polls = 0;
    char error[160] = {};
};

// The clock of a window: steady_clock (rdma_bench uses the TSC instead).
struct steady_timer {
    using time_point = std::chrono::steady_clock::time_point;
    static time_point now() noexcept { return std::chrono::steady_clock::now(); }
    static double seconds(time_point t0, time_point t1) { return since_us(t0, t1) / 1e6; }
};

// A window over the timed part: allocations, channel counters (none when ch is null: plain
// verbs), context switches and CPU time, written to *out when it closes. It opens once and
// closes once, and only after it opened. The allocation count is read innermost, so that
// nothing the window does itself is counted.
template <class Timer>
struct window {
    const channel* ch = nullptr;
    side_stats* out = nullptr;
    std::uint64_t a0 = 0, m0 = 0;
    channel_counters k0{};
    rusage r0{};
    typename Timer::time_point t0{};
    bool open = false, closed = false;

    void begin(std::uint64_t messages_so_far = 0) {
        if (open) return;
        open = true;
        m0 = messages_so_far;
        getrusage(RUSAGE_SELF, &r0);
        if (ch) k0 = ch->counters();
        t0 = Timer::now();
        a0 = allocations.load(std::memory_order_relaxed);
    }
    void end(std::uint64_t messages_so_far) {
        if (closed || !open) return;
        closed = true;
        const std::uint64_t a1 = allocations.load(std::memory_order_relaxed);
        const auto t1 = Timer::now();
        const channel_counters k = ch ? ch->counters() : channel_counters{};
        rusage r1{};
        getrusage(RUSAGE_SELF, &r1);
        out->allocations = a1 - a0;
        out->messages = messages_so_far - m0;
        out->seconds = Timer::seconds(t0, t1);
        out->ch = counters_since(k0, k);
        out->vcsw = static_cast<std::uint64_t>(r1.ru_nvcsw - r0.ru_nvcsw);
        out->ivcsw = static_cast<std::uint64_t>(r1.ru_nivcsw - r0.ru_nivcsw);
        out->cpu_us = cpu_us(r1) - cpu_us(r0);
    }
};

// ---------------------------------------------------------------------------------------------
// One process's runtime

// Made in this order, destroyed in the reverse: the device (common_options::device), its
// protection domain, an io_context (256 submission and 4096 completion queue entries) and one
// completion channel on it. A process's test derives from it.
struct process_runtime {
    verbs::context dev;
    verbs::protection_domain pd;
    ringverbs::io_context io;
    channel ch;

    process_runtime(const common_options& o, bool single_issuer,
                    const ringverbs::channel_options& channel_opts)
        : dev(o.device), pd(dev),
          io(ringverbs::io_context_options{
              .sq_entries = 256, .cq_entries = 4096, .single_issuer = single_issuer}),
          ch(io, dev, channel_opts) {}
};

// ---------------------------------------------------------------------------------------------
// Buffers, requests, completions

// A registered buffer, every byte `fill`.
struct region {
    std::vector<std::byte> bytes;
    verbs::memory_region mr;
    region(const verbs::protection_domain& pd, std::size_t n, std::byte fill = std::byte{0})
        : bytes(n, fill), mr(pd, bytes, verbs::access::local_write) {}
    ringverbs::local_buffer at(std::size_t off, std::size_t len) {
        return ringverbs::local_buffer(mr, std::span(bytes).subspan(off, len));
    }
};

// A chain for one post_send (sends, unsignaled: qp::post_send signals the last) or one
// post_recv (receives), its requests linked through `next`, each over its own copy of one
// scatter/gather entry. The chain must not move once made (the requests point into sge).
struct wr_chain {
    std::vector<ibv_send_wr> swr;
    std::vector<ibv_recv_wr> rwr;
    std::vector<ibv_sge> sge;

    void make_sends(unsigned k, const ibv_sge& one, unsigned send_flags) {
        sge.assign(k, one);
        swr.assign(k, ibv_send_wr{});
        for (unsigned i = 0; i < k; ++i) {
            swr[i].sg_list = &sge[i];
            swr[i].num_sge = 1;
            swr[i].opcode = IBV_WR_SEND;
            swr[i].send_flags = send_flags;
            swr[i].next = i + 1 < k ? &swr[i + 1] : nullptr;
        }
    }
    void make_recvs(unsigned k, const ibv_sge& one) {
        sge.assign(k, one);
        rwr.assign(k, ibv_recv_wr{});
        for (unsigned i = 0; i < k; ++i) {
            rwr[i].sg_list = &sge[i];
            rwr[i].num_sge = 1;
            rwr[i].next = i + 1 < k ? &rwr[i + 1] : nullptr;
        }
    }
};

// Throws, naming `what`, unless the completion is a success.
inline void check(const ibv_wc& wc, const char* what) {
    if (wc.status != IBV_WC_SUCCESS)
        throw std::runtime_error(std::string(what) + ": " + ibv_wc_status_str(wc.status));
}

// One coroutine waits, others signal; counts the signals nobody waited for yet. Resumes the
// waiter through io_context::ready(), like the runtime's own awaitables.
struct handoff {
    ringverbs::io_context* io;
    std::coroutine_handle<> waiter;
    long pending = 0;
    void signal() {
        if (waiter)
            ringverbs::detail::loop(*io).ready(std::exchange(waiter, {}));
        else
            ++pending;
    }
    auto wait() noexcept {
        struct awaiter {
            handoff& h;
            bool await_ready() noexcept {
                if (h.pending == 0) return false;
                --h.pending;
                return true;
            }
            void await_suspend(std::coroutine_handle<> c) noexcept { h.waiter = c; }
            void await_resume() noexcept {}
        };
        return awaiter{*this};
    }
};

// ---------------------------------------------------------------------------------------------
// The socket between the two processes

// Throws when the peer is gone.
inline void write_all(int fd, const void* p, std::size_t n) {
    auto* b = static_cast<const char*>(p);
    while (n > 0) {
        const ssize_t r = ::write(fd, b, n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) throw std::runtime_error("socketpair write failed");
        b += r;
        n -= static_cast<std::size_t>(r);
    }
}

inline void read_all(int fd, void* p, std::size_t n) {
    auto* b = static_cast<char*>(p);
    while (n > 0) {
        const ssize_t r = ::read(fd, b, n);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) throw std::runtime_error("socketpair read failed (peer gone)");
        b += r;
        n -= static_cast<std::size_t>(r);
    }
}

// Returns once the peer called it too.
inline void sync_with_peer(int sock) {
    char b = 'b';
    write_all(sock, &b, 1);
    read_all(sock, &b, 1);
}

struct wire_endpoint {
    std::uint32_t qpn;
    std::uint32_t psn;
    ibv_gid gid;
};

// INIT -> RTR -> RTS, qps[i] against the other process's qps[i]: each side writes the QPN, PSN
// and GID of all its QPs to `sock`, then reads the peer's. rnr_retry: the RTS attribute.
inline void connect_qps(std::span<verbs::queue_pair* const> qps, const verbs::context& dev,
                        const common_options& o, int sock,
                        std::uint8_t rnr_retry = verbs::rts_params{}.rnr_retry) {
    const ibv_port_attr pa = dev.query_port(o.port);
    const ibv_gid_entry ge = dev.query_gid(o.port, o.gid_index);
    std::vector<wire_endpoint> mine(qps.size()), peer(qps.size());
    for (std::size_t i = 0; i < qps.size(); ++i) {
        const std::uint32_t psn =
            (static_cast<std::uint32_t>(::getpid() + i) * 2654435761u) & 0xffffff;
        qps[i]->to_init(o.port);
        mine[i] = {qps[i]->qp_num(), psn, ge.gid};
    }
    write_all(sock, mine.data(), mine.size() * sizeof(wire_endpoint));
    read_all(sock, peer.data(), peer.size() * sizeof(wire_endpoint));
    for (std::size_t i = 0; i < qps.size(); ++i) {
        verbs::rtr_params rtr;
        rtr.port = o.port;
        rtr.remote_qpn = peer[i].qpn;
        rtr.remote_psn = peer[i].psn;
        rtr.remote_gid = peer[i].gid;
        rtr.sgid_index = static_cast<std::uint8_t>(o.gid_index);
        rtr.mtu = pa.active_mtu;
        qps[i]->to_rtr(rtr);
        verbs::rts_params rts;
        rts.sq_psn = mine[i].psn;
        rts.rnr_retry = rnr_retry;
        qps[i]->to_rts(rts);
    }
}

// ---------------------------------------------------------------------------------------------
// The two processes

// One side's run: body() runs the test and fills `mine`; then the server hands its stats to
// the client, before either tears its QPs down (the client's last message must reach the
// server first). On an exception: the error kept in mine.error and printed as
// "PROGRAM: client|server: what", the socket shut down (that unblocks a peer waiting on it),
// and 1.
template <class Body>
int run_side(const char* program, bool client, int sock, side_stats& mine, side_stats& server,
             Body&& body) {
    try {
        body();
        if (client)
            read_all(sock, &server, sizeof server);
        else
            write_all(sock, &mine, sizeof mine);
        return 0;
    } catch (const std::exception& e) {
        std::snprintf(mine.error, sizeof mine.error, "%s: %s", client ? "client" : "server",
                      e.what());
        std::fprintf(stderr, "%s: %s\n", program, mine.error);
        ::shutdown(sock, SHUT_RDWR);
        return 1;
    }
}

// side(false, sock) in a forked child, the server, and side(true, sock) here, the client, over
// a socketpair; both under alarm(timeout_s): a side waiting for a peer that died must not hang
// (SIGALRM kills it). Returns the client's status, or 1 when the server's was not 0 or when
// the socketpair or the fork failed (printed).
template <class Side>
int run_pair(unsigned timeout_s, Side&& side) {
    int sv[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
        std::perror("socketpair");
        return 1;
    }
    std::fflush(stdout);
    const pid_t pid = ::fork();
    if (pid < 0) {
        std::perror("fork");
        return 1;
    }
    ::alarm(timeout_s);
    if (pid == 0) {
        ::close(sv[0]);
        const int rc = side(false, sv[1]);
        std::fflush(nullptr);
        ::_exit(rc);
    }
    ::close(sv[1]);
    int rc = side(true, sv[0]);
    int status = 0;
    ::waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) rc = 1;
    return rc;
}

} // namespace bench
