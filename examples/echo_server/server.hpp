// echo_server's parts (examples/echo_server/): what the whole server, each thread and each
// device share, and the calls between the files. main.cpp: options, listening, threads, the
// end. connection.cpp: one client's connection (--no-srq: its own receives and echo loops).
// shared_receives.cpp: a device's shared receive queue and its echo loops (the default).
// admission.cpp: the accept loop, --max-connections, handing requests to threads.
#pragma once

#include "../echo_common.hpp"

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
#include <string>
#include <thread>
#include <vector>

namespace echo {

using namespace ringverbs;
using namespace std::chrono_literals;

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

// connection.cpp: serves one admitted request on `owner`'s thread until it closes, then logs
// how it ended and releases it (the opens were counted by the accept loop).
task<void> serve(worker& owner, device_resources& device, cm_id id, int number);

// shared_receives.cpp: the worker's PD, completion channel and (unless --no-srq) shared
// receives with their echo loops for `context`, made at its first connection on that device.
// Throws what a verb threw, having kept nothing: the next connection tries again.
device_resources& resources_for(worker& owner, verbs::context context);
// shared_receives.cpp: the main thread logs each device's asynchronous events.
void watch_device(echo_server& server, const verbs::context& device);
// shared_receives.cpp: a worker's life until the server's end (then its shared queues go).
task<void> retire(worker& owner);

// admission.cpp: takes every request of `listener` until the server stops.
task<void> accept_loop(echo_server& server, cm_id& listener);

} // namespace echo
