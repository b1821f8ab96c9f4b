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

namespace ringverbs {

namespace {

// rdma_* calls return -1 and set errno; an unset errno must not become "Success".
void cm_check(int ret, const char* what) {
    if (ret != 0) [[unlikely]]
        throw_system_error(errno != 0 ? errno : EIO, what);
}

// IB CM reject reasons (IBTA 12.6.7.2), which rdma_cm reports in REJECTED's status on IB and
// RoCE. This librdmacm has no rdma_reject_msg().
const char* reject_reason_text(int reason) noexcept {
    switch (reason) {
    case 1:
        return "no QP available";
    case 2:
        return "no EEC available";
    case 3:
        return "no resources";
    case 4:
        return "timeout";
    case 5:
        return "unsupported request";
    case 6:
        return "invalid communication id";
    case 7:
        return "invalid communication instance";
    case 8:
        return "invalid service id: nothing listens on that port";
    case 9:
        return "invalid transport type";
    case 10:
        return "stale connection";
    case 11:
        return "RDC does not exist";
    case 12:
        return "invalid GID";
    case 13:
        return "invalid LID";
    case 14:
        return "invalid SL";
    case 15:
        return "invalid traffic class";
    case 16:
        return "invalid hop limit";
    case 17:
        return "invalid packet rate";
    case 24:
        return "port CM redirect";
    case 25:
        return "port redirect";
    case 26:
        return "invalid MTU";
    case 27:
        return "insufficient responder resources";
    case detail::ib_cm_consumer_reject:
        return "rejected by the peer application";
    case 29:
        return "invalid RNR retry";
    case 30:
        return "duplicate local communication id";
    case 31:
        return "invalid class version";
    case 32:
        return "invalid flow label";
    case 33:
        return "invalid alternate flow label";
    default:
        return "unknown reason";
    }
}

int timeout_ms(const wait_options& o) noexcept {
    using namespace std::chrono;
    if (o.timeout == wait_options::no_timeout) return 2000;
    auto ms = duration_cast<milliseconds>(o.timeout).count();
    return static_cast<int>(std::clamp<long long>(ms, 1, 600'000));
}

rdma_conn_param conn_param(std::span<const std::byte> data, const cm_conn_options& c,
                           const char* call) {
    if (data.size() > 255)
        throw_system_error(EINVAL, std::string(call) + " (private data longer than 255 bytes)");
    rdma_conn_param p{};
    p.private_data = data.empty() ? nullptr : data.data();
    p.private_data_len = static_cast<std::uint8_t>(data.size());
    p.responder_resources = c.responder_resources;
    p.initiator_depth = c.initiator_depth;
    p.retry_count = c.retry_count;
    p.rnr_retry_count = c.rnr_retry_count;
    return p;
}

std::vector<std::byte> copy_private_data(const rdma_cm_event& ev) {
    const auto* p = static_cast<const std::byte*>(ev.param.conn.private_data);
    if (p == nullptr) return {};
    return std::vector<std::byte>(p, p + ev.param.conn.private_data_len);
}

// One step of the QP's way to RTS: the attributes rdma_cm computed for `state`, with `adjust`
// applied. Throws naming the call.
template <typename Adjust>
void move_qp(rdma_cm_id* id, ibv_qp_state state, const char* what, Adjust adjust) {
    ibv_qp_attr attr{};
    int mask = 0;
    attr.qp_state = state;
    errno = 0;
    cm_check(rdma_init_qp_attr(id, &attr, &mask), "rdma_init_qp_attr");
    adjust(attr, mask);
    const int err = ibv_modify_qp(id->qp, &attr, mask);
    if (err != 0) throw_system_error(err, what);
}

// rdma_accept, with the QP moved to RTS here rather than by librdmacm: IB CM gives the
// accepting side's QP the RNR retry count the *connecting* side asked for (its REQ's), so a
// peer asking for 7 (retry for ever) and never posting a receive would stall our sends for
// ever. Ours is conn.rnr_retry_count, like the one the REP tells the peer. librdmacm leaves an
// id without a qp alone in rdma_accept, so the id's qp is hidden from it for that call.
void accept_with_own_rnr_retry(rdma_cm_id* id, rdma_conn_param& p, const cm_conn_options& conn) {
    ibv_qp* qp = id->qp;
    move_qp(id, IBV_QPS_INIT, "ibv_modify_qp(INIT)", [](ibv_qp_attr&, int&) {});
    move_qp(id, IBV_QPS_RTR, "ibv_modify_qp(RTR)",
            [&](ibv_qp_attr& a, int&) { a.max_dest_rd_atomic = conn.responder_resources; });
    move_qp(id, IBV_QPS_RTS, "ibv_modify_qp(RTS)", [&](ibv_qp_attr& a, int& mask) {
        a.max_rd_atomic = conn.initiator_depth;
        a.rnr_retry = conn.rnr_retry_count;
        mask |= IBV_QP_RNR_RETRY | IBV_QP_MAX_QP_RD_ATOMIC;
    });
    p.qp_num = qp->qp_num;
    p.srq = qp->srq != nullptr ? 1 : 0;
    id->qp = nullptr;
    errno = 0;
    const int ret = rdma_accept(id, &p);
    const int err = errno;
    id->qp = qp;
    errno = err;
    cm_check(ret, "rdma_accept");
}

} // namespace

namespace detail {

// rdma_connect on iWARP, on a thread of its own. siw's connect (Linux 6.1, siw_connect) makes
// its TCP connection in blocking mode inside the rdma_connect call: to an address nobody has,
// the call returns only when TCP gives up on its SYNs (about 130 s with the default
// tcp_syn_retries), with the thread blocked in it and the step's bound unable to fire; to a
// port nothing listens on, the call itself fails (ECONNREFUSED). So on iWARP the call runs
// here and the loop waits for the step's outcome as always, bounded: the thread's failure is
// handed to the step waiter through an eventfd the loop watches (the call's success needs
// nothing: ESTABLISHED or REJECTED follows as an event).
// Invariants: while the call runs, the loop makes no librdmacm call on the id and no verbs
// call on its QP (the kernel holds the id's lock, and siw the QP's state lock, for the whole
// connect: rdma_disconnect, rdma_destroy_id, ibv_modify_qp or ibv_destroy_qp would block the
// loop until it ends; measured: a stopped connect() took 129 s to return). A QP or an id
// whose owner goes first is destroyed by the thread when the call returns (`destroy_qp`,
// `destroy_id`), with shares of the event channel, the PD and the CQs kept until then.
struct blocking_connect {
    rdma_cm_id* id = nullptr;
    std::shared_ptr<rdma_event_channel> channel;
    rdma_conn_param param{};
    std::vector<std::byte> data; // the private data, owned here for the thread
    int efd = -1;
    fd_watch* watch = nullptr;               // loop side: the poll on efd
    cm_id_state* owner = nullptr;            // loop side: null once the state went
    std::mutex m;                            // guards the three below
    bool done = false;                       // rdma_connect returned
    int error = 0;                           // its errno, 0 on success
    bool destroy_id = false;                 // the state went first: the thread destroys the id
    bool destroy_qp = false;                 // the qp went first: the thread destroys the QP
    std::vector<std::shared_ptr<void>> keep; // what the QP needs until then (PD, CQs)

    ~blocking_connect() {
        if (efd >= 0) ::close(efd);
    }

    // The loop learns that rdma_connect returned: a failure ends the step.
    static void ready(void* self, unsigned) noexcept {
        auto* job = static_cast<blocking_connect*>(self);
        std::uint64_t n = 0;
        [[maybe_unused]] const auto r = ::read(job->efd, &n, sizeof n);
        int err = 0;
        {
            const std::lock_guard lock(job->m);
            if (!job->done) return;
            err = job->error;
        }
        cm_id_state* s = job->owner;
        if (s == nullptr || err == 0) return;
        cm_event_data d;
        if (err == ECONNREFUSED) {
            d.type = RDMA_CM_EVENT_REJECTED;
            d.nothing_listens = true;
        } else {
            d.type = RDMA_CM_EVENT_CONNECT_ERROR;
        }
        d.status = -err;
        if (waiter* w = s->step_waiters.pop_front()) {
            static_cast<cm_step_waiter*>(w)->result = std::move(d);
            w->fulfil(0);
        }
    }
    static void failed(void*, int) noexcept {} // the step's bound still ends the wait

    // Starts the thread. Throws std::system_error (eventfd, the poll, the thread).
    static std::shared_ptr<blocking_connect> start(cm_id_state& s, const rdma_conn_param& p) {
        auto job = std::make_shared<blocking_connect>();
        job->id = s.id;
        job->channel = s.channel->channel;
        job->param = p;
        if (p.private_data != nullptr) {
            const auto* b = static_cast<const std::byte*>(p.private_data);
            job->data.assign(b, b + p.private_data_len);
            job->param.private_data = job->data.data();
        }
        job->efd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
        if (job->efd < 0) throw_system_error(errno, "eventfd (for rdma_connect's thread)");
        job->owner = &s;
        job->watch = fd_watch::start(*s.channel->ctx, job->efd, job, job.get(), ready, failed);
        try {
            std::thread([job] {
                errno = 0;
                const int ret = rdma_cm_hooks().connect.load()(job->id, &job->param);
                const int err = ret == 0 ? 0 : (errno != 0 ? errno : EIO);
                bool destroy = false;
                std::vector<std::shared_ptr<void>> released;
                {
                    const std::lock_guard lock(job->m);
                    job->done = true;
                    job->error = err;
                    destroy = job->destroy_id;
                    // Under the lock: the loop's abandon() / take_qp() see `done` only once
                    // the QP is gone, so the loop never destroys the id (or the QP) while
                    // this thread is still in rdma_destroy_qp.
                    if (job->destroy_qp) {
                        rdma_destroy_qp(job->id);
                        released = std::move(job->keep);
                    }
                }
                released.clear();
                if (destroy) {
                    rdma_destroy_id(job->id);
                    return;
                }
                const std::uint64_t one = 1;
                [[maybe_unused]] const auto n = ::write(job->efd, &one, sizeof one);
            }).detach();
        } catch (const std::system_error&) {
            job->abandon(); // the call never ran: nothing for a thread to destroy
            throw;
        }
        return job;
    }

    // rdma_connect has not been seen to return on its thread (loop side). The kernel may be
    // done with it already: see cm_id::start_disconnect.
    bool running() noexcept {
        const std::lock_guard lock(m);
        return !done;
    }

    // The id's qp goes (loop side): true when the thread now owns the QP (and `k`). Not once
    // the id is connected: the kernel's call has returned then (see start_disconnect), and the
    // loop may disconnect the id, which touches the QP, at any time: the loop destroys it.
    bool take_qp(std::vector<std::shared_ptr<void>> k, bool connected) noexcept {
        const std::lock_guard lock(m);
        if (done || connected) return false;
        destroy_qp = true;
        keep = std::move(k);
        return true;
    }

    // The state goes (loop side): stop watching; true when the thread now owns the id.
    bool abandon() noexcept {
        owner = nullptr;
        if (watch != nullptr) std::exchange(watch, nullptr)->release();
        const std::lock_guard lock(m);
        if (!done) destroy_id = true;
        return destroy_id;
    }
};

cm_hooks& rdma_cm_hooks() noexcept {
    static cm_hooks table{
        +[](rdma_cm_id* id, rdma_conn_param* param) noexcept { return rdma_connect(id, param); },
        +[](rdma_cm_id* id, ibv_pd* pd, ibv_qp_init_attr* init) noexcept {
            return rdma_create_qp(id, pd, init);
        }};
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
    with_object(id->qp, [](qp_state& q) { q.connection_closed = true; });
}

// rdma_disconnect has moved the id's QP to the error state: its flushes are bounded as after
// qp::to_error() (the flush timer), so that a device that loses some (Linux 6.1's rxe) cannot
// leave an await of the qp waiting for ever.
void watch_qp_flush(rdma_cm_id* id) noexcept {
    if (id->qp == nullptr) return;
    with_object(id->qp, [](qp_state& q) {
        q.in_error = true;
        q.watch_flush();
    });
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

connection_rejected::connection_rejected(int reason, std::string reason_text,
                                         std::vector<std::byte> data, const char* call)
    : connection_rejected(reason, std::move(reason_text), std::move(data), call,
                          reason == detail::ib_cm_consumer_reject,
                          reason == detail::ib_cm_invalid_service_id) {}

connection_rejected::connection_rejected(int reason, std::string reason_text,
                                         std::vector<std::byte> data, const char* call,
                                         bool by_peer_application, bool nothing_listens)
    : std::system_error(ECONNREFUSED, std::system_category(),
                        std::string(call) + ": rejected by the peer: reason " +
                            std::to_string(reason) + " (" + reason_text + ")"),
      reason_(reason), by_application_(by_peer_application), nothing_listens_(nothing_listens),
      data_(std::move(data)) {}

cm_id::cm_id(cm_channel& ch) {
    rdma_cm_id* raw = nullptr;
    errno = 0;
    cm_check(rdma_create_id(ch.state_->channel.get(), &raw, nullptr, RDMA_PS_TCP),
             "rdma_create_id");
    try {
        state_ = std::make_shared<detail::cm_id_state>(ch.state_, raw);
    } catch (...) {
        rdma_destroy_id(raw);
        throw;
    }
}

cm_id::~cm_id() {
    if (!state_) return;
    state_->closed = true;
    state_->on_request = nullptr;
    while (detail::waiter* w = state_->step_waiters.pop_front())
        w->fulfil(ECANCELED);
    while (detail::waiter* w = state_->accept_waiters.pop_front())
        w->fulfil(ECANCELED);
    while (detail::waiter* w = state_->disconnect_waiters.pop_front())
        w->fulfil(ECANCELED);
    state_->backlog.clear(); // unanswered requests are rejected
}

cm_id& cm_id::operator=(cm_id&& other) noexcept {
    if (this != &other) {
        cm_id dying(std::move(*this));
        state_ = std::move(other.state_);
    }
    return *this;
}

cm_id::in_transit cm_id::migrate(cm_channel& target) && {
    if (!state_) throw_system_error(EINVAL, "cm_id::migrate (an empty handle)");
    detail::cm_id_state& s = *state_;
    if (s.id->qp != nullptr || (s.connecting && s.connecting->running()) ||
        !s.step_waiters.empty() || !s.accept_waiters.empty() || !s.disconnect_waiters.empty() ||
        !s.backlog.empty())
        throw_system_error(EBUSY, "cm_id::migrate (the id has a qp, a waiter or a backlog)");
    if (s.error != 0) throw_system_error(s.error, "cm_id::migrate");
    // Leave the old channel first: once rdma_migrate_id returns, target's thread may dispatch
    // an event of the id, and nothing here touches the state after that. Every event the old
    // channel read was dispatched and acked on this thread, so rdma_migrate_id does not wait.
    std::shared_ptr<detail::cm_channel_state> from = s.channel;
    from->unlist(&s);
    s.listed = false;
    s.channel = target.state_;
    errno = 0;
    if (rdma_migrate_id(s.id, target.state_->channel.get()) != 0) {
        const int err = errno != 0 ? errno : EIO;
        s.channel = std::move(from);
        s.channel->list(&s);
        s.listed = true;
        throw_system_error(err, "rdma_migrate_id");
    }
    return in_transit(std::move(state_));
}

cm_id::cm_id(cm_channel& target, in_transit&& moving) {
    if (!moving.state_ || moving.state_->channel != target.state_)
        throw_system_error(EINVAL, "cm_id::adopt (not migrated to this channel)");
    detail::cm_id_state& s = *moving.state_;
    s.channel->list(&s); // may throw bad_alloc: `moving` still owns the id
    s.listed = true;
    if (s.channel->error != 0) s.error = s.channel->error;
    state_ = std::move(moving.state_);
}

verbs::context cm_id::device() const {
    if (state_->id->verbs == nullptr)
        throw_system_error(ENODEV, "cm_id::device (the id is not bound to a device yet)");
    int n = 0;
    errno = 0;
    ibv_context** list = rdma_get_devices(&n);
    if (list == nullptr) throw_system_error(errno != 0 ? errno : ENODEV, "rdma_get_devices");
    // The list holds librdmacm's reference on its devices; the context shares it (aliasing).
    std::shared_ptr<ibv_context*> keep(list, rdma_free_devices);
    return verbs::context(std::shared_ptr<ibv_context>(keep, state_->id->verbs));
}

void cm_id::on_request(std::function<void(cm_id request, int error)> handler) {
    if (!handler) {
        state_->on_request = nullptr;
        return;
    }
    state_->on_request = [h = std::move(handler)](std::shared_ptr<detail::cm_id_state> s,
                                                  int error) {
        h(s ? cm_id(std::move(s)) : cm_id(), error);
    };
    // Requests that came before go to the handler too, in order.
    while (!state_->backlog.empty() && state_->on_request) {
        std::shared_ptr<detail::cm_id_state> r = std::move(state_->backlog.front().id);
        state_->backlog.pop_front();
        const auto handler = state_->on_request; // may be reset while it runs
        handler(std::move(r), 0);
    }
}

void cm_id::listen(const sockaddr* addr, int backlog) {
    errno = 0;
    cm_check(rdma_bind_addr(state_->id, const_cast<sockaddr*>(addr)), "rdma_bind_addr");
    errno = 0;
    cm_check(rdma_listen(state_->id, backlog), "rdma_listen");
}

std::uint16_t cm_id::local_port() const noexcept {
    return ntohs(rdma_get_src_port(state_->id));
}

void cm_id::reject(std::span<const std::byte> data) {
    if (data.size() > 255) throw_system_error(EINVAL, "rdma_reject (private data > 255 bytes)");
    errno = 0;
    cm_check(rdma_reject(state_->id, data.empty() ? nullptr : data.data(),
                         static_cast<std::uint8_t>(data.size())),
             "rdma_reject");
    state_->unanswered = false;
}

void cm_id::begin(detail::cm_id_state& s, step k, const sockaddr_storage* addr,
                  std::span<const std::byte> data, const cm_conn_options& conn,
                  const wait_options& options) {
    if (s.closed) throw_system_error(ECANCELED, "cm_id");
    if (s.error != 0) throw_system_error(s.error, "cm_id");
    errno = 0;
    switch (k) {
    case step::resolve_addr:
        cm_check(rdma_resolve_addr(s.id, nullptr,
                                   reinterpret_cast<sockaddr*>(const_cast<sockaddr_storage*>(addr)),
                                   timeout_ms(options)),
                 "rdma_resolve_addr");
        break;
    case step::resolve_route:
        cm_check(rdma_resolve_route(s.id, timeout_ms(options)), "rdma_resolve_route");
        break;
    case step::connect: {
        if (s.id->qp == nullptr) throw_system_error(EINVAL, "rdma_connect (the id has no qp)");
        rdma_conn_param p = conn_param(data, conn, "rdma_connect");
        if (s.id->verbs != nullptr && s.id->verbs->device->transport_type == IBV_TRANSPORT_IWARP) {
            if (s.connecting && s.connecting->running())
                throw_system_error(EBUSY, "rdma_connect (a connect of this id is still running)");
            if (s.connecting) s.connecting->abandon();
            s.connecting = detail::blocking_connect::start(s, p);
            break;
        }
        cm_check(rdma_connect(s.id, &p), "rdma_connect");
        break;
    }
    case step::accept_connection: {
        if (s.id->qp == nullptr) throw_system_error(EINVAL, "rdma_accept (the id has no qp)");
        rdma_conn_param p = conn_param(data, conn, "rdma_accept");
        if (s.id->verbs->device->transport_type == IBV_TRANSPORT_IWARP) {
            // No RNR on iWARP, and the iWARP CM moves the QP to RTS itself.
            cm_check(rdma_accept(s.id, &p), "rdma_accept");
        } else {
            accept_with_own_rnr_retry(s.id, p, conn);
        }
        s.unanswered = false;
        break;
    }
    }
}

std::vector<std::byte> cm_id::outcome(step k, int wait_error,
                                      std::optional<detail::cm_event_data>& result) {
    static constexpr const char* names[] = {"rdma_resolve_addr", "rdma_resolve_route",
                                            "rdma_connect", "rdma_accept"};
    static constexpr rdma_cm_event_type expected[] = {
        RDMA_CM_EVENT_ADDR_RESOLVED, RDMA_CM_EVENT_ROUTE_RESOLVED, RDMA_CM_EVENT_ESTABLISHED,
        RDMA_CM_EVENT_ESTABLISHED};
    const auto i = static_cast<std::size_t>(k);
    const char* name = names[i];
    if (wait_error == ETIMEDOUT)
        throw_system_error(ETIMEDOUT, std::string(name) +
                                          ": no answer within the step's bound (its wait_options, "
                                          "else cm_channel_options::step_timeout)");
    if (wait_error != 0) throw_system_error(wait_error, name);
    if (!result) throw_system_error(EIO, name); // fulfilled without an outcome: not expected
    detail::cm_event_data r = std::move(*result);
    result.reset();
    if (r.type == expected[i]) return std::move(r.private_data);
    switch (r.type) {
    case RDMA_CM_EVENT_REJECTED:
        // On rdma_connect: the listener refused our request. On rdma_accept: the connecting
        // peer refused our accept (it rejected the REP, or gave up and its IB CM said so).
        if (r.nothing_listens)
            throw connection_rejected(r.status,
                                      "nothing listens at that address and port: the TCP "
                                      "connection was refused",
                                      {}, name, false, true);
        if (r.status < 0) {
            // iWARP: the provider's negative errno (siw: -ECONNRESET for an MPA reject; other
            // providers -ECONNREFUSED), the private data as the peer's rdma_reject gave it.
            throw connection_rejected(r.status,
                                      "rejected by the peer application: an iWARP MPA reject",
                                      std::move(r.private_data), name, true, false);
        }
        throw connection_rejected(r.status, reject_reason_text(r.status), std::move(r.private_data),
                                  name);
    case RDMA_CM_EVENT_DISCONNECTED:
        throw_system_error(ECONNRESET, std::string(name) + ": disconnected before established");
    default: {
        const int err = r.status < 0 ? -r.status : EPROTO;
        throw_system_error(err, std::string(name) + ": " + rdma_event_str(r.type));
    }
    }
}

void cm_id::start_disconnect(detail::cm_id_state& s) {
    errno = 0;
    s.disconnect_sent = true;
    detail::mark_connection_closed(s.id);
    if (s.connecting && s.connecting->running() && !s.connected) {
        // iWARP's rdma_connect still runs on its thread (a step that timed out): the kernel
        // holds the id and the QP for it, so rdma_disconnect (or moving the QP to error)
        // would block this loop until TCP gives up. Nothing is connected: the id is
        // disconnected now. Requests posted on its QP stay posted until the call returns.
        // Not once ESTABLISHED came: the kernel reports it only after its rdma_connect
        // returned (cma.c: rdma_connect holds the id's handler_mutex, which cma_iw_handler
        // takes before reporting ESTABLISHED), although the thread may not have run since to
        // say so (a loaded machine: seconds). Skipping the disconnect then left the
        // connection up and the peer waiting for a DISCONNECTED that never came.
        s.disconnected = true;
        while (detail::waiter* w = s.disconnect_waiters.pop_front())
            w->fulfil(0);
        return;
    }
    if (rdma_disconnect(s.id) != 0) {
        const int err = errno != 0 ? errno : EIO;
        // EINVAL on an id that never sent a connect (no IB CM id): nothing to wait for.
        if (err != EINVAL || s.connected) throw_system_error(err, "rdma_disconnect");
    }
    detail::watch_qp_flush(s.id); // librdmacm moved the QP to the error state first
    if (s.connected) return;      // DISCONNECTED comes with the peer's DREP, or IB CM's timeout
    // Never established (a connect refused, timed out or not answered yet): IB CM has no
    // connection to send a DREQ for, so rdma_disconnect returned 0 (or EINVAL, above) having
    // sent nothing, and no DISCONNECTED will come. The id is disconnected now.
    s.disconnected = true;
    while (detail::waiter* w = s.disconnect_waiters.pop_front())
        w->fulfil(0);
}

void cm_id::close() noexcept {
    if (!state_ || state_->disconnect_sent || state_->disconnected || !state_->connected) return;
    if (state_->device_removed) return; // no connection is left to end, no DREQ can be sent
    try {
        start_disconnect(*state_);
    } catch (const std::exception& e) {
        detail::diagnose("%s", e.what()); // the id's destruction still ends the connection
    }
}

verbs::queue_pair cm_id::create_qp(const verbs::protection_domain& pd,
                                   const verbs::completion_queue& send_cq,
                                   const verbs::completion_queue& recv_cq,
                                   const verbs::qp_caps& caps, ibv_srq* srq) {
    ibv_qp_init_attr init = verbs::rc_init_attr(send_cq.native(), recv_cq.native(), caps, srq);
    errno = 0;
    cm_check(detail::rdma_cm_hooks().create_qp.load()(state_->id, pd.native(), &init),
             "rdma_create_qp (the PD must come from the id's device())");
    // The deleter keeps the id (rdma_destroy_qp before rdma_destroy_id), the PD and the CQs.
    std::shared_ptr<ibv_qp> owned(state_->id->qp, [s = state_, pd_keep = pd.handle(),
                                                   scq = send_cq.handle(),
                                                   rcq = recv_cq.handle()](ibv_qp*) {
        // iWARP's rdma_connect still running holds the QP: its
        // thread destroys it when the call returns.
        if (s->connecting && s->connecting->take_qp({pd_keep, scq, rcq}, s->connected)) return;
        rdma_destroy_qp(s->id);
    });
    return verbs::queue_pair(std::move(owned),
                             verbs::qp_caps{init.cap.max_send_wr, init.cap.max_recv_wr,
                                            init.cap.max_send_sge, init.cap.max_recv_sge,
                                            init.cap.max_inline_data});
}

qp cm_id::make_qp(const verbs::protection_domain& pd, cq& send_cq, cq& recv_cq,
                  const verbs::qp_caps& caps, qp_options options) {
    ibv_srq* shared =
        options.shared_receive_queue ? options.shared_receive_queue->native() : nullptr;
    qp made(create_qp(pd, send_cq.native_cq(), recv_cq.native_cq(), caps, shared), send_cq, recv_cq,
            options);
    if (state_->id->verbs->device->transport_type == IBV_TRANSPORT_IWARP)
        detail::with_object(state_->id->qp, [](detail::qp_state& q) { q.iwarp_connection = true; });
    return made;
}

} // namespace ringverbs
