// echo_server: answering requests: --device, --max-connections, and to which thread each goes.
#include "server.hpp"

namespace echo {

namespace {

// A request admitted to `owner` that it cannot serve: its resources for the device could not
// be made (resources_for). Rejected with the reason, which the client prints, and logged; it is
// no longer counted. The server goes on: a later request may find the resources it needs.
void refuse(worker& owner, cm_id& request, const std::string& failure) {
    const std::string why = "server error: " + failure;
    const std::string thread = owner.server.options.threads > 1
                                   ? " (thread " + std::to_string(owner.index) + ")"
                                   : std::string();
    std::printf("echo_server: request from %s rejected (%s)%s\n",
                echo::text_of(rdma_get_peer_addr(request.native())).c_str(), why.c_str(),
                thread.c_str());
    std::fflush(stdout);
    try {
        request.reject(echo::reject_data(why));
    } catch (const std::exception& e) {
        std::fprintf(stderr, "echo_server: %s\n", e.what()); // the request goes anyway
    }
    --owner.server.open;
    --owner.open;
}

// On the worker's thread: adopts the ids the accept loop migrated to it and serves them.
void adopt_handed_over(worker& owner) {
    std::vector<worker::handoff> taken;
    {
        std::lock_guard lock(owner.inbox_lock);
        taken.swap(owner.inbox);
    }
    for (worker::handoff& h : taken) {
        std::optional<cm_id> id;
        try {
            id.emplace(*owner.cm, std::move(h.id));
        } catch (const std::exception& e) {
            std::fprintf(stderr, "echo_server: connection %d: %s\n", h.number, e.what());
            --owner.server.open;
            --owner.open;
            continue;
        }
        try {
            device_resources& device = resources_for(owner, id->device());
            owner.io->spawn(serve(owner, device, std::move(*id), h.number));
        } catch (const std::exception& e) {
            refuse(owner, *id, e.what());
        }
    }
}

// Admits a request: serves it on the thread with the fewest connections; on another thread
// than this one, the id migrates to that thread's rdma_cm channel first.
void admit(echo_server& server, cm_id request, verbs::context device, int number) {
    worker* least = server.workers.front().get();
    for (auto& w : server.workers)
        if (w->open < least->open) least = w.get();
    ++server.open;
    ++least->open;
    if (least->index == 0) {
        try {
            device_resources& resources = resources_for(*least, std::move(device));
            server.io.spawn(serve(*least, resources, std::move(request), number));
        } catch (const std::exception& e) {
            refuse(*least, request, e.what());
        }
        return;
    }
    try {
        worker::handoff h{std::move(request).migrate(*least->cm), number};
        {
            std::lock_guard lock(least->inbox_lock);
            least->inbox.push_back(std::move(h));
        }
        least->io->post([least] { adopt_handed_over(*least); });
    } catch (const std::exception& e) {
        std::fprintf(stderr, "echo_server: connection %d not handed to thread %d: %s\n", number,
                     least->index, e.what());
        --server.open;
        --least->open;
    }
}

// Answers one request, without suspending: rejected when it came on another device than
// --device, or when --max-connections are open; else admitted as connection `number`. Returns
// whether it was admitted.
bool answer(echo_server& server, cm_id request, int number) {
    const std::uint32_t limit = server.options.max_connections;
    verbs::context device = request.device();
    if (!server.options.device.empty() && device.name() != server.options.device) {
        request.reject(echo::reject_data("not served on device " + std::string(device.name())));
        return false;
    }
    if (limit != 0 && server.open.load() >= static_cast<int>(limit)) {
        const std::string why =
            "busy: " + std::to_string(limit) + " connections, the server's limit";
        ++server.rejected;
        std::printf("echo_server: request from %s rejected (%s; --max-connections %u)\n",
                    echo::text_of(rdma_get_peer_addr(request.native())).c_str(), why.c_str(),
                    limit);
        std::fflush(stdout);
        try {
            request.reject(echo::reject_data(why));
        } catch (const std::exception& e) {
            std::fprintf(stderr, "echo_server: %s\n", e.what()); // the request goes anyway
        }
        return false;
    }
    watch_device(server, device);
    admit(server, std::move(request), std::move(device), number);
    return true;
}

} // namespace

// The accept backlog stays bounded. The kernel holds at most the listen backlog (128, given to
// rdma_listen) of requests that this process has not read yet, and refuses the rest. The
// runtime's cm channel reads every pending event at once into the listener's queue, from
// which this loop takes each request at its next turn: the loop awaits nothing but accept()
// (reject, resources_for and spawn do not suspend), so that queue holds at most one read's
// worth. A request is answered at once: admitted (its connection is spawned, and counted in
// server.open until its resources are released), or rejected when --max-connections are open.
// The request goes to the thread serving the fewest connections (admit), which rejects it with
// the reason if it cannot make its resources for the device (refuse).
// Nothing waits in a queue of ours for a connection to close.
task<void> accept_loop(echo_server& server, cm_id& listener) {
    for (int number = 1;;) {
        std::optional<cm_id> request;
        try {
            request.emplace(co_await listener.accept(wait_options(server.stopping.get_token())));
        } catch (const std::system_error& e) {
            if (e.code() != std::errc::operation_canceled) {
                // The listener failed (ENODEV: its device went away): the server stops, and
                // exits non-zero.
                std::fprintf(stderr, "echo_server: %s%s\n", e.what(),
                             e.code() == std::errc::no_such_device ? " (the RDMA device went away)"
                                                                   : "");
                server.failed = true;
                server.stopping.request_stop();
            }
            co_return;
        }
        // The stop won the race with this accept: nothing more is admitted (a worker may
        // have ended already). Dropping the request rejects it.
        if (server.stopping.stop_requested()) co_return;
        // A failure here is this request's alone (dropped, it is rejected): the loop goes on.
        const std::string peer = echo::text_of(rdma_get_peer_addr(request->native()));
        try {
            if (answer(server, std::move(*request), number)) ++number;
        } catch (const std::exception& e) {
            std::fprintf(stderr, "echo_server: request from %s dropped: %s\n", peer.c_str(),
                         e.what());
        }
    }
}

} // namespace echo
