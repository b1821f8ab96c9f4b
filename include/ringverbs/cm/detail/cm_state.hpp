// The runtime's state behind cm_channel and cm_id. Shared ownership runs one way:
// (a qp made on an id) -> cm_id_state -> cm_channel_state, so that rdma_destroy_qp comes before
// rdma_destroy_id, and every id is destroyed before its event channel, whatever order the user
// drops the handles in.
#pragma once

#include <ringverbs/config.hpp>

#include <ringverbs/engine/detail/fd_watch.hpp>

#include <ringverbs/engine/detail/operation.hpp>
#include <ringverbs/engine/detail/waiter.hpp>
#include <ringverbs/engine/io_context.hpp>

#include <rdma/rdma_cma.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

namespace ringverbs::detail {

struct cm_channel_state;

// IB CM reject reason 28, "consumer reject" (IBTA 12.6.7.2): the peer application's rdma_reject.
inline constexpr int ib_cm_consumer_reject = 28;
// IB CM reject reason 8, "invalid service id": nothing listens on that port.
inline constexpr int ib_cm_invalid_service_id = 8;

// What a waiter needs of one rdma_cm event, copied out so that the event is acked at once
// (rdma_destroy_id blocks until every event of its id has been acked).
struct cm_event_data {
    rdma_cm_event_type type = RDMA_CM_EVENT_ADDR_ERROR;
    // 0, a negative errno (ADDR_ERROR, ROUTE_ERROR, UNREACHABLE, CONNECT_ERROR), or for
    // REJECTED the transport's reject reason (IB CM: 28 is a consumer's rdma_reject).
    int status = 0;
    std::vector<std::byte> private_data;
    // iWARP: rdma_connect itself failed with ECONNREFUSED (type REJECTED): the TCP connection
    // was refused, nothing listens at that address and port.
    bool nothing_listens = false;
};

struct cm_id_state;
struct blocking_connect;

// The waiter of a step (resolve, connect, accept_connection): the channel hands it the step's
// outcome with fulfil(0), so that the awaiter never reads the id after resuming (a coroutine
// resumed before it in the same turn may have destroyed the id).
struct cm_step_waiter : waiter {
    std::optional<cm_event_data> result;
};

// The waiter of cm_id::accept(): the channel hands it the new id's state before fulfil(0).
struct cm_accept_waiter : waiter {
    std::shared_ptr<cm_id_state> taken;
};

struct cm_channel_state {
    io_context* ctx;
    std::shared_ptr<rdma_event_channel> channel;
    fd_watch* watch = nullptr;     // the multishot poll on the event channel's fd
    std::vector<cm_id_state*> ids; // live ids (raw: each removes itself), to fail on poll error
    std::uint64_t ids_changes = 0; // bumped by list() and unlist(): fail()'s walk re-validates
    std::uint64_t events = 0;      // rdma_cm events read
    int error = 0;                 // a failure of the fd poll or of rdma_get_cm_event: dead
    // cm_channel_options::step_timeout: the bound of a step awaited without a timeout.
    std::chrono::nanoseconds step_timeout = std::chrono::seconds(15);

    explicit cm_channel_state(io_context& c);
    ~cm_channel_state();
    cm_channel_state(const cm_channel_state&) = delete;
    cm_channel_state& operator=(const cm_channel_state&) = delete;

    // Reads every pending event (until EAGAIN), routes and acks each.
    void drain() noexcept;
    void dispatch(const rdma_cm_event& ev) noexcept;
    // The channel is dead: fails every id on it once (each fail_all may run a user's handler,
    // which may make and destroy ids of this channel meanwhile).
    void fail(int err) noexcept;
    // Adds `s` to / removes it from `ids` (push_back may throw std::bad_alloc).
    void list(cm_id_state* s);
    void unlist(cm_id_state* s) noexcept;
};

// One rdma_cm_id and what its awaits wait for. id->context points here.
struct cm_id_state {
    // A connection request that no accept() has taken yet.
    struct request {
        std::shared_ptr<cm_id_state> id;
    };

    std::shared_ptr<cm_channel_state> channel;
    rdma_cm_id* id = nullptr;
    // The one step in progress (resolve, connect, accept_connection): its waiter
    // (a cm_step_waiter, which receives the outcome).
    waiter_queue step_waiters;
    // Listener: requests not yet accepted, and the accept() calls waiting for one.
    std::deque<request> backlog;
    waiter_queue accept_waiters;
    // Listener: when set (cm_id::on_request), every request goes here instead of the backlog,
    // and a failure of the id (error != 0 with a null state) once.
    std::function<void(std::shared_ptr<cm_id_state>, int)> on_request;
    // disconnect() / disconnected() waiters; `disconnected` is sticky.
    waiter_queue disconnect_waiters;
    bool disconnected = false;
    bool disconnect_sent = false; // rdma_disconnect was called (by us, or answering the peer)
    bool connected = false;
    // An incoming request not yet answered: it is rejected if the id goes unanswered.
    bool unanswered = false;
    // RDMA_CM_EVENT_DEVICE_REMOVAL came: once the id is destroyed, librdmacm is made to forget
    // the device (forget_removed_devices in cm_channel.cpp), so that the removal can complete.
    bool device_removed = false;
    std::vector<std::byte> request_data; // private data of the connection request
    // ENODEV after DEVICE_REMOVAL, or the channel's error (from the start for an id made on a
    // channel that failed already: no event of it would be read).
    int error = 0;
    bool closed = false; // the user's handle is gone
    // iWARP: the rdma_connect running on a thread of its own (src/cm/blocking_connect.hpp),
    // until the state goes; while it runs, nothing here may call into librdmacm for this id.
    std::shared_ptr<blocking_connect> connecting;
    bool listed = true; // in channel->ids (not while migrating to another channel)

    // Takes ownership of `raw` (rdma_destroy_id when the last share goes), sets its context
    // and joins the channel's ids. Throws std::bad_alloc, leaving `raw` to the caller.
    cm_id_state(std::shared_ptr<cm_channel_state> ch, rdma_cm_id* raw);
    ~cm_id_state();
    cm_id_state(const cm_id_state&) = delete;
    cm_id_state& operator=(const cm_id_state&) = delete;

    // Ends every wait with `err`, then tells the request handler, if any, last: it may
    // destroy this id (and this state), so nothing here touches the state after it.
    void fail_all(int err) noexcept;
};

// The qp made on `id` (cm_id::make_qp), if any: its connection ended (its flushes from now on
// end their awaits with connection_reset) / rdma_disconnect moved it to the error state (its
// flushes are bounded, as after qp::to_error()).
void mark_connection_closed(rdma_cm_id* id) noexcept;
void watch_qp_flush(rdma_cm_id* id) noexcept;

} // namespace ringverbs::detail
