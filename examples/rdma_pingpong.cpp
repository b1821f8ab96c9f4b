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
#include <string>
#include <vector>

using namespace ringverbs;

int main(int argc, char** argv) {
    std::string device_name =
        std::getenv("RINGVERBS_DEVICE") ? std::getenv("RINGVERBS_DEVICE") : "";
    int messages = 10000;
    std::size_t size = 64;
    polling_mode mode = polling_mode::events;
    for (int i = 1; i + 1 < argc; i += 2) {
        std::string a = argv[i], v = argv[i + 1];
        if (a == "--device")
            device_name = v;
        else if (a == "--messages")
            messages = std::stoi(v);
        else if (a == "--size")
            size = std::stoul(v);
        else if (a == "--mode" && parse_polling_mode(v))
            mode = *parse_polling_mode(v);
        else {
            std::fprintf(stderr, "usage: rdma_pingpong [--device NAME] [--messages N] [--size "
                                 "BYTES] [--mode events|busy|hybrid]\n");
            return 2;
        }
    }
    try {
        verbs::device_list devices;
        if (devices.size() == 0) {
            std::fprintf(
                stderr,
                "rdma_pingpong: no RDMA device (tools/softroce-vm runs this on Soft-RoCE)\n");
            return 77;
        }
        verbs::context dev =
            device_name.empty() ? verbs::context(devices[0]) : verbs::context(device_name);
        if (dev.native()->device->transport_type == IBV_TRANSPORT_IWARP) {
            // Connected by hand below (INIT, RTR, RTS), which iWARP does not allow.
            std::fprintf(stderr,
                         "rdma_pingpong: %s is an iWARP device; this example connects its QPs by "
                         "hand (InfiniBand/RoCE only): see reverse_server/reverse_client\n",
                         std::string(dev.name()).c_str());
            return 77;
        }
        std::uint8_t port = dev.first_active_port().value_or(1);
        std::uint32_t gid = dev.find_gid_index(port).value_or(0);
        verbs::protection_domain pd(dev);

        io_context io;
        channel ch(io, dev, channel_options{.mode = mode});
        cq cq_a(ch), cq_b(ch);
        qp a(pd, cq_a, cq_a), b(pd, cq_b, cq_b);
        verbs::connect_loopback(a.native_qp(), b.native_qp(), port, gid);

        std::vector<std::byte> ping(size), pong(size), got_a(size);
        verbs::memory_region mr_ping(pd, ping), mr_pong(pd, pong), mr_a(pd, got_a);
        std::vector<double> rtt_us;
        rtt_us.reserve(static_cast<std::size_t>(messages));

        // b keeps a pool of receives posted (wr_id = slot) and takes their completions with
        // cq.next(); its sends are per-request awaits, which go to the coroutine, not next().
        constexpr std::size_t pool = 16;
        std::vector<std::byte> slots(pool * size);
        verbs::memory_region mr_slots(pd, slots);
        auto post_slot = [&](std::size_t i) {
            ibv_sge sge{reinterpret_cast<std::uintptr_t>(slots.data() + i * size),
                        static_cast<std::uint32_t>(size), mr_slots.native()->lkey};
            ibv_recv_wr wr{};
            wr.wr_id = i;
            wr.sg_list = &sge;
            wr.num_sge = 1;
            b.native_qp().post_recv(wr);
        };
        for (std::size_t i = 0; i < pool; ++i)
            post_slot(i);
        auto echo = [&]() -> task<void> {
            for (int m = 0; m < messages; ++m) {
                ibv_wc wc = co_await cq_b.next();
                if (wc.status != IBV_WC_SUCCESS) throw completion_error(wc, "echo receive");
                std::memcpy(pong.data(), slots.data() + wc.wr_id * size, wc.byte_len);
                post_slot(wc.wr_id); // give the slot back before replying
                co_await b.send(local_buffer(mr_pong, std::span(pong).first(wc.byte_len)));
            }
        };
        auto client = [&]() -> task<long> {
            long verified = 0;
            for (int m = 0; m < messages; ++m) {
                for (std::size_t i = 0; i < size; ++i)
                    ping[i] = static_cast<std::byte>((m * 31 + i) & 0xff);
                auto reply = a.recv(local_buffer(mr_a, got_a));
                reply.post();
                auto t0 = std::chrono::steady_clock::now();
                co_await a.send(local_buffer(mr_ping, ping));
                co_await reply;
                rtt_us.push_back(
                    std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0)
                        .count());
                if (std::memcmp(got_a.data(), ping.data(), size) == 0) ++verified;
            }
            co_return verified;
        };
        io.spawn(echo());
        auto t0 = std::chrono::steady_clock::now();
        long verified = io.run(client());
        double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        std::sort(rtt_us.begin(), rtt_us.end());
        auto pct = [&](double p) {
            return rtt_us[static_cast<std::size_t>(p * static_cast<double>(rtt_us.size() - 1))];
        };
        std::printf("rdma_pingpong on %.*s (%s mode): %ld of %d messages of %zu bytes echoed and "
                    "verified byte for byte\n",
                    static_cast<int>(dev.name().size()), dev.name().data(), to_string(mode),
                    verified, messages, size);
        std::printf("rdma_pingpong: %.0f round trips/s, round trip p50 %.1f us, p99 %.1f us\n",
                    static_cast<double>(messages) / secs, pct(0.50), pct(0.99));
        const channel_counters& c = ch.counters();
        std::printf(
            "rdma_pingpong: channel: %llu wakeups, %llu events, %llu acks, %llu arms, %llu polls "
            "(%llu empty)\n",
            static_cast<unsigned long long>(c.wakeups), static_cast<unsigned long long>(c.events),
            static_cast<unsigned long long>(c.acks), static_cast<unsigned long long>(c.arms),
            static_cast<unsigned long long>(c.polls),
            static_cast<unsigned long long>(c.empty_polls));
        return verified == messages ? 0 : 1;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "rdma_pingpong: %s\n", e.what());
        return 1;
    }
}
