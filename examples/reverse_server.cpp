// The README's rdma_cm server, verbatim (tests/readme_test.py keeps them equal).
#include <algorithm>
#include <cstdio>
#include <ringverbs/cm.hpp> // connect, listener, connection; the engine and the runtime
using namespace ringverbs;

// Answers every message with its bytes reversed, until the client leaves or the server stops.
task<void> serve(connection c, std::stop_token stop) {
    try {
        std::vector<std::byte> out(4096);
        verbs::memory_region mr(c.pd(), out); // c.pd(): shared by every connection on the device
        for (;;) {
            recv_ring::message m = co_await c.next_message(stop);
            std::reverse_copy(m.data.begin(), m.data.end(), out.begin());
            co_await c.send(local_buffer(mr, std::span(out).first(m.data.size())));
        }
    } catch (const std::exception& e) { // connection_reset: the client left; ENOMEM, ...
        std::printf("%s: %s\n", c.peer_address().c_str(), e.what());
    }
}

int main(int argc, char** argv) try {
    io_context io;
    signal_set signals(io, {SIGINT, SIGTERM}); // blocked, then read through the ring
    connection_options options;
    options.receive_slots = 16; // 16 receives of 4 KiB kept posted per connection
    listener l(io, argc > 1 ? argv[1] : ":7471", options);
    std::printf("listening on port %u\n", l.port());
    std::fflush(stdout);
    std::stop_source stop;
    auto accept_all = [&](std::stop_token token) -> task<void> {
        for (;;)
            io.spawn(serve(co_await l.accept(token), stop.get_token()));
    };
    auto a_signal = [&](std::stop_token token) -> task<void> { co_await signals.wait(token); };
    io.run(when_any(io, accept_all, a_signal)); // until SIGINT or SIGTERM
    stop.request_stop();                        // every connection's receive ends
    io.run();                                   // and so do their tasks
} catch (const std::exception& e) {             // EADDRINUSE, no device, ...
    std::fprintf(stderr, "reverse_server: %s\n", e.what());
    return 1;
}
