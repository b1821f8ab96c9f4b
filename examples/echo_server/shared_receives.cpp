// echo_server: a device's shared receive queue, its echo loops, and the device's events.
#include "connection.hpp"

namespace echo {

namespace {

// Logs the device's asynchronous events until the server stops. The runtime has already
// routed each one to the object it names, on whichever thread owns it (a CQ overrun fails that
// CQ, a fatal QP error flushes that QP), so the connection concerned ends on its own.
task<void> log_device_events(echo_server& server, device_events& watch, std::string name) {
    for (;;) {
        async_event event;
        try {
            event = co_await watch.next(wait_options(server.stopping.get_token()));
        } catch (const std::system_error&) {
            co_return; // shutting down
        }
        std::printf("echo_server: device %.*s: %s%s\n", static_cast<int>(name.size()), name.data(),
                    event.name(), event.routed ? " (its connection is closed)" : "");
        std::fflush(stdout);
    }
}

// Slot `slot` of the shared pool (buffers of `size` bytes), its first `length` bytes.
local_buffer pool_slot(shared_receives& shared, std::uint32_t slot, std::uint32_t size,
                       std::uint32_t length) {
    return local_buffer(shared.mr,
                        std::span(shared.pool).subspan(std::size_t{slot} * size, length));
}

// The connection of QP `qp_num`, or null once it is gone.
connection* connection_of(shared_receives& shared, std::uint32_t qp_num) {
    auto it = shared.by_qp.find(qp_num);
    return it == shared.by_qp.end() ? nullptr : it->second;
}

// Echoes the message in `from` on `c` (the connection of QP `qp_num`), then tells that
// connection how it went: looked up again, since it may have closed (and gone) meanwhile.
task<void> echo_on(shared_receives& shared, connection* c, std::uint32_t qp_num,
                   local_buffer from) {
    ++shared.sending;
    const result<ibv_wc> sent = co_await nothrow(c->echo(from));
    --shared.sending;
    connection* again = connection_of(shared, qp_num);
    if (again == nullptr) co_return;
    if (sent) {
        again->echoed(from.length);
        co_return;
    }
    try {
        sent.rethrow_if_failed();
    } catch (const connection_reset&) {
        // Flushed by a connection end the server did not cause (fail() ignores a closing
        // connection): on iWARP the QP fails as the client's TCP stream ends, before the
        // DISCONNECTED event says so.
        again->fail("the client disconnected");
    } catch (const completion_error& e) {
        again->echo_failed(e); // named by its connection
    } catch (const std::exception& e) {
        again->fail(std::string("echo send failed: ") + e.what());
    }
}

// One buffer of the device's shared pool. Its receive may be taken by any connection's
// QP (the completion names it); the message is echoed from the buffer on that connection, then
// the buffer is posted again. Ends when the shared queue goes (its receive is flushed with no QP
// named), at the server's end.
task<void> shared_echo_loop(device_resources& device, std::uint32_t slot, std::uint32_t size) {
    // Lives until the server's end, after every shared loop (retire_shared_receives drops only
    // the queue; the flushes of its last receives may name QPs: by_qp must still be there).
    shared_receives& shared = *device.shared;
    for (;;) {
        // retire() dropped the queue (the server's end) while a late completion was read.
        if (!shared.queue) co_return;
        ibv_wc received{};
        try {
            received = co_await shared.queue->recv(pool_slot(shared, slot, size, size));
        } catch (const completion_error& e) {
            if (e.qp_num() == 0) co_return; // the shared queue went: the server's end
            if (connection* c = connection_of(shared, e.qp_num()))
                c->fail(c->receive_failure(e.status()));
            continue; // that connection's flush, or its oversized message: the buffer goes on
        } catch (const std::system_error& e) {
            const bool gone = e.code() == std::errc::no_such_device;
            if (!gone || !shared.device_gone)
                std::fprintf(stderr, "echo_server: %s\n", e.what()); // ibv_post_srq_recv
            shared.device_gone = shared.device_gone || gone;
            co_return;
        }
        connection* c = connection_of(shared, received.qp_num);
        if (c == nullptr || c->closing()) continue; // its connection is gone or going: dropped
        c->received();
        co_await echo_on(shared, c, received.qp_num,
                         pool_slot(shared, slot, size, received.byte_len));
    }
}

} // namespace

// A worker's life until the server's end: it keeps the worker's io_context running until the
// stop, then waits until every connection handed to the worker is gone (their QPs too) and no
// shared loop is inside a send, and drops each shared receive queue; its last owner (the last
// QP state, once its flushes came) flushes the receives still posted, which ends the shared
// loops, and io_context::run() returns. The rest of the shared receives goes with the worker.
task<void> retire(worker& owner) {
    try {
        for (;;)
            co_await sleep_for(*owner.io, std::chrono::hours(1), owner.server.stopping.get_token());
    } catch (const std::system_error&) {
        // the stop: SIGINT, SIGTERM, or the accept loop failing
    }
    const auto busy = [&] {
        if (owner.open > 0) return true;
        for (auto& [native, device] : owner.devices)
            if (device->shared && device->shared->sending > 0) return true;
        return false;
    };
    while (busy())
        co_await sleep_for(*owner.io, std::chrono::milliseconds(10));
    for (auto& [native, device] : owner.devices)
        if (device->shared) device->shared->queue.reset();
}

// The worker's PD, completion channel and shared receives for `context`, made at its first
// connection on that device (on the worker's thread). Throws what a verb threw (e.g. ibv_reg_mr
// ENOMEM under RLIMIT_MEMLOCK), having kept nothing: the next connection tries again.
device_resources& resources_for(worker& owner, verbs::context context) {
    if (auto found = owner.devices.find(context.native()); found != owner.devices.end())
        return *found->second;
    const server_options& options = owner.server.options;
    ibv_context* const native = context.native();
    auto resources =
        std::make_unique<device_resources>(*owner.io, std::move(context), options.mode);
    std::uint32_t depth = 0;
    if (options.srq) {
        // This thread's share of the buffers; every connection's sends (--depth each) and
        // the shared receives on one CQ, within what the device allows.
        depth = std::max<std::uint32_t>(options.srq_depth / options.threads, 1);
        ibv_device_attr attr{};
        const int max_cqe =
            ibv_query_device(resources->context.native(), &attr) == 0 ? attr.max_cqe : 4096;
        const std::uint64_t want =
            std::uint64_t{depth} +
            std::uint64_t{options.depth} * std::max<std::uint32_t>(options.max_connections, 64);
        const int entries = static_cast<int>(std::min<std::uint64_t>(want, max_cqe));
        resources->shared =
            std::make_unique<shared_receives>(*owner.io, resources->completion_channel,
                                              resources->pd, entries, depth, options.max_size);
    }
    // Kept only whole: kept without its shared receives, it would serve as --no-srq.
    device_resources& made = *owner.devices.emplace(native, std::move(resources)).first->second;
    for (std::uint32_t slot = 0; slot < depth; ++slot)
        owner.io->spawn(shared_echo_loop(made, slot, options.max_size));
    return made;
}

// The main thread logs each device's asynchronous events (one watch per device: the threads'
// QPs are all on librdmacm's one context of it).
void watch_device(echo_server& server, const verbs::context& device) {
    auto& watch = server.device_watches[device.native()];
    if (!watch) {
        watch = std::make_unique<device_events>(server.io, device);
        server.io.spawn(log_device_events(server, *watch, std::string(device.name())));
    }
}

} // namespace echo
