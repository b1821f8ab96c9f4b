// rdma_pingpong: the completion runtime in one page. Two RC queue pairs of one device,
// connected to each other, exchange messages; every send and every receive is a co_await
// that resumes on that very request's completion, delivered through a completion channel
// watched by io_uring.
//
//   rdma_pingpong [--device NAME] [--messages N] [--size BYTES] [--mode events|busy|hybrid]
//
// Needs an RDMA device (tools/softroce-vm runs it on Soft-RoCE when the host has none).
#include <ringverbs/rdma/channel.hpp>
#include <ringverbs/rdma/cq.hpp>
#include <ringverbs/rdma/qp.hpp>
#include <ringverbs/ringverbs.hpp>
#include <ringverbs/verbs.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

using namespace ringverbs;

namespace {

struct options {
    std::string device = std::getenv("RINGVERBS_DEVICE") ? std::getenv("RINGVERBS_DEVICE") : "";
    int messages = 10000;
    std::size_t size = 64;
    polling_mode mode = polling_mode::events;
};

// The options, or nothing (after the usage line) when one is unknown.
std::optional<options> parse(int argc, char** argv) {
    options o;
    for (int i = 1; i + 1 < argc; i += 2) {
        std::string a = argv[i], v = argv[i + 1];
        if (a == "--device")
            o.device = v;
        else if (a == "--messages")
            o.messages = std::stoi(v);
        else if (a == "--size")
            o.size = std::stoul(v);
        else if (a == "--mode" && parse_polling_mode(v))
            o.mode = *parse_polling_mode(v);
        else {
            std::fprintf(stderr, "usage: rdma_pingpong [--device NAME] [--messages N] [--size "
                                 "BYTES] [--mode events|busy|hybrid]\n");
            return std::nullopt;
        }
    }
    return o;
}

// The device to use, or nothing (said on stderr) when there is none this example can use.
std::optional<verbs::context> open_device(const std::string& name) {
    verbs::device_list devices;
    if (devices.size() == 0) {
        std::fprintf(stderr,
                     "rdma_pingpong: no RDMA device (tools/softroce-vm runs this on Soft-RoCE)\n");
        return std::nullopt;
    }
    verbs::context dev = name.empty() ? verbs::context(devices[0]) : verbs::context(name);
    if (dev.native()->device->transport_type == IBV_TRANSPORT_IWARP) {
        // Connected by hand (INIT, RTR, RTS), which iWARP does not allow.
        std::fprintf(stderr,
                     "rdma_pingpong: %s is an iWARP device; this example connects its QPs by "
                     "hand (InfiniBand/RoCE only): see reverse_server/reverse_client\n",
                     std::string(dev.name()).c_str());
        return std::nullopt;
    }
    return dev;
}

// b's side: a pool of receives kept posted (wr_id = slot), whose completions it takes with
// cq.next(); each message goes back with a per-request send, whose completion goes to this
// coroutine, not to next().
class echo_side {
  public:
    echo_side(const verbs::protection_domain& pd, cq& completions, qp& q, std::size_t size)
        : completions_(completions), q_(q), size_(size), slots_(pool * size), pong_(size),
          mr_slots_(pd, slots_), mr_pong_(pd, pong_) {
        for (std::size_t i = 0; i < pool; ++i)
            post_slot(i);
    }
    task<void> run(int messages) {
        for (int m = 0; m < messages; ++m) {
            ibv_wc wc = co_await completions_.next();
            if (wc.status != IBV_WC_SUCCESS) throw completion_error(wc, "echo receive");
            std::memcpy(pong_.data(), slots_.data() + wc.wr_id * size_, wc.byte_len);
            post_slot(wc.wr_id); // give the slot back before replying
            co_await q_.send(local_buffer(mr_pong_, std::span(pong_).first(wc.byte_len)));
        }
    }

  private:
    static constexpr std::size_t pool = 16;
    void post_slot(std::size_t i) {
        ibv_sge sge{reinterpret_cast<std::uintptr_t>(slots_.data() + i * size_),
                    static_cast<std::uint32_t>(size_), mr_slots_.native()->lkey};
        ibv_recv_wr wr{};
        wr.wr_id = i;
        wr.sg_list = &sge;
        wr.num_sge = 1;
        q_.native_qp().post_recv(wr);
    }
    cq& completions_;
    qp& q_;
    std::size_t size_;
    std::vector<std::byte> slots_, pong_;
    verbs::memory_region mr_slots_, mr_pong_;
};

// a's side: each message, its reply's receive posted first, then the send; both awaited, the
// reply checked byte for byte. Returns how many came back intact; their round trips in rtt_us.
task<long> ping_side(const verbs::protection_domain& pd, qp& a, int messages, std::size_t size,
                     std::vector<double>& rtt_us) {
    std::vector<std::byte> ping(size), got(size);
    verbs::memory_region mr_ping(pd, ping), mr_got(pd, got);
    long verified = 0;
    for (int m = 0; m < messages; ++m) {
        for (std::size_t i = 0; i < size; ++i)
            ping[i] = static_cast<std::byte>((m * 31 + i) & 0xff);
        auto reply = a.recv(local_buffer(mr_got, got));
        reply.post();
        auto t0 = std::chrono::steady_clock::now();
        co_await a.send(local_buffer(mr_ping, ping));
        co_await reply;
        rtt_us.push_back(
            std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0)
                .count());
        if (std::memcmp(got.data(), ping.data(), size) == 0) ++verified;
    }
    co_return verified;
}

void report(const options& o, const verbs::context& dev, long verified, double secs,
            std::vector<double>& rtt_us, const channel_counters& c) {
    std::sort(rtt_us.begin(), rtt_us.end());
    auto pct = [&](double p) {
        return rtt_us[static_cast<std::size_t>(p * static_cast<double>(rtt_us.size() - 1))];
    };
    std::printf("rdma_pingpong on %.*s (%s mode): %ld of %d messages of %zu bytes echoed and "
                "verified byte for byte\n",
                static_cast<int>(dev.name().size()), dev.name().data(), to_string(o.mode), verified,
                o.messages, o.size);
    std::printf("rdma_pingpong: %.0f round trips/s, round trip p50 %.1f us, p99 %.1f us\n",
                static_cast<double>(o.messages) / secs, pct(0.50), pct(0.99));
    std::printf("rdma_pingpong: channel: %llu wakeups, %llu events, %llu acks, %llu arms, %llu "
                "polls (%llu empty)\n",
                static_cast<unsigned long long>(c.wakeups),
                static_cast<unsigned long long>(c.events), static_cast<unsigned long long>(c.acks),
                static_cast<unsigned long long>(c.arms), static_cast<unsigned long long>(c.polls),
                static_cast<unsigned long long>(c.empty_polls));
}

} // namespace

int main(int argc, char** argv) {
    const std::optional<options> o = parse(argc, argv);
    if (!o) return 2;
    try {
        std::optional<verbs::context> dev = open_device(o->device);
        if (!dev) return 77;
        std::uint8_t port = dev->first_active_port().value_or(1);
        std::uint32_t gid = dev->find_gid_index(port).value_or(0);
        verbs::protection_domain pd(*dev);

        // Two QPs of one device, each with its CQ on one completion channel, connected to
        // each other.
        io_context io;
        channel ch(io, *dev, channel_options{.mode = o->mode});
        cq cq_a(ch), cq_b(ch);
        qp a(pd, cq_a, cq_a), b(pd, cq_b, cq_b);
        verbs::connect_loopback(a.native_qp(), b.native_qp(), port, gid);

        echo_side echo(pd, cq_b, b, o->size);
        std::vector<double> rtt_us;
        rtt_us.reserve(static_cast<std::size_t>(o->messages));
        io.spawn(echo.run(o->messages));
        auto t0 = std::chrono::steady_clock::now();
        long verified = io.run(ping_side(pd, a, o->messages, o->size, rtt_us));
        double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        report(*o, *dev, verified, secs, rtt_us, ch.counters());
        return verified == o->messages ? 0 : 1;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "rdma_pingpong: %s\n", e.what());
        return 1;
    }
}
