// Cross-thread wakeup: how fast can one thread wake another thread's ring? Two threads
// ping-pong a token, each sleeping in io_uring_enter between turns, three ways:
//   eventfd   the sender writes an eventfd on which the receiver's ring has a read pending
//             (what io_context::post / schedule use)
//   msg_ring  the sender's own ring posts a CQE into the receiver's ring (IORING_OP_MSG_RING)
//   ours      a coroutine hopping between two io_contexts with co_await ctx.schedule()
// Prints ns per round trip (median) and writes <out-dir>/post.json.
#include <ringverbs/engine/io_context.hpp>

#include <liburing.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <stdexcept>
#include <thread>
#include <vector>

namespace {

using clock_type = std::chrono::steady_clock;

struct ring {
    io_uring r{};
    ring() {
        io_uring_params p{};
        p.flags = IORING_SETUP_SINGLE_ISSUER | IORING_SETUP_DEFER_TASKRUN;
        if (io_uring_queue_init_params(64, &r, &p) < 0) {
            p = {};
            if (io_uring_queue_init_params(64, &r, &p) < 0) throw std::runtime_error("ring");
        }
    }
    ~ring() { io_uring_queue_exit(&r); }
    void wait_one() {
        io_uring_cqe* cqe;
        for (;;) {
            int rc = io_uring_submit_and_wait(&r, 1);
            if (rc < 0 && rc != -EINTR) throw std::runtime_error("submit_and_wait");
            if (io_uring_peek_cqe(&r, &cqe) == 0) break;
        }
        io_uring_cqe_seen(&r, cqe);
    }
};

double run_eventfd(long rounds) {
    int efd[2] = {::eventfd(0, EFD_CLOEXEC), ::eventfd(0, EFD_CLOEXEC)};
    clock_type::time_point t0, t1;
    auto side = [&](int me, bool starts) {
        ring rg;
        std::uint64_t buf = 0;
        auto arm = [&] {
            io_uring_sqe* sqe = io_uring_get_sqe(&rg.r);
            io_uring_prep_read(sqe, efd[me], &buf, sizeof buf, 0);
        };
        std::uint64_t one = 1;
        if (starts) t0 = clock_type::now();
        for (long i = 0; i < rounds; ++i) {
            arm();
            if (starts && ::write(efd[1 - me], &one, 8) != 8) return;
            rg.wait_one();
            if (!starts && ::write(efd[1 - me], &one, 8) != 8) return;
        }
        if (starts) t1 = clock_type::now();
    };
    std::thread b(side, 1, false);
    side(0, true);
    b.join();
    ::close(efd[0]);
    ::close(efd[1]);
    return std::chrono::duration<double, std::nano>(t1 - t0).count() / static_cast<double>(rounds);
}

double run_msg_ring(long rounds) {
    std::atomic<int> fds[2] = {-1, -1};
    std::barrier sync(2);
    clock_type::time_point t0, t1;
    std::atomic<bool> unsupported{false};
    auto side = [&](int me, bool starts) {
        ring rg;
        fds[me] = rg.r.ring_fd;
        sync.arrive_and_wait();
        int peer = fds[1 - me];
        auto send = [&] {
            io_uring_sqe* sqe = io_uring_get_sqe(&rg.r);
            io_uring_prep_msg_ring(sqe, peer, 0, 1, 0);
            sqe->flags |= IOSQE_CQE_SKIP_SUCCESS;
        };
        if (starts) t0 = clock_type::now();
        for (long i = 0; i < rounds && !unsupported; ++i) {
            if (starts) send();
            rg.wait_one();
            if (!starts) send();
        }
        if (!starts) io_uring_submit(&rg.r);
        if (starts) t1 = clock_type::now();
    };
    std::thread b(side, 1, false);
    side(0, true);
    b.join();
    return std::chrono::duration<double, std::nano>(t1 - t0).count() / static_cast<double>(rounds);
}

double run_ours(long rounds) {
    ringverbs::io_context a;
    ringverbs::io_context* bp = nullptr;
    std::optional<ringverbs::io_context::work_guard> guard;
    std::barrier ready(2);
    std::thread tb([&] {
        ringverbs::io_context b; // built, run and destroyed on its own thread
        guard.emplace(b);
        bp = &b;
        ready.arrive_and_wait();
        b.run();
    });
    ready.arrive_and_wait();
    ringverbs::io_context& b = *bp;
    clock_type::time_point t0, t1;
    auto hop = [&]() -> ringverbs::task<void> {
        t0 = clock_type::now();
        for (long i = 0; i < rounds; ++i) {
            co_await b.schedule();
            co_await a.schedule();
        }
        t1 = clock_type::now();
    };
    a.run(hop());
    b.post([&] { guard.reset(); });
    tb.join();
    return std::chrono::duration<double, std::nano>(t1 - t0).count() / static_cast<double>(rounds);
}

double median(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

} // namespace

int main(int argc, char** argv) {
    std::filesystem::path out_dir = argc > 1 ? argv[1] : "bench-results";
    long rounds = argc > 2 ? std::stol(argv[2]) : 20'000;
    std::vector<double> e, m, o;
    for (int i = 0; i < 5; ++i) {
        e.push_back(run_eventfd(rounds));
        m.push_back(run_msg_ring(rounds));
        o.push_back(run_ours(rounds));
    }
    std::printf("cross-thread wakeup ping-pong, %ld round trips x 5 runs (median)\n", rounds);
    std::printf("  eventfd + pending read   %8.0f ns/round trip\n", median(e));
    std::printf("  IORING_OP_MSG_RING       %8.0f ns/round trip\n", median(m));
    std::printf("  ringverbs schedule()     %8.0f ns/round trip\n", median(o));
    std::filesystem::create_directories(out_dir);
    std::ofstream json(out_dir / "post.json");
    json << "{\n  \"eventfd_ns\": " << median(e) << ",\n  \"msg_ring_ns\": " << median(m)
         << ",\n  \"ours_schedule_ns\": " << median(o) << "\n}\n";
    return 0;
}
