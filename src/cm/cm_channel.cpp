// The rdma_cm event channel behind cm_channel and cm_id (detail::cm_channel_state): its fd
// watched on the loop, the drain that acks every event at once, the dispatch of each event to
// its id's step or watcher, and an id's state from creation to its end. cm_id.cpp holds the
// id's steps, migration and accepting; blocking_connect.hpp iWARP's connect thread.
#include <ringverbs/cm/cm_id.hpp>
#include <ringverbs/cm/detail/cm_hooks.hpp>
#include <ringverbs/engine/diagnostics.hpp>
#include <ringverbs/rdma/detail/device_loss.hpp>
#include <ringverbs/rdma/detail/object_registry.hpp>
#include <ringverbs/rdma/srq.hpp>
#include <ringverbs/verbs/detail/mmap_keys.hpp>

#include <arpa/inet.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <mutex>
#include <new>
#include <thread>
#include <utility>

#include "blocking_connect.hpp"

namespace ringverbs {

namespace {

std::vector<std::byte> copy_private_data(const rdma_cm_event& ev) {
    const auto* p = static_cast<const std::byte*>(ev.param.conn.private_data);
    if (p == nullptr) return {};
    return std::vector<std::byte>(p, p + ev.param.conn.private_data_len);
}

} // namespace

namespace detail {

cm_hooks& rdma_cm_hooks() noexcept {
    static cm_hooks table{
        +[](rdma_cm_id* id, rdma_conn_param* param) noexcept { return rdma_connect(id, param); },
        +[](rdma_cm_id* id, ibv_pd* pd, ibv_qp_init_attr* init) noexcept {
            return rdma_create_qp(id, pd, init);
        },
        true};
    return table;
}

cm_channel_state::cm_channel_state(io_context& c) : ctx(&c) {
    errno = 0;
    rdma_event_channel* raw = rdma_create_event_channel();
    if (raw == nullptr)
        throw_system_error(errno != 0 ? errno : ENODEV, "rdma_create_event_channel");
    channel = std::shared_ptr<rdma_event_channel>(raw, rdma_destroy_event_channel);
    const int fl = ::fcntl(raw->fd, F_GETFL);
    if (fl < 0 || ::fcntl(raw->fd, F_SETFL, fl | O_NONBLOCK) < 0 ||
        ::fcntl(raw->fd, F_SETFD, FD_CLOEXEC) < 0)
        throw_system_error(errno, "fcntl(rdma_cm event channel)");
    watch = fd_watch::start(
        *ctx, channel->fd, channel, this,
        [](void* self, unsigned) noexcept {
            auto* ch = static_cast<cm_channel_state*>(self);
            if (ch->error == 0) ch->drain();
        },
        [](void* self, int err) noexcept { static_cast<cm_channel_state*>(self)->fail(err); });
}

cm_channel_state::~cm_channel_state() {
    if (watch) watch->release();
}

void cm_channel_state::fail(int err) noexcept {
    error = err;
    diagnose("rdma_cm event channel fd %d: %s", channel->fd,
             std::system_category().message(err).c_str());
    // fail_all runs a listener's request handler, which may make and destroy ids of this
    // channel (growing `ids`, or freeing the state just failed): walk by index, from the start
    // again whenever the list changed, over the ids not failed yet. fail_all sets an id's
    // error and an id made from now on has the channel's, so each fails once and the walk
    // ends.
    std::size_t i = 0;
    while (i < ids.size()) {
        cm_id_state* s = ids[i];
        if (s->error != 0) {
            ++i;
            continue;
        }
        const std::uint64_t before = ids_changes;
        s->fail_all(err); // may destroy *s
        i = ids_changes == before ? i + 1 : 0;
    }
}

void cm_channel_state::list(cm_id_state* s) {
    ids.push_back(s);
    ++ids_changes;
}

void cm_channel_state::unlist(cm_id_state* s) noexcept {
    std::erase(ids, s);
    ++ids_changes;
}

// Every event is acked right after it was copied: rdma_destroy_id blocks until the events of
// its id are acked, and an id may be destroyed by the coroutine this event resumes. Nothing
// here resumes a coroutine inline (waiters are queued on the context), so no id goes away
// while the loop runs.
void cm_channel_state::drain() noexcept {
    for (;;) {
        rdma_cm_event* ev = nullptr;
        errno = 0;
        if (rdma_get_cm_event(channel.get(), &ev) != 0) {
            const int err = errno;
            if (err == EAGAIN || err == EWOULDBLOCK) return;
            if (err == EINTR) continue;
            fail(err != 0 ? err : EIO);
            return;
        }
        ++events;
        rdma_cm_id* refuse = nullptr;
        std::shared_ptr<cm_id_state> hold; // an id made here is only dropped after the ack
        if (ev->event == RDMA_CM_EVENT_CONNECT_REQUEST) {
            auto* listener = static_cast<cm_id_state*>(ev->listen_id->context);
            try {
                if (listener == nullptr || listener->closed) throw std::bad_alloc();
                std::vector<std::byte> data = copy_private_data(*ev);
                hold = std::make_shared<cm_id_state>(listener->channel, ev->id);
                hold->unanswered = true;
                hold->request_data = std::move(data);
                if (listener->on_request) {
                    // Takes its share of the state; spawns, never resumes anything inline.
                    // A copy: the handler may destroy its listening id (and with it
                    // the stored function) while it runs.
                    const auto handler = listener->on_request;
                    handler(hold, 0);
                } else if (waiter* w = listener->accept_waiters.pop_front()) {
                    static_cast<cm_accept_waiter*>(w)->taken = hold;
                    w->fulfil(0);
                } else {
                    listener->backlog.push_back({hold});
                }
            } catch (...) {
                // Out of memory, or no listener handle: refuse the request (a state that was
                // made rejects and destroys its id itself, when `hold` goes after the ack).
                if (!hold) refuse = ev->id;
            }
        } else {
            dispatch(*ev);
        }
        rdma_ack_cm_event(ev);
        hold.reset();
        if (refuse) {
            rdma_reject(refuse, nullptr, 0);
            rdma_destroy_id(refuse);
        }
    }
}

namespace {

// The outcome of the step `s` has in flight (resolve, connect, accept_connection) goes to its
// waiter.
void deliver_step_outcome(cm_id_state& s, const rdma_cm_event& ev) noexcept {
    cm_event_data d;
    d.type = ev.event;
    d.status = ev.status;
    try {
        d.private_data = copy_private_data(ev);
    } catch (...) {
        // Out of memory: the outcome still counts, without its private data.
    }
    // Nobody waits (the step's wait timed out or was stopped): the outcome goes unheard.
    if (waiter* w = s.step_waiters.pop_front()) {
        static_cast<cm_step_waiter*>(w)->result = std::move(d);
        w->fulfil(0);
    }
}

} // namespace

// The qp made on this id (cm_id::make_qp) learns that its connection ended, before the flushes
// of its requests are polled: those awaits end with connection_reset, not a bare flush.
void mark_connection_closed(rdma_cm_id* id) noexcept {
    if (id->qp == nullptr) return;
    with_object(id->qp, [](qp_state& q) { q.connection_ended(); });
}

// rdma_disconnect has moved the id's QP to the error state: its flushes are bounded as after
// qp::to_error() (the flush timer), so that a device that loses some (Linux 6.1's rxe) cannot
// leave an await of the qp waiting for ever.
void watch_qp_flush(rdma_cm_id* id) noexcept {
    if (id->qp == nullptr) return;
    with_object(id->qp, [](qp_state& q) { q.moved_to_error_by_disconnect(); });
}

namespace {

// DISCONNECTED is sticky: it resumes disconnect() / disconnected() and ends a step in flight.
void deliver_disconnected(cm_id_state& s, const rdma_cm_event& ev) noexcept {
    mark_connection_closed(ev.id);
    // The peer's DREQ (or the answer to ours). Unless we disconnected first, answer it:
    // rdma_disconnect moves our QP to the error state, so every request still posted on
    // it completes (flushed) and no awaiter of it is left hanging, and sends the DREP.
    if (!s.disconnect_sent && ev.id->qp != nullptr) {
        s.disconnect_sent = true;
        rdma_disconnect(ev.id); // best effort: the connection is gone either way
    }
    watch_qp_flush(ev.id);
    s.disconnected = true;
    s.connected = false;
    while (waiter* w = s.disconnect_waiters.pop_front())
        w->fulfil(0);
    if (waiter* w = s.step_waiters.pop_front()) {
        static_cast<cm_step_waiter*>(w)->result = cm_event_data{RDMA_CM_EVENT_DISCONNECTED, 0, {}};
        w->fulfil(0);
    }
}

} // namespace

void cm_channel_state::dispatch(const rdma_cm_event& ev) noexcept {
    auto* s = static_cast<cm_id_state*>(ev.id->context);
    if (s == nullptr) return;
    switch (ev.event) {
    case RDMA_CM_EVENT_ESTABLISHED:
        s->connected = true;
        [[fallthrough]];
    case RDMA_CM_EVENT_ADDR_RESOLVED:
    case RDMA_CM_EVENT_ADDR_ERROR:
    case RDMA_CM_EVENT_ROUTE_RESOLVED:
    case RDMA_CM_EVENT_ROUTE_ERROR:
    case RDMA_CM_EVENT_CONNECT_RESPONSE:
    case RDMA_CM_EVENT_CONNECT_ERROR:
    case RDMA_CM_EVENT_UNREACHABLE:
    case RDMA_CM_EVENT_REJECTED:
        deliver_step_outcome(*s, ev);
        break;
    case RDMA_CM_EVENT_DISCONNECTED:
        deliver_disconnected(*s, ev);
        break;
    case RDMA_CM_EVENT_DEVICE_REMOVAL:
        // Every cq, qp, srq and device_events on the device ends its awaits too: the kernel
        // waits for this process to close the device, and nothing else tells it.
        detail::device_lost(ev.id->verbs, "RDMA_CM_EVENT_DEVICE_REMOVAL");
        s->device_removed = true;
        s->fail_all(ENODEV);
        break;
    default: // TIMEWAIT_EXIT, ADDR_CHANGE, multicast: nothing waits for them
        break;
    }
}

cm_id_state::cm_id_state(std::shared_ptr<cm_channel_state> ch, rdma_cm_id* raw)
    : channel(std::move(ch)), id(raw), error(channel->error) {
    channel->list(this);
    id->context = this;
}

namespace {

// librdmacm keeps each device it opened (an ibv_context and a PD) until it reads its device
// list again and finds the device missing; a device's removal waits for that context to close,
// like every other. Reading the list now makes librdmacm forget a removed device: at once when
// no id uses it any more, else when the last one goes.
void forget_removed_devices() noexcept {
    verbs::detail::forget_missing_devices(); // first: librdmacm is about to close contexts
    if (ibv_context** list = rdma_get_devices(nullptr)) rdma_free_devices(list);
}

} // namespace

cm_id_state::~cm_id_state() {
    backlog.clear();
    if (unanswered) rdma_reject(id, nullptr, 0);
    if (connecting && connecting->abandon()) {
        id->context = nullptr; // its late events find no state
    } else {
        rdma_destroy_id(id);
        if (device_removed) forget_removed_devices();
    }
    if (listed) channel->unlist(this);
}

void cm_id_state::fail_all(int err) noexcept {
    error = err;
    while (waiter* w = step_waiters.pop_front())
        w->fulfil(err);
    while (waiter* w = accept_waiters.pop_front())
        w->fulfil(err);
    while (waiter* w = disconnect_waiters.pop_front())
        w->fulfil(err);
    // Last, and from a local: the handler may destroy this id, and this state with it.
    if (const auto handler = std::exchange(on_request, nullptr)) {
        try {
            handler(nullptr, err);
        } catch (...) {
            // The handler's own failure: nothing more to tell it.
        }
    }
}

} // namespace detail

cm_channel::cm_channel(io_context& ctx, cm_channel_options options)
    : state_(std::make_shared<detail::cm_channel_state>(ctx)) {
    state_->step_timeout = options.step_timeout;
}

cm_channel::~cm_channel() = default;

} // namespace ringverbs
