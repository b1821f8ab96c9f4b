// A device that goes away under live connections (`rdma link delete`, as a hot-unplug or a
// driver reset would): every await on it ends promptly with ENODEV, the process keeps running,
// and once it let go of the device the kernel finishes the removal. The test makes a device of
// its own (the test device's kind: rxe or siw) on a dummy netdev of its own, so the VM's
// device and the other tests are untouched; outside tools/softroce-vm (root, a guest of our
// own) it is skipped.
#include "cm_fixture.hpp"

#include <ringverbs/cm/connection.hpp>
#include <ringverbs/engine/timer.hpp>
#include <ringverbs/engine/when_all.hpp>
#include <ringverbs/rdma/device_events.hpp>
#include <ringverbs/rdma/srq.hpp>

#include <doctest/doctest.h>

#include <spawn.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <string>
#include <thread>

extern char** environ;

using namespace rt;
using namespace std::chrono_literals;

namespace {

constexpr const char* gone_device = "rvgone0";
constexpr const char* gone_netdev = "rvgone";
constexpr const char* gone_addr = "198.18.77.1";

bool exists(const std::string& path) {
    struct stat st {};
    return ::stat(path.c_str(), &st) == 0;
}

bool port_active() {
    std::ifstream f(std::string("/sys/class/infiniband/") + gone_device + "/ports/1/state");
    std::string line;
    std::getline(f, line);
    return line.find("ACTIVE") != std::string::npos;
}

// Starts `command` under /bin/sh; returns its pid.
pid_t start(const std::string& command) {
    const char* argv[] = {"/bin/sh", "-c", command.c_str(), nullptr};
    pid_t pid = -1;
    if (posix_spawn(&pid, "/bin/sh", nullptr, nullptr, const_cast<char**>(argv), environ) != 0)
        return -1;
    return pid;
}

// A second device of the test device's kind, on a dummy netdev with an address of its own.
struct scratch_device {
    bool ready = false;
    std::string failure;
    scratch_device() {
        const char* transport = std::getenv("RINGVERBS_TRANSPORT");
        const std::string kind =
            transport != nullptr && std::string(transport) == "iwarp" ? "siw" : "rxe";
        const std::string make =
            std::string("ip link del ") + gone_netdev + " 2>/dev/null; ip link add " + gone_netdev +
            " type dummy && ip addr add " + gone_addr + "/24 dev " + gone_netdev +
            " && ip link set " + gone_netdev + " up && rdma link add " + gone_device + " type " +
            kind + " netdev " + gone_netdev;
        if (std::system(make.c_str()) != 0) {
            failure = "could not make " + std::string(gone_device) + ": " + make;
            return;
        }
        for (int i = 0; i < 100 && !port_active(); ++i)
            std::this_thread::sleep_for(100ms);
        ready = port_active();
        if (!ready) failure = std::string(gone_device) + "'s port did not become ACTIVE";
    }
    ~scratch_device() {
        // In the background: a removal waits for every user of the device to let it go.
        std::system((std::string("(rdma link delete ") + gone_device +
                     " 2>/dev/null; ip link del " + gone_netdev + " 2>/dev/null) &")
                        .c_str());
    }
};

struct outcome {
    bool done = false;
    int error = -1; // 0: the await succeeded; else the errno of its std::system_error
    std::string what;
};

template <typename Awaitable>
task<void> record(outcome& o, Awaitable& a) {
    try {
        co_await a;
        o.error = 0;
    } catch (const std::system_error& e) {
        o.error = e.code().value();
        o.what = e.what();
    }
    o.done = true;
}

task<void> await_cq(cq& q, outcome& o) {
    auto a = q.next(wait_options(60s));
    co_await record(o, a);
}
task<void> await_events(device_events& events, outcome& o) {
    auto a = events.next(wait_options(60s));
    co_await record(o, a);
}
task<void> await_low_water(srq& s, outcome& o) {
    auto a = s.low_water(1, wait_options(60s));
    co_await record(o, a);
}
task<void> await_srq_recv(srq& s, local_buffer into, outcome& o) {
    auto a = s.recv(into);
    co_await record(o, a);
}
task<void> await_recv(connection& c, local_buffer into, outcome& o) {
    auto a = c.recv(into, wait_options(60s));
    co_await record(o, a);
}
task<void> await_accept(listener& l, outcome& o) {
    try {
        (void)co_await l.accept(wait_options(60s));
        o.error = 0;
    } catch (const std::system_error& e) {
        o.error = e.code().value();
        o.what = e.what();
    }
    o.done = true;
}

void check_gone(const char* name, const outcome& o) {
    INFO(name << ": " << o.what);
    CHECK(o.done);
    CHECK(o.error == ENODEV);
}

} // namespace

TEST_CASE("a device removed under live connections: every await on it ends with ENODEV, posts "
          "are refused, and the kernel gets the device back once the process let go" *
          doctest::skip(!in_our_vm() || ::geteuid() != 0)) {
    scratch_device scratch;
    REQUIRE_MESSAGE(scratch.ready, scratch.failure);
    pid_t remover = -1;
    {
        io_context io;
        // Objects on an ibv_context of our own (not librdmacm's): told too.
        verbs::context dev(gone_device);
        device_events events(io, dev);
        channel ch(io, dev);
        cq lone(ch);
        verbs::protection_domain pd(dev);
        srq shared(io, pd);
        region pool(pd, 256);
        listener l(io, std::string(gone_addr) + ":0");
        const std::string at = std::string(gone_addr) + ":" + std::to_string(l.port());

        outcome on_cq, on_events, on_low_water, on_srq_recv, client_recv, server_recv, on_accept;
        bool refused_after = false, srq_refused_after = false;
        auto run = [&]() -> task<void> {
            auto [s, c] = co_await when_all(l.accept(wait_options(20s)), connect(io, at));
            region cbuf(c.pd(), 64), sbuf(s.pd(), 64);
            io.spawn(await_cq(lone, on_cq));
            io.spawn(await_events(events, on_events));
            shared.post_recv(pool.local(0, 64), 7);
            io.spawn(await_low_water(shared, on_low_water));
            io.spawn(await_srq_recv(shared, pool.local(64, 64), on_srq_recv));
            io.spawn(await_recv(c, cbuf.all(), client_recv));
            io.spawn(await_recv(s, sbuf.all(), server_recv));
            io.spawn(await_accept(l, on_accept));
            co_await sleep_for(io, 200ms); // every await above is waiting
            CHECK_FALSE(on_cq.done);
            CHECK_FALSE(client_recv.done);
            remover = start(std::string("exec rdma link delete ") + gone_device);
            REQUIRE(remover > 0);
            // Bounded: each await has its own 60 s deadline; the removal must beat it by far.
            for (int i = 0; i < 300; ++i) {
                if (on_cq.done && on_events.done && on_low_water.done && on_srq_recv.done &&
                    client_recv.done && server_recv.done && on_accept.done)
                    break;
                co_await sleep_for(io, 100ms);
            }
            // Once gone, a post is refused at once (not posted to a device being removed).
            try {
                auto again = c.recv(cbuf.all(), wait_options(5s));
                co_await again;
            } catch (const std::system_error& e) {
                refused_after = e.code().value() == ENODEV;
                INFO(e.what());
            }
            try {
                shared.post_recv(pool.local(128, 64), 8);
            } catch (const std::system_error& e) {
                srq_refused_after = e.code().value() == ENODEV;
            }
        };
        io.run(run());
        check_gone("cq::next", on_cq);
        check_gone("device_events::next", on_events);
        check_gone("srq::low_water", on_low_water);
        check_gone("srq::recv", on_srq_recv);
        check_gone("client's recv", client_recv);
        check_gone("server's recv", server_recv);
        check_gone("listener::accept", on_accept);
        CHECK(refused_after);
        CHECK(srq_refused_after);
        // The device is still there: the kernel waits for this process to close it.
        CHECK(exists(std::string("/sys/class/infiniband/") + gone_device));
    }
    // Everything on the device is gone now: the removal completes.
    int status = -1;
    bool ended = false;
    for (int i = 0; i < 600 && !ended; ++i) {
        const pid_t r = ::waitpid(remover, &status, WNOHANG);
        if (r == remover)
            ended = true;
        else
            std::this_thread::sleep_for(100ms);
    }
    CHECK_MESSAGE(ended, "rdma link delete still waits 60 s after the process let the device go");
    if (ended) {
        CHECK(WIFEXITED(status));
        CHECK(WEXITSTATUS(status) == 0);
        CHECK_FALSE(exists(std::string("/sys/class/infiniband/") + gone_device));
    }
}
