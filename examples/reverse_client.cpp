// The README's rdma_cm client, verbatim (tests/readme_test.py keeps them equal).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ringverbs/cm.hpp>
using namespace ringverbs;

// Sends `count` messages, checks each reply is the message reversed; returns those that were.
task<int> run_client(io_context& io, std::string address, int count) {
    connection_options options;
    options.receive_slots = 4;
    connection c = co_await connect(io, address, options); // every step bounded (15 s)
    std::vector<std::byte> out(1024);
    verbs::memory_region mr(c.pd(), out);
    int verified = 0;
    for (int i = 0; i < count; ++i) {
        const auto len = static_cast<std::size_t>(1 + i % 1024);
        for (std::size_t k = 0; k < len; ++k)
            out[k] = std::byte(i + k);
        co_await c.send(local_buffer(mr, std::span(out).first(len)));
        recv_ring::message reply = co_await c.next_message(std::chrono::seconds(5));
        std::reverse(reply.data.begin(), reply.data.end());
        verified +=
            reply.data.size() == len && std::memcmp(reply.data.data(), out.data(), len) == 0;
    }
    co_await c.disconnect();
    co_return verified;
}

int main(int argc, char** argv) try {
    io_context io;
    const int count = argc > 2 ? std::atoi(argv[2]) : 1000;
    const int verified = io.run(run_client(io, argc > 1 ? argv[1] : "198.18.0.1:7471", count));
    std::printf("%d/%d replies verified\n", verified, count);
    return verified == count ? 0 : 1;
} catch (const std::exception& e) { // connection_rejected, timed_out, ...: says which step
    std::fprintf(stderr, "reverse_client: %s\n", e.what());
    return 1;
}
