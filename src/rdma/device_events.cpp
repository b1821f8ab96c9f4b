#include <ringverbs/engine/diagnostics.hpp>
#include <ringverbs/rdma/device_events.hpp>

#include <ringverbs/rdma/detail/device_loss.hpp>
#include <ringverbs/rdma/detail/object_registry.hpp>
#include <ringverbs/rdma/detail/rdma_state.hpp>
#include <ringverbs/rdma/detail/srq_state.hpp>

#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <vector>

namespace ringverbs {

namespace {

// The contexts watched by a device_events: two readers of one async fd would steal each
// other's events. Numbered like the object registry's entries, so that a device loss told to
// another thread finds the watcher it meant or none.
struct watcher {
    ibv_context* device;
    void* state; // a device_events::state
    io_context* ctx;
    std::uint64_t generation;
};
std::mutex watched_lock;
std::vector<watcher> watched;
std::uint64_t watch_generations = 0;

bool is_watched(ibv_context* dev) {
    return std::any_of(watched.begin(), watched.end(),
                       [&](const watcher& w) { return w.device == dev; });
}
void unwatch(ibv_context* dev) {
    std::erase_if(watched, [&](const watcher& w) { return w.device == dev; });
}

} // namespace

namespace detail {

std::size_t device_events_lost(ibv_context* device, const char* cause) noexcept {
    std::lock_guard g(watched_lock);
    std::size_t told = 0;
    for (const watcher& w : watched) {
        if (std::strcmp(w.device->device->name, device->device->name) != 0) continue;
        try {
            w.ctx->post([generation = w.generation, cause] {
                std::lock_guard again(watched_lock);
                for (const watcher& x : watched)
                    if (x.generation == generation)
                        static_cast<device_events::state*>(x.state)->lost(cause);
            });
            ++told;
        } catch (...) {
            diagnose("device_lost: a device_events was not told that its device is gone (out "
                     "of memory)");
        }
    }
    return told;
}

} // namespace detail

device_events::device_events(io_context& ctx, const verbs::context& device)
    : state_(std::make_unique<state>()) {
    state_->ctx = &ctx;
    state_->device = device.handle();
    ibv_context* dev = device.native();
    {
        std::lock_guard g(watched_lock);
        if (is_watched(dev))
            throw_system_error(
                EBUSY, "device_events (this ibv_context's async events are already watched)");
        watched.push_back({dev, state_.get(), &ctx, ++watch_generations});
    }
    try {
        const int fl = ::fcntl(dev->async_fd, F_GETFL);
        if (fl < 0 || ::fcntl(dev->async_fd, F_SETFL, fl | O_NONBLOCK) < 0)
            throw_system_error(errno, "fcntl(async_fd, O_NONBLOCK)");
        state_->watch = detail::fd_watch::start(
            ctx, dev->async_fd, state_->device, state_.get(),
            [](void* self, unsigned) noexcept {
                auto* s = static_cast<state*>(self);
                ++s->counters.wakeups;
                s->drain();
            },
            [](void* self, int err) noexcept { static_cast<state*>(self)->fail(err); });
    } catch (...) {
        std::lock_guard g(watched_lock);
        unwatch(dev);
        throw;
    }
}

device_events::~device_events() {
    state_->closed = true;
    while (detail::waiter* w = state_->waiters.pop_front())
        w->fulfil(ECANCELED);
    if (state_->watch) state_->watch->release(); // orphaned: it keeps the context open
    std::lock_guard g(watched_lock);
    unwatch(state_->device.get());
}

void device_events::state::fail(int err) noexcept {
    error = err;
    detail::diagnose("async event fd: %s", std::system_category().message(err).c_str());
    while (detail::waiter* w = waiters.pop_front())
        w->fulfil(err);
    // A device disassociated from its users (removed under a provider that supports it)
    // fails their fds with EIO: the device is gone for every object on it.
    if (err == EIO || err == ENODEV) detail::device_lost(device.get(), "the async event fd failed");
}

void device_events::state::lost(const char* cause) noexcept {
    if (error != 0) return;
    error = ENODEV;
    lost_cause = cause;
    while (detail::waiter* w = waiters.pop_front())
        w->fulfil(ENODEV);
}

namespace {

// Copies what the event names, before it is acked.
async_event copy_event(const ibv_async_event& ev) noexcept {
    async_event e;
    e.type = ev.event_type;
    switch (ev.event_type) {
    case IBV_EVENT_CQ_ERR:
        e.cq = ev.element.cq;
        break;
    case IBV_EVENT_QP_FATAL:
    case IBV_EVENT_QP_REQ_ERR:
    case IBV_EVENT_QP_ACCESS_ERR:
    case IBV_EVENT_COMM_EST:
    case IBV_EVENT_SQ_DRAINED:
    case IBV_EVENT_PATH_MIG:
    case IBV_EVENT_PATH_MIG_ERR:
    case IBV_EVENT_QP_LAST_WQE_REACHED:
        e.qp = ev.element.qp;
        e.qp_num = ev.element.qp->qp_num; // alive: its destroy waits for our ack
        break;
    case IBV_EVENT_SRQ_ERR:
    case IBV_EVENT_SRQ_LIMIT_REACHED:
        e.srq = ev.element.srq;
        break;
    case IBV_EVENT_PORT_ACTIVE:
    case IBV_EVENT_PORT_ERR:
    case IBV_EVENT_LID_CHANGE:
    case IBV_EVENT_PKEY_CHANGE:
    case IBV_EVENT_SM_CHANGE:
    case IBV_EVENT_CLIENT_REREGISTER:
    case IBV_EVENT_GID_CHANGE:
        e.port = ev.element.port_num;
        break;
    default:
        break;
    }
    return e;
}

} // namespace

// Reads until EAGAIN; each event is copied, routed and acked before the next is read.
void device_events::state::drain() noexcept {
    if (error != 0) return;
    for (;;) {
        ibv_async_event ev{};
        if (ibv_get_async_event(device.get(), &ev) != 0) {
            const int err = errno;
            if (err == EAGAIN || err == EWOULDBLOCK) return;
            if (err == EINTR) continue;
            fail(err != 0 ? err : EIO);
            return;
        }
        ++counters.events;
        async_event e = copy_event(ev);
        route(e);
        ibv_ack_async_event(&ev);
        if (e.routed) ++counters.routed;
        hand_to_next(e);
        if (e.type == IBV_EVENT_DEVICE_FATAL) {
            // Every object on the device is told, this watcher too (after this event: it
            // stays queued for next()); nothing more will be read.
            detail::device_lost(device.get(), "IBV_EVENT_DEVICE_FATAL");
            return;
        }
    }
}

// The first next() waiter takes `e`, or it is queued for a later next().
void device_events::state::hand_to_next(const async_event& e) noexcept {
    if (detail::waiter* w = waiters.pop_front()) {
        auto* a = static_cast<next_awaitable*>(w);
        a->event = e;
        a->has = true;
        w->fulfil(0);
    } else {
        try {
            queue.push_back(e);
        } catch (...) {
            // Out of memory: the event was routed and acked; next() misses it.
        }
    }
}

namespace {

// What each routed event does to the object it names, on the object's own thread.
void apply_cq_error(detail::cq_state& c) noexcept {
    c.error = EOVERFLOW;
    c.fail_waiters(EOVERFLOW);
    for (detail::qp_state* q : c.qps)
        q->to_error();
}
void apply_srq_event(detail::srq_state& s, ibv_event_type type) noexcept {
    if (type == IBV_EVENT_SRQ_LIMIT_REACHED)
        s.limit_reached();
    else
        s.failed();
}

} // namespace

// An object of this io_context is acted on here and now. Another thread's is handed to its
// io_context by post() (under the registry's lock, so that context still lives: its objects
// are destroyed before it); there the object is looked up again, by address and registration
// number, because it may have been destroyed, and its address reused, in the meantime.
template <typename Object, typename State, typename Apply>
bool device_events::state::deliver(Object* object, State& s, io_context& owner,
                                   std::uint64_t generation, Apply apply) noexcept {
    if (&owner == ctx) {
        apply(s);
        return true;
    }
    try {
        owner.post([object, generation, apply] {
            detail::with_object_of(object, generation, [&](State& here) { apply(here); });
        });
    } catch (...) {
        detail::diagnose("device_events: an event for another thread's object was lost (out of "
                         "memory)");
        return false;
    }
    ++counters.routed_to_other_threads;
    return true;
}

void device_events::state::route(async_event& e) noexcept {
    if (e.cq) {
        detail::with_object(e.cq, [&](detail::cq_state& c, std::uint64_t generation) {
            e.routed = deliver(e.cq, c, *c.channel->ctx, generation, apply_cq_error);
        });
    } else if (e.srq) {
        detail::with_object(e.srq, [&](detail::srq_state& s, std::uint64_t generation) {
            e.routed = deliver(e.srq, s, *s.ctx, generation,
                               [type = e.type](detail::srq_state& x) { apply_srq_event(x, type); });
        });
    } else if (e.qp && (e.type == IBV_EVENT_QP_FATAL || e.type == IBV_EVENT_QP_REQ_ERR ||
                        e.type == IBV_EVENT_QP_ACCESS_ERR)) {
        detail::with_object(e.qp, [&](detail::qp_state& q, std::uint64_t generation) {
            e.routed = deliver(e.qp, q, *q.send_cq->channel->ctx, generation,
                               [](detail::qp_state& x) { x.to_error(); });
        });
    }
}

} // namespace ringverbs
