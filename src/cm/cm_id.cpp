// cm_id: an rdma_cm id's steps (resolve, connect, accept, disconnect) as awaits with their
// outcome, its migration to another cm_channel, listening and rejecting, accepting with our
// own RNR retry count, and the QP made on it. cm_channel.cpp holds the event channel and the
// dispatch of its events.
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
        detail::with_object(state_->id->qp, [](detail::qp_state& q) { q.on_iwarp_connection(); });
    return made;
}

} // namespace ringverbs
