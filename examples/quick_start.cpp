// The README's quick start, verbatim (tests/readme_test.py keeps them equal).
#include <ringverbs/rdma.hpp> // the engine, the verbs wrappers, channel, cq, qp
using namespace ringverbs;

int main() {
    verbs::device_list devices; // throws if libibverbs fails; may be empty
    verbs::context dev(devices[0]);
    verbs::protection_domain pd(dev);
    io_context io;         // one io_uring ring on this thread
    channel ch(io, dev);   // completion channel, watched by io_uring
    cq cq_a(ch), cq_b(ch); // armed, spread over completion vectors
    qp a(pd, cq_a, cq_a), b(pd, cq_b, cq_b);
    verbs::connect_loopback(a.native_qp(), b.native_qp(), 1, dev.find_gid_index(1).value_or(0));

    std::vector<std::byte> out(64, std::byte{42}), in(64);
    verbs::memory_region mr_out(pd, out), mr_in(pd, in);
    auto exchange = [&]() -> task<std::uint32_t> {
        auto r = b.recv(local_buffer(mr_in, in));
        r.post(); // post the receive first
        co_await a.send(local_buffer(mr_out, out));
        ibv_wc wc = co_await r; // resumed by this very request's completion
        co_return wc.byte_len;
    };
    return io.run(exchange()) == 64 ? 0 : 1;
}
