// echo_server: every message a client SENDs comes back unchanged with a SEND. Each thread is
// one io_context: rdma_cm events, completions and signals all arrive through its io_uring ring.
//
//   echo_server [--address IP] [--port N] [--device NAME] [--max-size BYTES] [--depth N]
//               [--mode events|hybrid|busy] [--max-connections N] [--idle-timeout SECONDS]
//               [--threads N] [--srq-depth N | --no-srq]
//
// By default every thread receives through one shared receive queue (SRQ) per device, with a
// registered pool of --srq-depth / --threads buffers of --max-size bytes, and one CQ for its
// connections' sends and receives: registered memory does not grow with connections. Each
// buffer has its own coroutine, which receives a message into it, from any connection, and
// sends it back from it on that connection:
//
//   ibv_wc received = co_await srq.recv(buffer); // resumes on this receive's own completion,
//   co_await qp.send(message);                   // which names the QP; then on this send's
//
// With --no-srq each connection gets its own CQ, QP and a pool of --depth buffers, all posted
// as receives before the connection is accepted, one coroutine per buffer likewise
// (co_await qp.recv(buffer)).
//
// --threads N: N threads, each with its own io_context, completion channel, rdma_cm channel and
// SRQ + CQ. The main thread (one of the N) listens, and hands every accepted request to the
// thread serving the fewest connections: cm_id::migrate moves it to that thread's rdma_cm
// channel, where the connection lives until it closes.
//
// A connection that fails (the client vanished, sent more than --max-size, ...) or stays
// silent for --idle-timeout seconds is closed and its resources released; the others go on.
// Beyond --max-connections open connections, a request is rejected with the reason in the
// reject's private data ("busy: ..."), before anything is allocated for it. A request its thread
// cannot set up for (the shared receive pool cannot be registered, e.g. under RLIMIT_MEMLOCK)
// is rejected with the verb and errno ("server error: ..."); a later one tries again. SIGINT or
// SIGTERM closes every connection and exits 0.
//
// The parts: server.hpp (what is shared), connection.cpp, shared_receives.cpp, admission.cpp,
// and this file (options, listening, threads, the end).
#include "server.hpp"

using namespace echo;

namespace {

const char* const usage =
    "usage: echo_server [--address IP] [--port N] [--device NAME] [--max-size BYTES] [--depth N]\n"
    "                   [--mode events|hybrid|busy] [--max-connections N]\n"
    "                   [--idle-timeout SECONDS] [--threads N] [--srq-depth N | --no-srq]\n"
    "  --address   IPv4 or IPv6 address to listen on (default 0.0.0.0: every RDMA device)\n"
    "  --port      port (default 18515)\n"
    "  --device    serve only connections arriving on this RDMA device (default: any)\n"
    "  --max-size  largest message taken, the size of each posted receive (default 4096)\n"
    "  --depth     receives posted per connection (default 64)\n"
    "  --mode      how the completion channel waits (default events)\n"
    "  --max-connections  connections open at once; beyond, requests are rejected with the\n"
    "              reason \"busy: N connections\" (default 1024; 0: no limit)\n"
    "  --idle-timeout  close a connection that sent no message for this many seconds\n"
    "              (default 60; 0: never)\n"
    "  --threads   threads serving connections, each with its own ring, channels and shared\n"
    "              receive queue (default 1)\n"
    "  --srq-depth buffers of the shared receive queues, split over the threads (default 4096:\n"
    "              16 MiB registered with --max-size 4096, whatever the connections)\n"
    "  --no-srq    no shared receive queue: each connection gets its own CQ and --depth\n"
    "              receives (--depth * --max-size bytes registered per connection)\n";

// The first SIGINT or SIGTERM stops the server; the watch also ends when the server stops for
// another reason (its stop cancels the wait).
task<void> watch_signals(echo_server& server, signal_set& signals) {
    int signal_number = 0;
    try {
        signal_number = co_await signals.wait(wait_options(server.stopping.get_token()));
    } catch (const std::system_error& e) {
        if (e.code() != std::errc::operation_canceled) throw;
        co_return;
    }
    std::printf("echo_server: %s: closing %d connection(s)\n", strsignal(signal_number),
                server.open.load());
    std::fflush(stdout);
    server.stopping.request_stop();
}

server_options parse(int argc, char** argv) {
    server_options options;
    if (const char* device = std::getenv("RINGVERBS_DEVICE")) options.device = device;
    for (int i = 1; i < argc; ++i) {
        const std::string flag = argv[i];
        if (flag == "--help" || flag == "-h") throw echo::usage_error("");
        if (flag == "--no-srq") {
            options.srq = false;
            continue;
        }
        if (i + 1 >= argc) throw echo::usage_error(flag + " needs a value (or is unknown)");
        const std::string value = argv[++i];
        if (flag == "--address")
            options.address = value;
        else if (flag == "--port")
            options.port = static_cast<std::uint16_t>(echo::number(flag, value, 1, 65535));
        else if (flag == "--device")
            options.device = value;
        else if (flag == "--max-size")
            options.max_size = static_cast<std::uint32_t>(echo::number(flag, value, 1, 1u << 30));
        else if (flag == "--depth")
            options.depth = static_cast<std::uint32_t>(echo::number(flag, value, 1, 4096));
        else if (flag == "--mode")
            options.mode = echo::mode_of(value);
        else if (flag == "--max-connections")
            options.max_connections =
                static_cast<std::uint32_t>(echo::number(flag, value, 0, 1u << 20));
        else if (flag == "--threads")
            options.threads = static_cast<std::uint32_t>(echo::number(flag, value, 1, 64));
        else if (flag == "--srq-depth")
            options.srq_depth = static_cast<std::uint32_t>(echo::number(flag, value, 1, 1u << 20));
        else if (flag == "--idle-timeout")
            options.idle_timeout =
                static_cast<std::uint32_t>(echo::number(flag, value, 0, 1u << 30));
        else
            throw echo::usage_error("unknown option " + flag);
    }
    return options;
}

// The listening id, announced on stdout. Throws "cannot listen on ADDRESS: ..." (e.g. address in
// use).
cm_id listen_on(echo_server& server, const sockaddr_storage& address) {
    const auto* at = reinterpret_cast<const sockaddr*>(&address);
    cm_id listener(server.cm);
    try {
        listener.listen(at, 128);
    } catch (const std::system_error& e) {
        throw std::runtime_error("cannot listen on " + echo::text_of(at) + ": " + e.what());
    }
    // Bound to one device's address: its watch, and the main thread's PD and channel now, so
    // the first client waits less.
    if (listener.native()->verbs != nullptr) {
        watch_device(server, listener.device());
        resources_for(*server.workers.front(), listener.device());
    }
    const server_options& options = server.options;
    const std::string most =
        options.max_connections ? std::to_string(options.max_connections) : "no limit";
    const std::string idle =
        options.idle_timeout ? std::to_string(options.idle_timeout) + " s" : "never";
    const std::uint32_t per_thread =
        std::max<std::uint32_t>(options.srq_depth / options.threads, 1);
    const std::string receives =
        options.srq
            ? "a shared receive queue of " + std::to_string(per_thread) +
                  " buffers per device and thread (" +
                  std::to_string(std::uint64_t{per_thread} * options.threads * options.max_size >>
                                 10) +
                  " KiB registered, whatever the connections)"
            : std::to_string(options.depth) + " receives per connection (" +
                  std::to_string(std::uint64_t{options.depth} * options.max_size >> 10) +
                  " KiB registered each)";
    std::printf("echo_server: listening on %s (messages up to %u bytes, %s, %s mode; connections "
                "at most %s, closed when idle %s; %u thread(s))\n",
                echo::text_of(at).c_str(), options.max_size, receives.c_str(),
                to_string(options.mode), most.c_str(), idle.c_str(), options.threads);
    std::fflush(stdout);
    return listener;
}

// Runs a thread's io_context until its work is done: at the server's end, once every connection
// is closed and every task has ended. An exception escaping a task (none should: a request's or
// a connection's failure is handled where it happens) is logged and stops the server, which
// still ends in order: leaving run() for good would destroy the tasks' objects (CQs, channels,
// SRQ states) after their io_context, or while their coroutines are still suspended.
void run_to_end(echo_server& server, io_context& io, int thread) {
    for (;;) {
        try {
            io.run();
            return;
        } catch (const std::exception& e) {
            std::fprintf(stderr, "echo_server: thread %d: %s; stopping\n", thread, e.what());
        } catch (...) {
            std::fprintf(stderr, "echo_server: thread %d: unknown exception; stopping\n", thread);
        }
        server.failed = true;
        server.stopping.request_stop();
    }
}

// Starts workers 1..N-1, each on its own thread with its own io_context and rdma_cm channel,
// running until the server's end (retire). Returns once every one is ready to take
// connections. Throws what a worker's setup threw (~echo_server joins the others).
void start_workers(echo_server& server) {
    for (std::uint32_t i = 1; i < server.options.threads; ++i) {
        auto w = std::make_unique<worker>(server, static_cast<int>(i));
        std::promise<void> ready;
        std::future<void> started = ready.get_future();
        w->thread = std::thread([&owner = *w, &ready] {
            std::optional<io_context> io;
            std::optional<cm_channel> cm;
            try {
                io.emplace();
                cm.emplace(*io);
                owner.io = &*io;
                owner.cm = &*cm;
                io->spawn(retire(owner));
            } catch (...) {
                ready.set_exception(std::current_exception());
                return;
            }
            ready.set_value(); // (`ready` is gone once the main thread goes on)
            run_to_end(owner.server, *io, owner.index);
            owner.devices.clear(); // on this thread, before its channel and ring go
        });
        server.workers.push_back(std::move(w));
        started.get();
    }
}

// Waits for the workers' threads (after the main thread's ring ran dry: the server stopped).
void join_workers(echo_server& server) {
    for (auto& w : server.workers)
        if (w->thread.joinable()) w->thread.join();
}

} // namespace

echo::echo_server::~echo_server() {
    stopping.request_stop();
    join_workers(*this);
}

int main(int argc, char** argv) {
    server_options options;
    if (auto status = echo::parse_options("echo_server", usage, parse, argc, argv, options))
        return *status;
    try {
        echo::check_device(options.device);
        const sockaddr_storage address = echo::address_of(options.address, options.port);
        io_context io;
        // Blocked in this thread before the workers' threads start, which inherit the mask.
        signal_set signals(io, {SIGINT, SIGTERM});
        echo_server server(io, options);
        server.workers.push_back(std::make_unique<worker>(server, 0));
        server.workers.front()->io = &io;
        server.workers.front()->cm = &server.cm;
        // From here on, a failure to start still lets the main thread's tasks end (the device
        // watch, the shared receive loops: retire drops their queue) before their objects go.
        io.spawn(retire(*server.workers.front()));
        std::optional<cm_id> listener;
        try {
            listener.emplace(listen_on(server, address));
            start_workers(server);
        } catch (...) {
            server.stopping.request_stop();
            run_to_end(server, io, 0);
            throw;
        }
        io.spawn(watch_signals(server, signals));
        io.spawn(accept_loop(server, *listener));
        // Until a signal: the accept loop, then every connection, then the signal watch end;
        // then the other threads, once their connections are gone.
        run_to_end(server, io, 0);
        join_workers(server);
        int served = 0;
        std::uint64_t messages = 0, bytes = 0;
        for (auto& w : server.workers) {
            served += w->served;
            messages += w->messages;
            bytes += w->bytes;
        }
        std::printf(
            "echo_server: shut down: %d connection(s) served, %llu messages, %llu bytes echoed, "
            "%llu request(s) rejected as busy\n",
            served, static_cast<unsigned long long>(messages),
            static_cast<unsigned long long>(bytes),
            static_cast<unsigned long long>(server.rejected));
        return server.failed ? 1 : 0;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "echo_server: %s\n", e.what());
        return 1;
    }
}
