// Engine benchmark: two parties ping-pong through a pair of eventfds, each waiting with a
// poll. The same exchange three ways, in one run:
//   ours     two coroutines on a ringverbs::io_context, co_await ringverbs::poll
//   liburing the same requests in plain liburing with callbacks (same ring flags)
//   epoll    the same exchange with epoll_wait
// Prints ns per round trip (median of several runs) and the ratios, counts heap allocations
// in our steady state, and writes <out-dir>/engine.json.
#include "alloc_counter.hpp"

#include <ringverbs/engine/io_context.hpp>
#include <ringverbs/engine/poll.hpp>

#include <liburing.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using clock_type = std::chrono::steady_clock;

struct eventfd_pair {
    int a = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    int b = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    eventfd_pair() {
        if (a < 0 || b < 0) throw std::runtime_error("eventfd");
    }
    ~eventfd_pair() {
        ::close(a);
        ::close(b);
    }
};

void signal(int fd) {
    std::uint64_t one = 1;
    if (::write(fd, &one, sizeof one) != sizeof one) throw std::runtime_error("eventfd write");
}
void drain(int fd) {
    std::uint64_t v;
    if (::read(fd, &v, sizeof v) != sizeof v) throw std::runtime_error("eventfd read");
}

// --- ours ---------------------------------------------------------------------------------
std::size_t steady_allocations = 0;

double run_ours(long rounds) {
    eventfd_pair fds;
    ringverbs::io_context ctx;
    std::size_t allocs_at_start = 0;
    clock_type::time_point t0;
    clock_type::time_point t1;
    auto ping = [&]() -> ringverbs::task<void> {
        for (long i = 0; i < rounds; ++i) {
            if (i == rounds / 10) { // warmed up: the ready queues have their capacity
                allocs_at_start = bench::allocations.load();
                t0 = clock_type::now();
            }
            signal(fds.b);
            co_await ringverbs::poll(ctx, fds.a, POLLIN);
            drain(fds.a);
        }
        t1 = clock_type::now();
        steady_allocations = bench::allocations.load() - allocs_at_start;
    };
    auto pong = [&]() -> ringverbs::task<void> {
        for (long i = 0; i < rounds; ++i) {
            co_await ringverbs::poll(ctx, fds.b, POLLIN);
            drain(fds.b);
            signal(fds.a);
        }
    };
    ctx.spawn(pong());
    ctx.spawn(ping());
    ctx.run();
    long timed = rounds - rounds / 10;
    return std::chrono::duration<double, std::nano>(t1 - t0).count() / static_cast<double>(timed);
}

// --- plain liburing with callbacks ---------------------------------------------------------
struct raw_ring {
    io_uring ring{};
    raw_ring() {
        io_uring_params p{};
        p.flags = IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN;
        if (io_uring_queue_init_params(256, &ring, &p) < 0) {
            p = {};
            if (io_uring_queue_init_params(256, &ring, &p) < 0)
                throw std::runtime_error("io_uring_queue_init_params");
        }
    }
    ~raw_ring() { io_uring_queue_exit(&ring); }
};

struct party;
using callback = void (*)(party*);
struct party {
    callback on_ready;
    io_uring* ring;
    int wait_fd;
    int peer_fd;
    long remaining;
    void arm() {
        io_uring_sqe* sqe = io_uring_get_sqe(ring);
        io_uring_prep_poll_add(sqe, wait_fd, POLLIN);
        io_uring_sqe_set_data(sqe, this);
    }
};

double run_liburing(long rounds) {
    eventfd_pair fds;
    raw_ring r;
    long warm = rounds / 10;
    clock_type::time_point t0;
    party ping{nullptr, &r.ring, fds.a, fds.b, rounds};
    party pong{nullptr, &r.ring, fds.b, fds.a, rounds};
    ping.on_ready = [](party* p) {
        drain(p->wait_fd);
        if (--p->remaining > 0) {
            signal(p->peer_fd);
            p->arm();
        }
    };
    pong.on_ready = [](party* p) {
        drain(p->wait_fd);
        signal(p->peer_fd);
        if (--p->remaining > 0) p->arm();
    };
    ping.arm();
    pong.arm();
    signal(fds.b);
    bool timing = false;
    while (ping.remaining > 0 || pong.remaining > 0) {
        if (!timing && ping.remaining <= rounds - warm) {
            timing = true;
            t0 = clock_type::now();
        }
        io_uring_submit_and_wait(&r.ring, 1);
        unsigned head;
        unsigned seen = 0;
        io_uring_cqe* cqe;
        io_uring_for_each_cqe(&r.ring, head, cqe) {
            ++seen;
            auto* p = static_cast<party*>(io_uring_cqe_get_data(cqe));
            p->on_ready(p);
        }
        io_uring_cq_advance(&r.ring, seen);
    }
    auto t1 = clock_type::now();
    long timed = rounds - warm;
    return std::chrono::duration<double, std::nano>(t1 - t0).count() / static_cast<double>(timed);
}

// --- epoll -------------------------------------------------------------------------------
double run_epoll(long rounds) {
    eventfd_pair fds;
    int ep = ::epoll_create1(EPOLL_CLOEXEC);
    epoll_event ev{};
    ev.events = EPOLLIN;
    ev.data.fd = fds.a;
    ::epoll_ctl(ep, EPOLL_CTL_ADD, fds.a, &ev);
    ev.data.fd = fds.b;
    ::epoll_ctl(ep, EPOLL_CTL_ADD, fds.b, &ev);
    long warm = rounds / 10;
    long ping_left = rounds;
    clock_type::time_point t0;
    bool timing = false;
    signal(fds.b);
    epoll_event events[4];
    while (ping_left > 0) {
        if (!timing && ping_left <= rounds - warm) {
            timing = true;
            t0 = clock_type::now();
        }
        int n = ::epoll_wait(ep, events, 4, -1);
        for (int i = 0; i < n; ++i) {
            if (events[i].data.fd == fds.b) {
                drain(fds.b);
                signal(fds.a);
            } else {
                drain(fds.a);
                if (--ping_left > 0) signal(fds.b);
            }
        }
    }
    auto t1 = clock_type::now();
    ::close(ep);
    long timed = rounds - warm;
    return std::chrono::duration<double, std::nano>(t1 - t0).count() / static_cast<double>(timed);
}

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

} // namespace

int main(int argc, char** argv) {
    std::filesystem::path out_dir = argc > 1 ? argv[1] : "bench-results";
    long rounds = argc > 2 ? std::stol(argv[2]) : 100'000;
    constexpr int runs = 7;
    std::vector<double> ours;
    std::vector<double> uring;
    std::vector<double> ep;
    // Interleaved, so that a noisy neighbour hits all three alike.
    for (int i = 0; i < runs; ++i) {
        ours.push_back(run_ours(rounds));
        uring.push_back(run_liburing(rounds));
        ep.push_back(run_epoll(rounds));
    }
    double o = median(ours);
    double u = median(uring);
    double e = median(ep);
    std::printf("engine ping-pong through two eventfds, %ld round trips x %d runs (median)\n",
                rounds, runs);
    std::printf("  ringverbs (coroutines)   %8.0f ns/round trip\n", o);
    std::printf("  liburing (callbacks)     %8.0f ns/round trip\n", u);
    std::printf("  epoll                    %8.0f ns/round trip\n", e);
    std::printf("  ratio vs liburing        %8.3f  (goal <= 1.15)\n", o / u);
    std::printf("  ratio vs epoll           %8.3f\n", o / e);
    std::printf("  heap allocations in our steady state: %zu\n", steady_allocations);
    std::filesystem::create_directories(out_dir);
    std::ofstream json(out_dir / "engine.json");
    json << "{\n"
         << "  \"rounds\": " << rounds << ",\n"
         << "  \"runs\": " << runs << ",\n"
         << "  \"ours_ns\": " << o << ",\n"
         << "  \"liburing_ns\": " << u << ",\n"
         << "  \"epoll_ns\": " << e << ",\n"
         << "  \"ratio_vs_liburing\": " << o / u << ",\n"
         << "  \"ratio_vs_epoll\": " << o / e << ",\n"
         << "  \"steady_state_allocations\": " << steady_allocations << "\n"
         << "}\n";
    std::printf("wrote %s\n", (out_dir / "engine.json").c_str());
    // A steady state that allocates is a bug, not a slow result.
    return steady_allocations == 0 ? 0 : 1;
}
