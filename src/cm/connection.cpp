// connection, connect() and listener: rdma_getaddrinfo, the rdma_cm steps with their bound, and
// the per-device resources shared between connections.
#include <ringverbs/cm/connection.hpp>
#include <ringverbs/cm/detail/cm_hooks.hpp>

#include <ringverbs/engine/diagnostics.hpp>
#include <ringverbs/engine/error.hpp>
#include <ringverbs/engine/nothrow.hpp>
#include <ringverbs/engine/poll.hpp>
#include <ringverbs/engine/timer.hpp>
#include <ringverbs/engine/when_all.hpp>
#include <ringverbs/rdma/srq.hpp>
#include <ringverbs/verbs/detail/provider.hpp>

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <deque>
#include <exception>
#include <iterator>
#include <map>
#include <mutex>
#include <new>
#include <optional>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <utility>

namespace ringverbs {

namespace detail {

namespace {
// Host-name lookups on their threads, in the whole process (connect()'s bound on them).
std::atomic<unsigned> lookups_running{0};
} // namespace

void split_host_port(std::string_view text, std::string& host, std::string& port, const char* who) {
    auto bad = [&](const char* why) {
        throw_system_error(EINVAL, std::string(who) + " (address \"" + std::string(text) +
                                       "\": " + why + ")");
    };
    std::string_view h, p;
    if (!text.empty() && text.front() == '[') {
        const auto close = text.find(']');
        if (close == std::string_view::npos) bad("no ']' after an IPv6 address");
        h = text.substr(1, close - 1);
        const auto rest = text.substr(close + 1);
        if (rest.size() < 2 || rest.front() != ':') bad("expected \"[address]:port\"");
        p = rest.substr(1);
    } else if (const auto colon = text.rfind(':'); colon == std::string_view::npos) {
        // A bare port: any address (a listener's; connect() refuses an empty host itself).
        if (text.empty() || text.find_first_not_of("0123456789") != std::string_view::npos)
            bad("expected \"host:port\", \":port\" or \"port\"");
        p = text;
    } else {
        h = text.substr(0, colon);
        p = text.substr(colon + 1);
        if (h.find(':') != std::string_view::npos)
            bad("an IPv6 address goes in brackets: \"[address]:port\"");
    }
    unsigned value = 0;
    const auto [end, ec] = std::from_chars(p.data(), p.data() + p.size(), value);
    if (p.empty() || ec != std::errc() || end != p.data() + p.size() || value > 65535)
        bad("the port is not a number in 0..65535");
    host.assign(h);
    port.assign(p);
}

std::chrono::nanoseconds connect_step_bound(std::chrono::nanoseconds step_timeout) noexcept {
    // The rdma_cm steps would fall back to the channel's bound anyway (cm_id: a step awaited
    // without a timeout); saying it here gives the lookup, which has no channel, the same one.
    return step_timeout == wait_options::no_timeout ? cm_channel_options{}.step_timeout
                                                    : step_timeout;
}

unsigned lookup_threads() noexcept {
    return lookups_running.load(std::memory_order_relaxed);
}

std::string address_text(const sockaddr* a) {
    char text[INET6_ADDRSTRLEN] = {};
    if (a == nullptr) return "?";
    if (a->sa_family == AF_INET) {
        const auto* in = reinterpret_cast<const sockaddr_in*>(a);
        inet_ntop(AF_INET, &in->sin_addr, text, sizeof text);
        return std::string(text) + ":" + std::to_string(ntohs(in->sin_port));
    }
    if (a->sa_family == AF_INET6) {
        const auto* in6 = reinterpret_cast<const sockaddr_in6*>(a);
        inet_ntop(AF_INET6, &in6->sin6_addr, text, sizeof text);
        return "[" + std::string(text) + "]:" + std::to_string(ntohs(in6->sin6_port));
    }
    return "?";
}

std::string peer_host(const sockaddr* a) {
    char text[INET6_ADDRSTRLEN] = {};
    if (a != nullptr && a->sa_family == AF_INET) {
        inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(a)->sin_addr, text, sizeof text);
        return text;
    }
    if (a != nullptr && a->sa_family == AF_INET6) {
        in6_addr addr = reinterpret_cast<const sockaddr_in6*>(a)->sin6_addr;
        if (IN6_IS_ADDR_V4MAPPED(&addr)) { // an IPv4 host, as the IPv4 listener sees it
            inet_ntop(AF_INET, &addr.s6_addr[12], text, sizeof text);
            return text;
        }
        // One host, one /64: privacy addresses come from the host's whole prefix.
        std::fill(std::begin(addr.s6_addr) + 8, std::end(addr.s6_addr), std::uint8_t{0});
        inet_ntop(AF_INET6, &addr, text, sizeof text);
        return std::string(text) + "/64";
    }
    return "?";
}

} // namespace detail

namespace {

// A device's protection domain, shared by every connection on it in the process.
struct device_share {
    verbs::context device;
    verbs::protection_domain pd;
    explicit device_share(verbs::context dev) : device(std::move(dev)), pd(device) {}
};

std::shared_ptr<device_share> share_of(const cm_id& id) {
    static std::mutex mutex;
    static std::map<ibv_context*, std::weak_ptr<device_share>> shares;
    verbs::context dev = id.device();
    const std::lock_guard lock(mutex);
    std::weak_ptr<device_share>& slot = shares[dev.native()];
    if (auto s = slot.lock()) return s;
    auto s = std::make_shared<device_share>(std::move(dev));
    slot = s;
    return s;
}

bool same(const channel_options& a, const channel_options& b) noexcept {
    return a.priority == b.priority && a.mode == b.mode && a.hybrid_spin == b.hybrid_spin &&
           a.ack_batch == b.ack_batch && a.poll_batch == b.poll_batch &&
           a.hybrid_spin_max == b.hybrid_spin_max;
}

// The completion channel of this thread's io_context for a device and options. The weak
// entries go stale when their last connection goes; they are replaced, not kept growing. A
// channel that failed (error() != 0) reads no event any more: a connection on it would wait
// for completions nobody reads, so it is replaced too (as cm_channel_of does); the connections
// still on it keep it until they go.
std::shared_ptr<channel> channel_of(io_context& io, const device_share& dev,
                                    const channel_options& o) {
    struct entry {
        io_context* io;
        ibv_context* device;
        channel_options options;
        std::weak_ptr<channel> ch;
    };
    thread_local std::vector<entry> channels;
    entry* stale = nullptr;
    for (entry& e : channels) {
        if (e.io == &io && e.device == dev.device.native() && same(e.options, o)) {
            auto ch = e.ch.lock();
            if (ch && ch->error() == 0) return ch;
            stale = &e; // expired, or dead: this entry is the one to replace
            break;
        }
        if (e.ch.expired()) stale = &e;
    }
    auto ch = std::make_shared<channel>(io, dev.device, o);
    entry made{&io, dev.device.native(), o, ch};
    if (stale != nullptr)
        *stale = made;
    else
        channels.push_back(made);
    return ch;
}

// The rdma_cm event channel connect() uses on this thread's io_context. A channel that failed
// (error() != 0) reads no event any more: every step of an id on it would time out, so it is
// replaced here; the connections still on it keep it until they go.
std::shared_ptr<cm_channel> cm_channel_of(io_context& io) {
    thread_local std::vector<std::pair<io_context*, std::weak_ptr<cm_channel>>> channels;
    std::pair<io_context*, std::weak_ptr<cm_channel>>* stale = nullptr;
    for (auto& e : channels) {
        if (e.first == &io) {
            auto ch = e.second.lock();
            if (ch && ch->error() == 0) return ch;
            stale = &e; // expired, or dead: this entry is the one to replace
            break;
        }
        if (e.second.expired()) stale = &e;
    }
    auto ch = std::make_shared<cm_channel>(io);
    if (stale != nullptr)
        *stale = {&io, ch};
    else
        channels.emplace_back(&io, ch);
    return ch;
}

using addrinfo_ptr = std::unique_ptr<rdma_addrinfo, decltype(&rdma_freeaddrinfo)>;

// rdma_getaddrinfo for a reliable connection. Gives 0, an errno, or a (negative) EAI_* code:
// librdmacm returns getaddrinfo's code as it is, and -1 with errno for its own failures.
int lookup_now(const std::string& host, const std::string& port, bool passive, bool numeric,
               rdma_addrinfo** out) {
    rdma_addrinfo hints{};
    hints.ai_flags = (passive ? RAI_PASSIVE : 0) | (numeric ? RAI_NUMERICHOST : 0);
    hints.ai_port_space = RDMA_PS_TCP;
    hints.ai_qp_type = IBV_QPT_RC;
    errno = 0;
    const int rc =
        rdma_getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, out);
    if (rc == 0) return 0;
    if (rc == -1 && errno > 0) return errno;
    return rc < 0 ? rc : EIO;
}

[[noreturn]] void throw_lookup(int code, const std::string& host, const std::string& port) {
    const std::string call = "rdma_getaddrinfo(\"" + host + "\", \"" + port + "\")";
    if (code > 0) {
        if (code == ENODEV) throw_system_error(code, call + " (no RDMA device, or no rdma_cm)");
        throw_system_error(code, call);
    }
    int err = EIO;
    switch (code) {
    case EAI_NONAME:
    case EAI_SERVICE:
    case EAI_FAMILY:
#ifdef EAI_NODATA
    case EAI_NODATA:
#endif
#ifdef EAI_ADDRFAMILY
    case EAI_ADDRFAMILY:
#endif
        err = EINVAL;
        break;
    case EAI_AGAIN:
        err = EAGAIN;
        break;
    case EAI_MEMORY:
        err = ENOMEM;
        break;
    default:
        break;
    }
    throw_system_error(err, call + ": " + gai_strerror(code));
}

// A host name's lookup, run on a thread of its own (getaddrinfo blocks for as long as DNS
// takes); it signals an eventfd the loop polls. If the awaiting side gives up (stop), the
// thread still ends on its own and the last owner frees the rest.
struct lookup_job {
    std::string host, port;
    rdma_addrinfo* result = nullptr;
    int code = 0;
    int efd = -1;
    std::atomic<bool> done{false};
    ~lookup_job() {
        if (result != nullptr) rdma_freeaddrinfo(result);
        if (efd >= 0) ::close(efd);
    }
};

task<addrinfo_ptr> lookup(io_context& io, std::string host, std::string port, wait_options w) {
    rdma_addrinfo* found = nullptr;
    const int code = lookup_now(host, port, false, true, &found);
    if (code == 0) co_return addrinfo_ptr(found, rdma_freeaddrinfo);
    if (code != EAI_NONAME) throw_lookup(code, host, port);
    // A thread each, detached (a lookup cannot be cancelled): bounded, so that a burst of
    // connect()s to a name whose DNS hangs cannot pile up threads. Beyond it: EAGAIN at once.
    if (detail::lookups_running.fetch_add(1, std::memory_order_relaxed) >=
        detail::max_lookup_threads) {
        detail::lookups_running.fetch_sub(1, std::memory_order_relaxed);
        throw_system_error(EAGAIN, "rdma_getaddrinfo(\"" + host + "\", \"" + port + "\") (" +
                                       std::to_string(detail::max_lookup_threads) +
                                       " host-name lookups already under way on their threads)");
    }
    struct release_slot {
        bool armed = true;
        ~release_slot() {
            if (armed) detail::lookups_running.fetch_sub(1, std::memory_order_relaxed);
        }
    } slot; // until the thread owns the slot
    auto job = std::make_shared<lookup_job>();
    job->host = host;
    job->port = port;
    job->efd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (job->efd < 0) throw_system_error(errno, "eventfd (for rdma_getaddrinfo's thread)");
    std::thread([job] {
        job->code = lookup_now(job->host, job->port, false, false, &job->result);
        // Before the wake-up: whoever it resumes sees this lookup's slot free.
        detail::lookups_running.fetch_sub(1, std::memory_order_relaxed);
        job->done.store(true, std::memory_order_release);
        const std::uint64_t one = 1;
        [[maybe_unused]] const auto n = ::write(job->efd, &one, sizeof one);
    }).detach();
    slot.armed = false;
    int waited = 0;
    try {
        while (!job->done.load(std::memory_order_acquire))
            co_await poll(io, job->efd, POLLIN, w);
    } catch (const std::system_error& e) {
        waited = e.code().value(); // timed_out (the step bound), operation_canceled (stop)
    }
    if (waited != 0)
        throw_system_error(waited, "rdma_getaddrinfo(\"" + host + "\", \"" + port +
                                       "\") (the name's lookup, on its thread)");
    if (job->code != 0) throw_lookup(job->code, host, port);
    co_return addrinfo_ptr(std::exchange(job->result, nullptr), rdma_freeaddrinfo);
}

} // namespace

struct connection::parts {
    std::shared_ptr<cm_channel> events;
    cm_id id;
    std::shared_ptr<device_share> device;
    std::shared_ptr<channel> completion_channel;
    std::optional<cq> completions;
    std::optional<qp> queue;
    std::optional<recv_ring> ring; // before the qp goes: its receives are owed on it
    std::vector<std::byte> peer_data;

    parts(std::shared_ptr<cm_channel> ev, cm_id i) : events(std::move(ev)), id(std::move(i)) {}
    // Members go in reverse: the ring, the qp (it keeps its CQ's state and the id's until
    // nothing is owed), the CQ, the channel, the PD, the id, the event channel.
    ~parts() {
        // An established connection is ended now, so the peer learns it at once and the qp's
        // owed requests flush (their awaits end with connection_reset, bounded).
        if (id) id.close();
    }

    // The device's PD and channel, this connection's CQ and its qp (on the id).
    void equip(io_context& io, const connection_options& o) {
        device = share_of(id);
        completion_channel = channel_of(io, *device, o.completion);
        cq_options co;
        verbs::qp_caps caps = o.caps;
        if (o.receive_slots > caps.max_recv_wr) caps.max_recv_wr = o.receive_slots;
        if (o.cq_entries > 0) {
            co.entries = o.cq_entries;
        } else {
            // On an SRQ the qp has no receive queue of its own (max_recv_wr is unused), but any
            // receive the SRQ holds may complete on this qp, hence on this CQ: count its depth.
            const std::size_t receives = o.queue.shared_receive_queue != nullptr
                                             ? o.queue.shared_receive_queue->capacity()
                                             : caps.max_recv_wr;
            const auto needed = std::size_t{caps.max_send_wr} + receives;
            std::size_t entries = 1;
            while (entries < needed)
                entries *= 2;
            co.entries = static_cast<int>(entries);
        }
        completions.emplace(*completion_channel, co);
        queue.emplace(id.make_qp(device->pd, *completions, *completions, caps, o.queue));
        if (o.receive_slots > 0) ring.emplace(*queue, device->pd, o.receive_slots, o.receive_size);
    }
};

connection::connection(std::unique_ptr<parts> p) noexcept : parts_(std::move(p)) {}
connection::connection(connection&&) noexcept = default;
connection& connection::operator=(connection&&) noexcept = default;
connection::~connection() = default;

recv_ring::next_awaitable connection::next_message(wait_options w) {
    if (!parts_->ring)
        throw_system_error(EINVAL, "connection::next_message (no recv_ring: set "
                                   "connection_options::receive_slots)");
    return parts_->ring->next(std::move(w));
}
recv_ring* connection::message_ring() noexcept {
    return parts_->ring ? &*parts_->ring : nullptr;
}
cm_id::disconnect_awaitable connection::disconnect(wait_options w) noexcept {
    return parts_->id.disconnect(std::move(w));
}
cm_id::disconnect_awaitable connection::disconnected(wait_options w) noexcept {
    return parts_->id.disconnected(std::move(w));
}
bool connection::is_disconnected() const noexcept {
    return parts_->id.is_disconnected();
}
const verbs::protection_domain& connection::pd() const noexcept {
    return parts_->device->pd;
}
const verbs::context& connection::device() const noexcept {
    return parts_->device->device;
}
std::span<const std::byte> connection::peer_data() const noexcept {
    return parts_->peer_data;
}
std::string connection::peer_address() const {
    return detail::address_text(rdma_get_peer_addr(parts_->id.native()));
}
qp& connection::queue_pair() noexcept {
    return *parts_->queue;
}
cq& connection::completions() noexcept {
    return *parts_->completions;
}
cm_id& connection::id() noexcept {
    return parts_->id;
}
cm_channel& connection::events() noexcept {
    return *parts_->events;
}
channel& connection::completion_channel() noexcept {
    return *parts_->completion_channel;
}

namespace {

// The RDMA READs a siw QP may have outstanding as initiator (its ORD; 0: none). siw's
// ibv_query_qp reports them as max_dest_rd_atomic and its responder depth (IRD) as
// max_rd_atomic, the other way round from the verbs API (siw_query_qp, Linux 6.1).
int siw_read_depth(verbs::queue_pair& q) {
    ibv_qp_attr attr{};
    ibv_qp_init_attr init{};
    return ibv_query_qp(q.native(), &attr, IBV_QP_MAX_QP_RD_ATOMIC | IBV_QP_MAX_DEST_RD_ATOMIC,
                        &init) == 0
               ? attr.max_dest_rd_atomic
               : 0;
}

// A zero-length RDMA WRITE each time `interval` (doubling, at most 1 s) passes until `answered`.
task<void> kick_until(io_context& io, qp& q, std::stop_token answered) {
    std::chrono::milliseconds interval(10);
    while ((co_await nothrow(sleep_for(io, interval, answered))).ok()) {
        // Only the READ decides: a kick that fails (the QP failed) ends the kicks, and the
        // READ ends with that failure's flush.
        if (!(co_await nothrow(q.write(local_buffer{}, remote_buffer{})))) co_return;
        interval = std::min<std::chrono::milliseconds>(interval * 2, std::chrono::seconds(1));
    }
}

// The zero-length RDMA READ; `answered` is stopped however it ends.
task<void> probe_read(qp& q, wait_options step, std::stop_source& answered) {
    struct stop_at_end {
        std::stop_source& s;
        ~stop_at_end() { s.request_stop(); }
    } end{answered};
    co_await q.read(local_buffer{}, remote_buffer{}, step);
}

// siw (Linux 6.1; mainline unchanged as read in 2026-12) hands a connection's TCP socket from its
// CM to the QP only after the MPA reply went out (siw_accept: siw_send_mpareqrep, then
// siw_qp_socket_assoc). A frame of ours that reaches the server in between is not read: the CM's
// data_ready ignores it, and it stays in the socket until another frame arrives. A client that
// sends at once and waits for the answer then waits for ever (seen in CI: an echo's first
// message never answered; tests/cm/connection_test.cpp provokes it). So on siw connect() first
// sends a zero-length RDMA READ (no receive used, no memory named) and returns when its response
// came: the server's QP reads its socket by then. While the READ is unanswered, a zero-length
// RDMA WRITE now and then (the peer takes it without a key or a completion) gives the server's
// socket a new frame, which reads the stuck ones with it. Bounded by the step's bound (then the
// QP's flush bound). The READ is the QP's first send request: libsiw copies no SGE for
// num_sge 0 and siw reads the READ's length from SGE 0 of the slot, zero in a new queue.
// Known cost (siw_qp_tx.c, not seen): if the server is transmitting when the READ arrives, siw
// queues the response and may send it with the length of the server's previous send; the
// connect then fails (a clear error) instead of stalling.
task<void> settle_on_siw(io_context& io, qp& q, wait_options step) {
    std::stop_source answered;
    try {
        co_await when_all(probe_read(q, step, answered), kick_until(io, q, answered.get_token()));
    } catch (const std::system_error& e) {
        // e.what() ends with the code's text, which system_error adds again: drop it.
        std::string what = e.what();
        const std::string tail = ": " + e.code().message();
        if (what.size() > tail.size() && what.ends_with(tail))
            what.resize(what.size() - tail.size());
        throw std::system_error(e.code(), "ringverbs::connect (the zero-length RDMA READ that "
                                          "settles a siw connection failed: " +
                                              what + ")");
    }
}

} // namespace

task<connection> connect(io_context& io, std::string address, connection_options options,
                         std::stop_token stop) {
    std::string host, port;
    detail::split_host_port(address, host, port, "ringverbs::connect");
    if (host.empty())
        throw_system_error(EINVAL, "ringverbs::connect (address \"" + address +
                                       "\": no host to connect to)");
    const std::vector<std::byte> data(options.private_data.begin(), options.private_data.end());
    const wait_options step(detail::connect_step_bound(options.step_timeout), stop);
    addrinfo_ptr found = co_await lookup(io, host, port, step);

    std::shared_ptr<cm_channel> events = cm_channel_of(io);
    auto p = std::make_unique<connection::parts>(events, cm_id(*events));
    co_await p->id.resolve_addr(found->ai_dst_addr, step);
    co_await p->id.resolve_route(step);
    p->equip(io, options);
    p->peer_data = co_await p->id.connect(data, step, options.conn);
    if (detail::rdma_cm_hooks().settle_on_siw && verbs::detail::is_siw(p->id.native()->verbs) &&
        siw_read_depth(p->queue->native_qp()) > 0)
        co_await settle_on_siw(io, *p->queue, step);
    co_return connection(std::move(p));
}

// What the listener and its tasks (the one taking requests, one per handshake) share; each
// task holds it, so it lives until the last of them ended.
struct listener::state {
    // An established connection, or the listener's own failure for a request (thrown by the
    // accept() that takes it).
    struct outcome {
        connection made;
        std::exception_ptr failure;
    };

    io_context* io = nullptr;
    connection_options options;
    std::vector<std::byte> private_data;
    std::shared_ptr<cm_channel> events;
    std::optional<cm_id> id; // reset by ~listener: no more requests
    // Any address: the IPv4 listening id beside `id` (IPv6 only), on the same port.
    std::optional<cm_id> id4;
    std::uint16_t port = 0;
    std::deque<outcome> ready;    // for accept(), in the order the handshakes ended
    detail::waiter_queue waiters; // accept()s waiting for `ready`
    std::uint32_t handshakes = 0; // under way
    // Handshakes under way per peer host (its address without the port), for
    // connection_options::max_handshakes_per_peer. Entries go when their count is 0.
    std::unordered_map<std::string, std::uint32_t> per_peer;
    std::uint64_t rejected_busy = 0; // requests rejected "busy: ..." (listener::rejected())
    std::uint64_t made = 0;          // connections established so far
    std::stop_source stop;           // ends the handshakes under way (~listener)
    bool gone = false;               // ~listener ran
    int error = 0;                   // the event channel failed: no more requests come
    std::string failure;             // its text

    // A connection or a failure for accept(): one waiting accept() is resumed for it.
    void deliver(outcome o) {
        ready.push_back(std::move(o));
        if (detail::waiter* w = waiters.pop_front()) w->fulfil(0);
    }
    void wake_all(int err) noexcept {
        while (detail::waiter* w = waiters.pop_front())
            w->fulfil(err);
    }
    // A handshake from `host` ended, however it ended.
    void handshake_over(const std::string& host) noexcept {
        --handshakes;
        if (auto it = per_peer.find(host); it != per_peer.end() && --it->second == 0)
            per_peer.erase(it);
    }
};

namespace {

// co_await: until the listener has something for accept() (a connection, a failure) or ends.
class listener_ready : detail::waiter {
  public:
    listener_ready(listener::state* s, const wait_options& w) : state_(s), options_(w) {}
    listener_ready(const listener_ready&) = delete;
    listener_ready& operator=(const listener_ready&) = delete;
    bool await_ready() const noexcept {
        return !state_->ready.empty() || state_->gone || state_->error != 0;
    }
    void await_suspend(std::coroutine_handle<> h) {
        wait_in(state_->waiters, *state_->io, options_, h);
    }
    void await_resume() {
        const int err = decided() ? error() : 0;
        if (err != 0) throw_system_error(err, "listener::accept");
    }

  private:
    listener::state* state_;
    wait_options options_;
};

// What rdma_accept would refuse in the listener's own options, said before the request is
// answered (a clearer message than the kernel's EINVAL, and never taken for the peer's fault).
void check_accept_options(const listener::state& s, const verbs::context& device) {
    const bool iwarp = device.native()->device->transport_type == IBV_TRANSPORT_IWARP;
    // iWARP: rdma_conn_param's 8-bit length (MPA itself allows 512); IB CM's REP: 196.
    const std::size_t room = iwarp ? 255 : 196;
    if (s.private_data.size() > room)
        throw_system_error(EINVAL, "rdma_accept (connection_options::private_data is " +
                                       std::to_string(s.private_data.size()) +
                                       " bytes; an accept carries at most " + std::to_string(room) +
                                       " on this transport)");
    ibv_device_attr attr{};
    if (const int rc = ibv_query_device(device.native(), &attr); rc != 0)
        throw_system_error(rc, "ibv_query_device");
    const cm_conn_options& c = s.options.conn;
    if (c.initiator_depth > attr.max_qp_init_rd_atom || c.responder_resources > attr.max_qp_rd_atom)
        throw_system_error(EINVAL,
                           "rdma_accept (cm_conn_options: initiator_depth " +
                               std::to_string(c.initiator_depth) + ", responder_resources " +
                               std::to_string(c.responder_resources) + "; the device allows " +
                               std::to_string(attr.max_qp_init_rd_atom) + " and " +
                               std::to_string(attr.max_qp_rd_atom) + ")");
}

// `why` is what the peer reads (private data: at most 148 bytes on IB/RoCE, "busy: " included);
// `cause`, when given, goes to the diagnostics sink only.
void reject_busy(listener::state& s, cm_id& request, const std::string& from, const char* why,
                 const char* cause = nullptr) {
    const std::string text = std::string("busy: ") + why;
    ++s.rejected_busy;
    detail::diagnose("listener on port %u: the request from %s was rejected: %s%s%s%s",
                     static_cast<unsigned>(s.port), from.c_str(), text.c_str(),
                     cause != nullptr ? " (" : "", cause != nullptr ? cause : "",
                     cause != nullptr ? ")" : "");
    try {
        request.reject(std::as_bytes(std::span(text.data(), text.size())));
    } catch (const std::exception& e) {
        detail::diagnose("listener on port %u: %s", static_cast<unsigned>(s.port), e.what());
    }
}

// The errnos of making a connection's CQ, QP and receive buffers when the process or the
// device has no room for one more: locked memory (ENOMEM under RLIMIT_MEMLOCK), fds (EMFILE,
// ENFILE), the device's limits (ENOSPC, ENOBUFS, EAGAIN), a quota (EDQUOT).
bool out_of_resources(int err) noexcept {
    switch (err) {
    case ENOMEM:
    case EMFILE:
    case ENFILE:
    case ENOSPC:
    case ENOBUFS:
    case EAGAIN:
    case EDQUOT:
        return true;
    default:
        return false;
    }
}

// Whether the kernel gave this request up (the peer rejected, disconnected or went after
// sending it): its IB CM id then refuses what a live request allows, a QP's attributes for
// INIT (EINVAL; ib_cm's init_qp_attr outside REQ_SENT..ESTABLISHED). The iWARP CM answers
// them in IDLE too, so there this says false; a peer gone before the accept shows there as
// rdma_accept's ECONNRESET (handshake()).
bool request_withdrawn(const cm_id& id) {
    rdma_cm_id* raw = id.native();
    if (raw == nullptr) return true;
    ibv_qp_attr attr{};
    attr.qp_state = IBV_QPS_INIT;
    int mask = 0;
    errno = 0;
    return rdma_init_qp_attr(raw, &attr, &mask) != 0 && errno == EINVAL;
}

// One request's handshake: its CQ and qp, then rdma_accept until established (step_timeout).
// Never throws: the connection or the listener's own failure goes to accept(), the peer's
// failure to the diagnostics sink.
task<void> handshake(std::shared_ptr<listener::state> s, cm_id request, std::string from,
                     std::string host) {
    std::unique_ptr<connection::parts> p;
    bool ours = true;
    bool equipping = true; // making the CQ, QP and receives, checking the options
    try {
        p = std::make_unique<connection::parts>(s->events, std::move(request));
        p->peer_data.assign(p->id.request_data().begin(), p->id.request_data().end());
        p->equip(*s->io, s->options);
        check_accept_options(*s, p->device->device);
        equipping = false;
        ours = false;
        try {
            co_await p->id.accept_connection(
                s->private_data, wait_options(s->options.step_timeout, s->stop.get_token()),
                s->options.conn);
        } catch (const std::system_error& e) {
            // Refused before the answer went out: our options (the peer has not seen a REP);
            // unless the connection was reset (siw: rdma_accept of a request whose peer closed
            // its TCP stream fails ECONNRESET), which is the peer's doing.
            ours = p->id.awaiting_answer() && e.code() != std::errc::connection_reset &&
                   e.code() != std::errc::connection_aborted;
            throw;
        } catch (...) {
            ours = p->id.awaiting_answer();
            throw;
        }
    } catch (const std::exception& e) {
        s->handshake_over(host);
        if (s->gone) co_return; // the request goes with p (rejected if unanswered)
        if (!p) { // no memory for its parts: the request goes unanswered (~cm_id rejects it)
            detail::diagnose("listener on port %u: the request from %s was rejected: %s",
                             static_cast<unsigned>(s->port), from.c_str(), e.what());
            co_return;
        }
        // EINVAL from making the request's QP (rdma_create_qp, rdma_init_qp_attr) once the
        // kernel gave the request up is the peer's failure, not the listener's (hostile
        // 'vanish' ended reverse_server through accept()); with the request still live it is
        // ours (a QP the device refuses for our options).
        const auto* se = dynamic_cast<const std::system_error*>(&e);
        const int err = se != nullptr ? se->code().value() : 0;
        if (ours && err == EINVAL && request_withdrawn(p->id)) ours = false;
        // Out of resources for another connection while making it (locked memory, fds, the
        // device's QPs or CQs), once this listener has made one: a load condition like the
        // bounds above, not a failure of the listener. The peer is told "busy" and may come
        // back; accept() goes on (a client holding connections until the server's memlock
        // limit ran out ended reverse_server). Before any connection was made it is the
        // listener's setup (a memlock limit too small for even one): thrown from accept().
        if (ours && equipping && s->made > 0 && p->id.awaiting_answer() &&
            (out_of_resources(err) || dynamic_cast<const std::bad_alloc*>(&e) != nullptr)) {
            reject_busy(*s, p->id, from, "no resources for another connection", e.what());
            co_return;
        }
        if (ours) {
            detail::diagnose("listener on port %u: the request from %s was rejected: %s",
                             static_cast<unsigned>(s->port), from.c_str(), e.what());
            try {
                s->deliver({connection(nullptr), std::current_exception()});
            } catch (...) {
                // Out of memory: the failure is in the log.
            }
        } else {
            detail::diagnose("listener on port %u: the connection from %s was dropped: %s",
                             static_cast<unsigned>(s->port), from.c_str(), e.what());
        }
        co_return;
    }
    s->handshake_over(host);
    ++s->made;
    if (s->gone) co_return; // nobody accepts it any more: ~connection disconnects
    try {
        s->deliver({connection(std::move(p)), nullptr});
    } catch (const std::exception& e) {
        detail::diagnose("listener on port %u: the connection from %s was dropped: %s",
                         static_cast<unsigned>(s->port), from.c_str(), e.what());
    }
}

// Each request of the listening id (cm_id::on_request, called from the loop as it is read):
// its handshake starts at once, concurrently with the others, or it is rejected when the
// bounds are reached. Not a task of its own, so an idle listener keeps no io_context::run()
// from returning.
void take_request(const std::shared_ptr<listener::state>& s, cm_id request, int error) {
    if (error != 0) {
        s->error = error;
        s->failure =
            std::string("the listening id failed: ") + std::system_category().message(error);
        detail::diagnose("listener on port %u: no more requests: %s",
                         static_cast<unsigned>(s->port), s->failure.c_str());
        s->wake_all(error);
        return;
    }
    const std::string from = detail::address_text(rdma_get_peer_addr(request.native()));
    std::string host = detail::peer_host(rdma_get_peer_addr(request.native()));
    const connection_options& o = s->options;
    if (s->handshakes >= o.max_handshakes) {
        reject_busy(*s, request, from, "too many handshakes under way");
        return;
    }
    // One host holding unfinished handshakes (a silent or stopped client, a flood) takes at
    // most its share: the others' requests still find room.
    if (const auto it = s->per_peer.find(host); o.max_handshakes_per_peer != 0 &&
                                                it != s->per_peer.end() &&
                                                it->second >= o.max_handshakes_per_peer) {
        reject_busy(*s, request, from, "too many handshakes under way from your address");
        return;
    }
    if (s->ready.size() + s->handshakes >= o.accept_queue) {
        reject_busy(*s, request, from, "too many connections not yet accepted");
        return;
    }
    try {
        ++s->per_peer[host];
    } catch (const std::exception&) { // out of memory: rejected as ~cm_id does
        return;
    }
    ++s->handshakes;
    try {
        s->io->spawn(handshake(s, std::move(request), from, host));
    } catch (const std::exception& e) { // out of memory for its frame: rejected
        s->handshake_over(host);
        detail::diagnose("listener on port %u: the request from %s was rejected: %s",
                         static_cast<unsigned>(s->port), from.c_str(), e.what());
    }
}

} // namespace

listener::listener(io_context& io, std::string_view address, connection_options options,
                   int backlog)
    : state_(std::make_shared<state>()) {
    state& s = *state_;
    s.io = &io;
    s.options = options;
    s.options.private_data = {};
    s.private_data.assign(options.private_data.begin(), options.private_data.end());
    s.events = std::make_shared<cm_channel>(io);
    s.id.emplace(*s.events);
    std::string host, port;
    detail::split_host_port(address, host, port, "ringverbs::listener");
    auto bind_and_listen = [&](cm_id& id, const std::string& on, const std::string& at,
                               int afonly) {
        rdma_addrinfo* found = nullptr;
        if (const int code = lookup_now(on, at, true, true, &found); code != 0)
            throw_lookup(code, on, at);
        const addrinfo_ptr keep(found, rdma_freeaddrinfo);
        if (found->ai_src_addr == nullptr)
            throw_system_error(EINVAL, "rdma_getaddrinfo (no address to listen on in \"" +
                                           std::string(address) + "\")");
        if (afonly >= 0) {
            // Whatever net.ipv6.bindv6only says.
            errno = 0;
            if (rdma_set_option(id.native(), RDMA_OPTION_ID, RDMA_OPTION_ID_AFONLY, &afonly,
                                sizeof afonly) != 0)
                throw_system_error(errno != 0 ? errno : EIO,
                                   "rdma_set_option(RDMA_OPTION_ID_AFONLY)");
        }
        id.listen(found->ai_src_addr, backlog);
    };
    if (!host.empty()) {
        bind_and_listen(*s.id, host, port, -1);
    } else {
        // Any address: an IPv6-only id on "::" and an IPv4 one on "0.0.0.0", same port; IPv4's
        // alone where the kernel has no IPv6. Not one dual-stack id: on iWARP (siw) an IPv4
        // request to a "::" listener arrives with IPv4-mapped addresses no device has, and is
        // refused (MPA reject, -ECONNRESET); IB/RoCE take it either way.
        bool v6 = true;
        try {
            bind_and_listen(*s.id, "::", port, 1);
        } catch (const std::system_error& e) {
            if (e.code().value() != EAFNOSUPPORT && e.code().value() != EADDRNOTAVAIL) throw;
            v6 = false;
            s.id.emplace(*s.events);
            bind_and_listen(*s.id, "0.0.0.0", port, -1);
        }
        if (v6) {
            s.id4.emplace(*s.events);
            bind_and_listen(*s.id4, "0.0.0.0", std::to_string(s.id->local_port()), -1);
        }
    }
    s.port = s.id->local_port();
    for (std::optional<cm_id>* id : {&s.id, &s.id4}) {
        if (!*id) continue;
        (*id)->on_request([weak = std::weak_ptr<state>(state_)](cm_id request, int error) {
            if (auto locked = weak.lock()) take_request(locked, std::move(request), error);
        });
    }
}

listener::~listener() {
    state& s = *state_;
    s.gone = true;
    s.id.reset(); // no more requests (its handler goes with it)
    s.id4.reset();
    s.stop.request_stop(); // the handshakes under way end
    s.wake_all(ECANCELED);
    s.ready.clear(); // connections nobody took: disconnected
}

std::uint16_t listener::port() const noexcept {
    return state_->port;
}
cm_id& listener::id() noexcept {
    return *state_->id;
}
cm_channel& listener::events() noexcept {
    return *state_->events;
}

std::uint32_t listener::handshakes() const noexcept {
    return state_->handshakes;
}
std::uint32_t listener::waiting() const noexcept {
    return static_cast<std::uint32_t>(state_->ready.size());
}
std::uint64_t listener::rejected() const noexcept {
    return state_->rejected_busy;
}

task<connection> listener::accept(wait_options w) {
    const std::shared_ptr<state> s = state_;
    // The bound counts from this call: woken for an outcome another accept() took first, this
    // one waits again for what is left of it, not for a new bound.
    using clock = std::chrono::steady_clock;
    const clock::time_point start = clock::now();
    const bool bounded = w.timeout != wait_options::no_timeout &&
                         w.timeout < clock::time_point::max() - start; // else: no overflow
    const clock::time_point deadline = bounded ? start + w.timeout : clock::time_point::max();
    for (;;) {
        if (w.stop.stop_requested()) { // wins over a ready connection: it stays for the next
            // This accept() may be the one deliver() woke for it: pass the wake-up on.
            if (!s->ready.empty())
                if (detail::waiter* next = s->waiters.pop_front()) next->fulfil(0);
            throw_system_error(ECANCELED, "listener::accept");
        }
        if (!s->ready.empty()) {
            state::outcome o = std::move(s->ready.front());
            s->ready.pop_front();
            if (o.failure) std::rethrow_exception(o.failure);
            co_return std::move(o.made);
        }
        if (s->gone) throw_system_error(ECANCELED, "listener::accept (the listener is gone)");
        if (s->error != 0) throw_system_error(s->error, "listener::accept (" + s->failure + ")");
        // Resumed for an outcome another accept() may take first: then it waits again, until
        // the same deadline.
        wait_options left = w; // a variable, not a temporary in the co_await (GCC 12)
        if (bounded) {
            const clock::time_point now = clock::now();
            if (now >= deadline) throw_system_error(ETIMEDOUT, "listener::accept");
            left.timeout = deadline - now;
        }
        co_await listener_ready(s.get(), left);
    }
}

} // namespace ringverbs
