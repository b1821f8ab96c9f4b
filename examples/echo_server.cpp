// echo_server: every message a client SENDs comes back unchanged with a SEND. One coroutine
// per connection, all on one io_context: rdma_cm events, completions and signals all arrive
// through its io_uring ring.
//
//   echo_server [--address IP] [--port N] [--device NAME] [--max-size BYTES] [--depth N]
//               [--mode events|hybrid|busy]
//
// Each connection gets its own CQ, QP and a registered pool of --depth buffers of --max-size
// bytes, all posted as receives before the connection is accepted. A message is echoed from
// the buffer it arrived in; the buffer is posted again once the echo's send completed. A
// connection that fails (the client vanished, sent more than --max-size, ...) is closed and its
// resources released; the others go on. SIGINT or SIGTERM closes every connection and exits 0.
#include "echo_common.hpp"

#include <ringverbs/rdma/channel.hpp>
#include <ringverbs/cm/cm_id.hpp>
#include <ringverbs/rdma/cq.hpp>
#include <ringverbs/rdma/device_events.hpp>
#include <ringverbs/rdma/qp.hpp>

#include <arpa/inet.h>
#include <unistd.h>

#include <cstdio>
#include <map>
#include <memory>
#include <optional>
#include <vector>

using namespace ringverbs;
using namespace std::chrono_literals;

namespace {

const char* const usage =
    "usage: echo_server [--address IP] [--port N] [--device NAME] [--max-size BYTES] [--depth N]\n"
    "                   [--mode events|hybrid|busy]\n"
    "  --address   IPv4 or IPv6 address to listen on (default 0.0.0.0: every RDMA device)\n"
    "  --port      port (default 18515)\n"
    "  --device    serve only connections arriving on this RDMA device (default: any)\n"
    "  --max-size  largest message taken, the size of each posted receive (default 4096)\n"
    "  --depth     receives posted per connection (default 64)\n"
    "  --mode      how the completion channel waits (default events)\n";

struct server_options {
    std::string address = "0.0.0.0";
    std::uint16_t port = echo::default_port;
    std::string device;
    std::uint32_t max_size = echo::default_max_size;
    std::uint32_t depth = 64;
    polling_mode mode = polling_mode::events;
};

// What connections of one device share: its protection domain, completion channel, and the
// watch on its asynchronous events (a port going down, a CQ overrun, a fatal QP error).
struct device_resources {
    verbs::context context;
    verbs::protection_domain pd{context};
    channel completion_channel;
    device_events device_watch;
    device_resources(io_context& io, verbs::context device, polling_mode mode)
        : context(std::move(device)), completion_channel(io, context, channel_options{.mode = mode}),
          device_watch(io, context) {}
};

struct echo_server {
    echo_server(io_context& io, server_options options) : io(io), options(std::move(options)) {}
    io_context& io;
    server_options options;
    cm_channel cm{io};
    std::map<ibv_context*, std::unique_ptr<device_resources>> devices;
    std::stop_source stopping;
    int open = 0, served = 0;
    std::uint64_t messages = 0, bytes = 0;
};

struct outcome {
    std::string why;
    std::uint64_t messages = 0, bytes = 0;
};

// wr_ids: the slot of the buffer, with this bit set for the echo's send.
constexpr std::uint64_t send_bit = std::uint64_t{1} << 32;

// Serves one accepted connection until it ends; its CQ, QP and buffers go when this returns.
task<outcome> echo_until_closed(echo_server& server, device_resources& device, cm_id id) {
    const std::uint32_t size = server.options.max_size, depth = server.options.depth;
    // The pool is declared before the QP, so that it outlives it.
    std::vector<std::byte> pool(std::size_t{depth} * size);
    verbs::memory_region mr(device.pd, pool);
    cq completions(device.completion_channel, cq_options{.entries = static_cast<int>(2 * depth)});
    qp q = id.make_qp(device.pd, completions, completions, verbs::qp_caps{.max_send_wr = depth, .max_recv_wr = depth});
    std::vector<std::uint32_t> length(depth); // of the message each slot echoes
    ibv_sge sge{};
    auto post_receive = [&](std::uint64_t slot) {
        sge = {reinterpret_cast<std::uintptr_t>(&pool[slot * size]), size, mr.native()->lkey};
        ibv_recv_wr wr{.wr_id = slot, .next = nullptr, .sg_list = &sge, .num_sge = 1};
        q.native_qp().post_recv(wr);
    };
    auto post_echo = [&](std::uint64_t slot, std::uint32_t len) {
        sge = {reinterpret_cast<std::uintptr_t>(&pool[slot * size]), len, mr.native()->lkey};
        ibv_send_wr wr{};
        wr.wr_id = slot | send_bit;
        wr.sg_list = &sge;
        wr.num_sge = 1;
        wr.opcode = IBV_WR_SEND;
        wr.send_flags = IBV_SEND_SIGNALED;
        q.native_qp().post_send(wr);
    };
    for (std::uint64_t slot = 0; slot < depth; ++slot) post_receive(slot);

    outcome out;
    const echo::server_hello hello{htonl(size), htonl(depth)};
    try {
        co_await id.accept_connection(std::as_bytes(std::span(&hello, 1)), wait_options(10s));
    } catch (const std::exception& e) {
        out.why = e.what();
        co_return out; // destroying the qp flushes the receives
    }

    // Every posted request completes exactly once: count them until all are back.
    std::size_t posted = depth;
    bool closing = false;
    auto close = [&](std::string why) -> task<void> {
        if (closing) co_return;
        closing = true;
        out.why = std::move(why);
        try { // rdma_disconnect: the QP goes to the error state, the rest is flushed
            co_await id.disconnect(wait_options(2s));
        } catch (const std::exception&) {
            // The client is gone without a word: the flush comes all the same.
        }
    };
    while (posted > 0) {
        ibv_wc wc{};
        // Once closing, only the flushes are awaited, and not forever: Soft-RoCE on Linux 6.1
        // never flushes a send that was waiting for the peer's ACK. The QP is in the error
        // state by then, so destroying it with such a request outstanding is safe.
        const wait_options wait = closing ? wait_options(5s) : wait_options(server.stopping.get_token());
        bool interrupted = false;
        try {
            wc = co_await completions.next(wait);
        } catch (const std::system_error&) {
            interrupted = true; // a co_await may not be in a handler
        }
        if (interrupted && closing) {
            out.why += "; " + std::to_string(posted) + " request(s) never flushed by the device";
            break;
        }
        if (interrupted) {
            co_await close("the server is shutting down");
            continue;
        }
        --posted;
        const std::uint64_t slot = wc.wr_id & ~send_bit;
        if (wc.status != IBV_WC_SUCCESS) {
            if (wc.status == IBV_WC_WR_FLUSH_ERR && id.is_disconnected()) co_await close("the client disconnected");
            else if (!(wc.wr_id & send_bit) && (wc.status == IBV_WC_LOC_LEN_ERR || wc.status == IBV_WC_LOC_QP_OP_ERR))
                // A receive too small for the message: LOC_LEN_ERR, or LOC_QP_OP_ERR on rxe.
                co_await close("a message larger than " + std::to_string(size) + " bytes (receive failed: " +
                               ibv_wc_status_str(wc.status) + ")");
            else co_await close(std::string(wc.wr_id & send_bit ? "echo send" : "receive") + " failed: " + ibv_wc_status_str(wc.status));
            continue;
        }
        if (closing) continue;
        std::string failed;
        try {
            if (wc.opcode == IBV_WC_RECV) {
                length[slot] = wc.byte_len;
                post_echo(slot, wc.byte_len); // the reply leaves from the buffer it came in
            } else {
                ++out.messages;
                out.bytes += length[slot];
                post_receive(slot); // the echo is sent: the buffer takes a message again
            }
            ++posted;
        } catch (const std::exception& e) {
            failed = e.what(); // ibv_post_*: named with its errno
        }
        if (!failed.empty()) co_await close(failed);
    }
    co_return out;
}

task<void> serve(echo_server& server, device_resources& device, cm_id id, int number) {
    const std::string peer = echo::text_of(rdma_get_peer_addr(id.native()));
    ++server.open;
    outcome out;
    try {
        out = co_await echo_until_closed(server, device, std::move(id));
    } catch (const std::exception& e) {
        out.why = e.what();
    }
    --server.open;
    ++server.served;
    server.messages += out.messages;
    server.bytes += out.bytes;
    std::printf("echo_server: connection %d from %s closed (%s) after %llu messages, %llu bytes; "
                "its QP, CQ and MR released; %d open\n",
                number, peer.c_str(), out.why.c_str(), static_cast<unsigned long long>(out.messages),
                static_cast<unsigned long long>(out.bytes), server.open);
    std::fflush(stdout);
}

// Logs the device's asynchronous events until the server stops. The runtime has already
// routed each one (a CQ overrun fails that CQ, a fatal QP error flushes that QP), so the
// connection concerned ends on its own.
task<void> log_device_events(echo_server& server, device_resources& device) {
    for (;;) {
        async_event event;
        try {
            event = co_await device.device_watch.next(wait_options(server.stopping.get_token()));
        } catch (const std::system_error&) {
            co_return; // shutting down
        }
        const std::string_view name = device.context.name();
        std::printf("echo_server: device %.*s: %s%s\n", static_cast<int>(name.size()), name.data(), event.name(),
                    event.routed ? " (its connection is closed)" : "");
        std::fflush(stdout);
    }
}

device_resources& resources_for(echo_server& server, verbs::context context) {
    auto& resources = server.devices[context.native()];
    if (!resources) {
        resources = std::make_unique<device_resources>(server.io, std::move(context), server.options.mode);
        server.io.spawn(log_device_events(server, *resources));
    }
    return *resources;
}

task<void> accept_loop(echo_server& server, cm_id& listener) {
    for (int number = 1;; ++number) {
        std::optional<cm_id> request;
        try {
            request.emplace(co_await listener.accept(wait_options(server.stopping.get_token())));
        } catch (const std::system_error& e) {
            if (e.code() != std::errc::operation_canceled) {
                std::fprintf(stderr, "echo_server: %s\n", e.what());
                server.stopping.request_stop();
            }
            co_return;
        }
        verbs::context device = request->device();
        if (!server.options.device.empty() && device.name() != server.options.device) {
            request->reject();
            continue;
        }
        server.io.spawn(serve(server, resources_for(server, std::move(device)), std::move(*request), number));
    }
}

task<void> watch_signals(echo_server& server, int fd) {
    const int signal_number = co_await echo::next_signal(server.io, fd, server.stopping.get_token());
    if (signal_number != 0) {
        std::printf("echo_server: %s: closing %d connection(s)\n", strsignal(signal_number), server.open);
        std::fflush(stdout);
        server.stopping.request_stop();
    }
}

server_options parse(int argc, char** argv) {
    server_options options;
    if (const char* device = std::getenv("RINGVERBS_DEVICE")) options.device = device;
    for (int i = 1; i < argc; ++i) {
        const std::string flag = argv[i];
        if (flag == "--help" || flag == "-h") throw echo::usage_error("");
        if (i + 1 >= argc) throw echo::usage_error(flag + " needs a value (or is unknown)");
        const std::string value = argv[++i];
        if (flag == "--address") options.address = value;
        else if (flag == "--port") options.port = static_cast<std::uint16_t>(echo::number(flag, value, 1, 65535));
        else if (flag == "--device") options.device = value;
        else if (flag == "--max-size") options.max_size = static_cast<std::uint32_t>(echo::number(flag, value, 1, 1u << 30));
        else if (flag == "--depth") options.depth = static_cast<std::uint32_t>(echo::number(flag, value, 1, 4096));
        else if (flag == "--mode") options.mode = echo::mode_of(value);
        else throw echo::usage_error("unknown option " + flag);
    }
    return options;
}

} // namespace

int main(int argc, char** argv) {
    server_options options;
    if (auto status = echo::parse_options("echo_server", usage, parse, argc, argv, options)) return *status;
    try {
        echo::check_device(options.device);
        const sockaddr_storage address = echo::address_of(options.address, options.port);
        const int signals = echo::signal_fd();
        io_context io;
        echo_server server(io, options);
        cm_id listener(server.cm);
        try {
            listener.listen(reinterpret_cast<const sockaddr*>(&address), 128);
        } catch (const std::system_error& e) {
            throw std::runtime_error("cannot listen on " + echo::text_of(reinterpret_cast<const sockaddr*>(&address)) + ": " + e.what());
        }
        // Bound to one device's address: its PD and channel now, so the first client waits less.
        if (listener.native()->verbs != nullptr) resources_for(server, listener.device());
        std::printf("echo_server: listening on %s (messages up to %u bytes, %u receives per connection, %s mode)\n",
                    echo::text_of(reinterpret_cast<const sockaddr*>(&address)).c_str(), options.max_size, options.depth,
                    echo::mode_name(options.mode));
        std::fflush(stdout);
        io.spawn(watch_signals(server, signals));
        io.spawn(accept_loop(server, listener));
        io.run(); // until a signal: the accept loop, then every connection, then the signal watch end
        std::printf("echo_server: shut down: %d connection(s) served, %llu messages, %llu bytes echoed\n", server.served,
                    static_cast<unsigned long long>(server.messages), static_cast<unsigned long long>(server.bytes));
        ::close(signals);
        return 0;
    } catch (const std::exception& e) {
        std::fprintf(stderr, "echo_server: %s\n", e.what());
        return 1;
    }
}
