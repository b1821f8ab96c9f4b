// connection, connect() and listener: rdma_getaddrinfo, the rdma_cm steps with their bound, and
// the per-device resources shared between connections.
#include <ringverbs/cm/connection.hpp>

#include <ringverbs/engine/diagnostics.hpp>
#include <ringverbs/engine/error.hpp>
#include <ringverbs/engine/poll.hpp>

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <charconv>
#include <map>
#include <mutex>
#include <optional>
#include <system_error>
#include <thread>
#include <utility>

namespace ringverbs {

namespace detail {

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
    } else {
        const auto colon = text.rfind(':');
        if (colon == std::string_view::npos) bad("expected \"host:port\"");
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
// entries go stale when their last connection goes; they are replaced, not kept growing.
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
        if (e.io == &io && e.device == dev.device.native() && same(e.options, o))
            if (auto ch = e.ch.lock()) return ch;
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

// The rdma_cm event channel connect() uses on this thread's io_context.
std::shared_ptr<cm_channel> cm_channel_of(io_context& io) {
    thread_local std::vector<std::pair<io_context*, std::weak_ptr<cm_channel>>> channels;
    std::pair<io_context*, std::weak_ptr<cm_channel>>* stale = nullptr;
    for (auto& e : channels) {
        if (e.first == &io)
            if (auto ch = e.second.lock()) return ch;
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
    auto job = std::make_shared<lookup_job>();
    job->host = host;
    job->port = port;
    job->efd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (job->efd < 0) throw_system_error(errno, "eventfd (for rdma_getaddrinfo's thread)");
    std::thread([job] {
        job->code = lookup_now(job->host, job->port, false, false, &job->result);
        job->done.store(true, std::memory_order_release);
        const std::uint64_t one = 1;
        [[maybe_unused]] const auto n = ::write(job->efd, &one, sizeof one);
    }).detach();
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
            const auto needed = std::size_t{caps.max_send_wr} + caps.max_recv_wr;
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

recv_ring::next_awaitable connection::receive(wait_options w) {
    if (!parts_->ring)
        throw_system_error(EINVAL, "connection::receive (no recv_ring: set "
                                   "connection_options::receive_slots)");
    return parts_->ring->next(std::move(w));
}
recv_ring* connection::receives() noexcept {
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

task<connection> connect(io_context& io, std::string address, connection_options options,
                         std::stop_token stop) {
    std::string host, port;
    detail::split_host_port(address, host, port, "ringverbs::connect");
    if (host.empty())
        throw_system_error(EINVAL, "ringverbs::connect (address \"" + address +
                                       "\": no host to connect to)");
    const std::vector<std::byte> data(options.private_data.begin(), options.private_data.end());
    const wait_options step(options.step_timeout, stop);
    addrinfo_ptr found = co_await lookup(io, host, port, step);

    std::shared_ptr<cm_channel> events = cm_channel_of(io);
    auto p = std::make_unique<connection::parts>(events, cm_id(*events));
    co_await p->id.resolve_addr(found->ai_dst_addr, step);
    co_await p->id.resolve_route(step);
    p->equip(io, options);
    p->peer_data = co_await p->id.connect(data, step, options.conn);
    co_return connection(std::move(p));
}

struct listener::state {
    io_context* io = nullptr;
    connection_options options;
    std::vector<std::byte> private_data;
    std::shared_ptr<cm_channel> events;
    std::optional<cm_id> id; // reset by ~listener: its waiting accept()s end
    std::uint16_t port = 0;
};

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
    auto bind_and_listen = [&](const std::string& on, bool dual_stack) {
        rdma_addrinfo* found = nullptr;
        if (const int code = lookup_now(on, port, true, true, &found); code != 0)
            throw_lookup(code, on, port);
        const addrinfo_ptr keep(found, rdma_freeaddrinfo);
        if (found->ai_src_addr == nullptr)
            throw_system_error(EINVAL, "rdma_getaddrinfo (no address to listen on in \"" +
                                           std::string(address) + "\")");
        if (dual_stack) {
            // Whatever net.ipv6.bindv6only says: IPv4 requests too.
            int zero = 0;
            errno = 0;
            if (rdma_set_option(s.id->native(), RDMA_OPTION_ID, RDMA_OPTION_ID_AFONLY, &zero,
                                sizeof zero) != 0)
                throw_system_error(errno != 0 ? errno : EIO,
                                   "rdma_set_option(RDMA_OPTION_ID_AFONLY)");
        }
        s.id->listen(found->ai_src_addr, backlog);
    };
    if (!host.empty()) {
        bind_and_listen(host, false);
    } else {
        // Any address: IPv6's, taking IPv4 requests too; IPv4's where the kernel has no IPv6.
        try {
            bind_and_listen("::", true);
        } catch (const std::system_error& e) {
            if (e.code().value() != EAFNOSUPPORT && e.code().value() != EADDRNOTAVAIL) throw;
            s.id.emplace(*s.events);
            bind_and_listen("0.0.0.0", false);
        }
    }
    s.port = s.id->local_port();
}

listener::~listener() {
    // Waiting accept()s resume with operation_canceled; one in a handshake finds the id gone
    // when that ends (its frame shares this state).
    state_->id.reset();
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

task<connection> listener::accept(wait_options w) {
    const std::shared_ptr<state> s = state_;
    for (;;) {
        if (!s->id) throw_system_error(ECANCELED, "listener::accept (the listener is gone)");
        cm_id request = co_await s->id->accept(w);
        const std::string from = detail::address_text(rdma_get_peer_addr(request.native()));
        auto p = std::make_unique<connection::parts>(s->events, std::move(request));
        p->peer_data.assign(p->id.request_data().begin(), p->id.request_data().end());
        // A failure here is ours (EMFILE, ENOMEM): it is thrown; the request, dropped with p,
        // is rejected.
        p->equip(*s->io, s->options);
        bool established = false;
        std::string why;
        try {
            co_await p->id.accept_connection(
                s->private_data, wait_options(s->options.step_timeout, w.stop), s->options.conn);
            established = true;
        } catch (const std::system_error& e) {
            if (w.stop.stop_requested()) throw;
            why = e.what();
        }
        if (established) co_return connection(std::move(p));
        detail::diagnose("listener on port %u: the connection from %s was dropped: %s",
                         static_cast<unsigned>(s->port), from.c_str(), why.c_str());
    }
}

} // namespace ringverbs
