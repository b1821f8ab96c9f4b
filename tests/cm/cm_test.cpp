// rdma_cm on the io_context: resolve, connect, listen/accept, reject, disconnect, all through
// one event channel, with the process connecting to itself over the test device's address.
#include "cm_fixture.hpp"

#include <ringverbs/cm/cm_id.hpp>
#include <ringverbs/engine/timer.hpp>
#include <ringverbs/engine/when_all.hpp>
#include <ringverbs/rdma/completion_error.hpp>

#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <future>
#include <memory>
#include <optional>
#include <stop_token>
#include <string>
#include <thread>
#include <vector>

using namespace rt;
using namespace std::chrono_literals;

namespace {

// Resolves `to` on `id` (address and route), as a connecting id does first.
task<void> resolve(cm_id& id, const sockaddr_in& to) {
    co_await id.resolve_addr(sa(to), wait_options(5s));
    co_await id.resolve_route(wait_options(5s));
}

// What a connecting id needs before connect(), made on the device resolution found: a PD, a
// completion channel, a CQ and the id's qp.
struct connector {
    std::optional<verbs::context> dev;
    std::optional<verbs::protection_domain> pd;
    std::optional<channel> comp;
    std::optional<cq> c;
    std::optional<qp> q;

    // Resolves `to` on `id` and makes the rest.
    task<void> prepare(io_context& io, cm_id& id, const sockaddr_in& to) {
        co_await resolve(id, to);
        dev.emplace(id.device());
        pd.emplace(*dev);
        comp.emplace(io, *dev);
        c.emplace(*comp);
        q.emplace(id.make_qp(*pd, *c, *c));
    }
};

// What co_await id.disconnect(3 s) ended with on `io` (0, or the errno it threw) and how long
// it took. Logs both.
struct disconnect_outcome {
    int err = -1;
    std::chrono::milliseconds took{};
};
disconnect_outcome timed_disconnect(io_context& io, cm_id& id) {
    const auto t0 = std::chrono::steady_clock::now();
    auto run = [&]() -> task<result<void>> {
        co_return co_await nothrow(id.disconnect(wait_options(3s)));
    };
    const result<void> r = io.run(run());
    disconnect_outcome o{r ? 0 : r.error().value(),
                         std::chrono::duration_cast<std::chrono::milliseconds>(
                             std::chrono::steady_clock::now() - t0)};
    MESSAGE("disconnect: errno " << o.err << " after " << o.took.count() << " ms");
    return o;
}

} // namespace

TEST_CASE_FIXTURE(listening,
                  "self-connect: one event channel listens and connects; private data both ways; "
                  "a verified message; disconnect seen by the other side") {
    CHECK(listener.local_port() != 0); // bound: the kernel picked a port
    region out(pd, 4096), in(pd, 4096);
    fill(out.bytes, 77);
    const auto hello = bytes_of("hello from the connector");
    const auto welcome = bytes_of("welcome, says the listener");
    std::vector<std::byte> request_seen, accept_seen;
    bool server_saw_disconnect = false;

    auto server = [&]() -> task<std::uint32_t> {
        cm_id conn = co_await listener.accept(wait_options(10s));
        request_seen.assign(conn.request_data().begin(), conn.request_data().end());
        qp q = conn.make_qp(pd, cq_server, cq_server);
        auto r = q.recv(in.all());
        r.post(); // before accepting: the first message must find it
        co_await conn.accept_connection(welcome, wait_options(10s));
        ibv_wc wc = co_await r;
        co_await conn.disconnected(wait_options(10s));
        server_saw_disconnect = conn.is_disconnected();
        co_return wc.byte_len;
    };
    auto client = [&]() -> task<void> {
        cm_id id(events);
        co_await resolve(id, at);
        qp q = id.make_qp(pd, cq_client, cq_client);
        accept_seen = co_await id.connect(hello, wait_options(10s));
        co_await q.send(out.local(0, 1500));
        co_await id.disconnect(wait_options(10s));
        CHECK(id.is_disconnected());
    };
    auto [len, done] = io.run(when_all(server(), client()));
    (void)done;
    CHECK(len == 1500);
    CHECK(std::memcmp(in.bytes.data(), out.bytes.data(), 1500) == 0);
    CHECK(starts_with(request_seen, hello));
    CHECK(starts_with(accept_seen, welcome));
    CHECK(server_saw_disconnect);
    CHECK(events.events() >= 6);
    MESSAGE("rdma_cm events: " << events.events() << ", request data " << request_seen.size()
                               << " bytes, accept data " << accept_seen.size() << " bytes");
}

// IB/RoCE only: iWARP has no RNR (a SEND that finds no receive posted ends the connection).
TEST_CASE_FIXTURE(listening,
                  "a server that never posts a receive: the client's send ends with RNR (finite "
                  "rnr_retry_count by default) instead of stalling the connection" *
                      doctest::test_suite(ringverbs::test::ib_roce_only)) {
    region out(pd, 4096);
    fill(out.bytes, 5);
    std::optional<completion_error> failure;
    std::chrono::steady_clock::duration took{};
    auto server = [&]() -> task<void> {
        cm_id conn = co_await listener.accept(wait_options(10s));
        qp q = conn.make_qp(pd, cq_server, cq_server); // and never a receive
        co_await conn.accept_connection({}, wait_options(10s));
        co_await conn.disconnected(wait_options(120s));
    };
    auto client = [&]() -> task<void> {
        cm_id id(events);
        co_await resolve(id, at);
        qp q = id.make_qp(pd, cq_client, cq_client);
        co_await id.connect({}, wait_options(10s));
        const auto start = std::chrono::steady_clock::now();
        try {
            co_await q.send(out.local(0, 100), {}, wait_options(90s));
        } catch (const completion_error& e) {
            failure = e;
        }
        took = std::chrono::steady_clock::now() - start;
        co_await id.disconnect(wait_options(10s));
    };
    io.run(when_all(server(), client()));
    REQUIRE(failure.has_value());
    CHECK(failure->status() == IBV_WC_RNR_RETRY_EXC_ERR);
    CHECK(std::string(failure->what()).find("no receive posted (RNR)") != std::string::npos);
    MESSAGE("rdma_cm connection: RNR gave up after "
            << std::chrono::duration_cast<std::chrono::milliseconds>(took).count() << " ms");
}

TEST_CASE("connect where nothing listens: refused, and the message says so") {
    const std::string ip = test_addr();
    const sockaddr_in at = addr_at(ip, 20872); // nobody listens here
    io_context io;
    cm_channel events(io);
    cm_id id(events);
    connector parts;
    auto attempt = [&]() -> task<void> {
        co_await parts.prepare(io, id, at);
        co_await id.connect({}, wait_options(10s));
    };
    auto t0 = std::chrono::steady_clock::now();
    try {
        io.run(attempt());
        FAIL("connect succeeded with nobody listening");
    } catch (const std::system_error& e) {
        MESSAGE(std::string(e.what()));
        CHECK(errc_of(e) == std::errc::connection_refused);
        CHECK(std::string(e.what()).find("rdma_connect") != std::string::npos);
        CHECK(std::string(e.what()).find("nothing listens") != std::string::npos);
        const auto* rejected = dynamic_cast<const connection_rejected*>(&e);
        REQUIRE(rejected != nullptr);
        CHECK(rejected->nothing_listens());
        CHECK_FALSE(rejected->by_peer_application());
    }
    CHECK(std::chrono::steady_clock::now() - t0 < 10s); // before the connect's own bound
}

// Review (issue 22), finding 3: rdma_disconnect on an id whose connection was never
// established may return 0 without sending anything (IB CM has nothing to send a DREQ for),
// so no DISCONNECTED comes: disconnect() must not wait for one.
TEST_CASE("disconnect() of an id that never got connected returns at once: resolved with a qp, "
          "or after a refused connect") {
    const std::string ip = test_addr();
    io_context io;
    cm_channel events(io);

    SUBCASE("resolved, a qp, never connected") {
        cm_id id(events);
        connector parts;
        io.run(parts.prepare(io, id, addr_at(ip, 20885)));
        const disconnect_outcome d = timed_disconnect(io, id);
        CHECK(d.err == 0);
        CHECK(d.took < 3s); // before its 3 s bound: it did not wait for an event
        CHECK(id.is_disconnected());
    }
    SUBCASE("after a connect that was refused (nothing listens)") {
        cm_id id(events);
        connector parts;
        auto attempt = [&]() -> task<bool> {
            co_await parts.prepare(io, id, addr_at(ip, 20886)); // nobody listens here
            try {
                co_await id.connect({}, wait_options(10s));
            } catch (const connection_rejected& e) {
                co_return e.nothing_listens();
            }
            co_return false;
        };
        REQUIRE(io.run(attempt()));
        const disconnect_outcome d = timed_disconnect(io, id);
        CHECK(d.err == 0);
        CHECK(d.took < 3s); // before its 3 s bound: it did not wait for an event
        CHECK(id.is_disconnected());
    }
}

// Only in the VM (see below): the connect's request goes nowhere and is still outstanding.
TEST_CASE("disconnect() after a connect that timed out returns at once" *
          doctest::skip(!in_our_vm())) {
    const std::string ip = test_addr();
    sockaddr_in nobody = addr_at(ip, 20887);
    reinterpret_cast<unsigned char*>(&nobody.sin_addr)[3] = 77; // x.y.z.77: no host
    io_context io;
    cm_channel events(io);
    cm_id id(events);
    connector parts;
    auto attempt = [&]() -> task<int> {
        co_await parts.prepare(io, id, nobody);
        try {
            co_await id.connect({}, wait_options(1s));
        } catch (const std::system_error& e) {
            co_return e.code().value();
        }
        co_return 0;
    };
    REQUIRE(io.run(attempt()) == ETIMEDOUT);
    const disconnect_outcome d = timed_disconnect(io, id);
    CHECK(d.err == 0);
    CHECK(d.took < 3s);
}

// Only inside tools/softroce-vm, where the device sits on a dummy netdev with no NIC: the
// request to an address on its subnet that nobody has goes nowhere (on a real network it
// would reach a real wire).
TEST_CASE("connect to an address nobody has: ends within the channel's default step bound, "
          "timed_out naming rdma_connect" *
          doctest::skip(!in_our_vm())) {
    const std::string ip = test_addr();
    sockaddr_in nobody = addr_at(ip, 20884);
    reinterpret_cast<unsigned char*>(&nobody.sin_addr)[3] = 77; // x.y.z.77: no host
    io_context io;
    cm_channel events(io); // the default cm_channel_options: step_timeout 15 s
    cm_id id(events);
    connector parts;
    std::chrono::steady_clock::time_point connect_started;
    auto attempt = [&]() -> task<void> {
        co_await parts.prepare(io, id, nobody); // a dummy netdev resolves every neighbour at once
        connect_started = std::chrono::steady_clock::now();
        co_await id.connect(); // no wait_options: the channel's bound applies
    };
    try {
        io.run(attempt());
        FAIL("connect succeeded to an address nobody has");
    } catch (const std::system_error& e) {
        MESSAGE(std::string(e.what()));
        CHECK(errc_of(e) == std::errc::timed_out);
        CHECK(std::string(e.what()).find("rdma_connect") != std::string::npos);
        CHECK(std::string(e.what()).find("step_timeout") != std::string::npos);
    }
    const auto waited = std::chrono::steady_clock::now() - connect_started;
    MESSAGE("connect ended after "
            << std::chrono::duration_cast<std::chrono::milliseconds>(waited).count() << " ms");
    // Ended by the bound (not by something earlier), and not much after it.
    CHECK(waited >= 14s);
    CHECK(waited < 60s);
}

TEST_CASE_FIXTURE(
    listening,
    "the listener rejects with private data: the connector's error carries reason and data") {
    cq& c = cq_client;
    const auto why = bytes_of("go away: full");
    auto server = [&]() -> task<void> {
        cm_id conn = co_await listener.accept(wait_options(10s));
        conn.reject(why);
    };
    auto client = [&]() -> task<int> {
        cm_id id(events);
        co_await resolve(id, at);
        qp q = id.make_qp(pd, c, c);
        try {
            co_await id.connect(bytes_of("let me in"), wait_options(10s));
        } catch (const connection_rejected& e) {
            MESSAGE(std::string(e.what()));
            CHECK(errc_of(e) == std::errc::connection_refused);
            CHECK(e.by_peer_application());
            CHECK(std::string(e.what()).find("rdma_connect") != std::string::npos);
            CHECK(std::string(e.what()).find("rejected by the peer application") !=
                  std::string::npos);
            CHECK(starts_with(e.private_data(), why));
            co_return e.reason();
        }
        co_return -1;
    };
    auto [done, reason] = io.run(when_all(server(), client()));
    (void)done;
    if (rdma_device().iwarp)
        CHECK(reason < 0); // the provider's negative errno (siw: -ECONNRESET), not IB CM's
    else
        CHECK(reason == 28); // IB CM's consumer reject
}

TEST_CASE("resolve_addr of an address with no route fails fast with a clear error") {
    // 198.19.0.1: no route inside the VM (and no NIC leaves it): nothing is sent anywhere.
    const sockaddr_in nowhere = addr_at("198.19.0.1", 20874);
    io_context io;
    cm_channel events(io);
    cm_id id(events);
    auto attempt = [&]() -> task<void> { co_await id.resolve_addr(sa(nowhere), wait_options(3s)); };
    const auto t0 = std::chrono::steady_clock::now();
    try {
        io.run(attempt());
        FAIL("resolve_addr succeeded for an unroutable address");
    } catch (const std::system_error& e) {
        MESSAGE(std::string(e.what()));
        CHECK(std::string(e.what()).find("rdma_resolve_addr") != std::string::npos);
        CHECK(errc_of(e) != std::errc::timed_out);
        CHECK(errc_of(e) != std::errc::operation_canceled);
    }
    CHECK(std::chrono::steady_clock::now() - t0 < 3s); // before its bound: it failed, not waited
}

TEST_CASE("accept: a timeout, a stop_token, and a destroyed listener end the wait") {
    const std::string ip = test_addr();
    io_context io;
    cm_channel events(io);
    cm_id listener(events);
    listener.listen(sa(addr_at(ip, 0)));
    auto timed = [&]() -> task<std::errc> {
        try {
            (void)co_await listener.accept(wait_options(30ms));
        } catch (const std::system_error& e) {
            CHECK(std::string(e.what()).find("cm_id::accept") != std::string::npos);
            co_return errc_of(e);
        }
        co_return std::errc{};
    };
    const auto t0 = std::chrono::steady_clock::now();
    CHECK(io.run(timed()) == std::errc::timed_out);
    CHECK(std::chrono::steady_clock::now() - t0 < 3s); // 30 ms, and a slow guest's turns

    std::stop_source src;
    auto stopped = [&]() -> task<std::errc> {
        co_return errc_of(co_await nothrow(listener.accept(wait_options(src.get_token()))));
    };
    auto stopper = [&]() -> task<void> {
        co_await sleep_for(io, 10ms);
        src.request_stop();
    };
    auto [err, done] = io.run(when_all(stopped(), stopper()));
    (void)done;
    CHECK(err == std::errc::operation_canceled);

    // A listener destroyed under a waiting accept(): operation_canceled.
    auto holder = std::make_unique<cm_id>(events);
    holder->listen(sa(addr_at(ip, 0)));
    auto orphaned = [&]() -> task<std::errc> {
        co_return errc_of(co_await nothrow(holder->accept()));
    };
    auto killer = [&]() -> task<void> {
        co_await sleep_for(io, 10ms);
        holder.reset();
    };
    auto [err2, done2] = io.run(when_all(orphaned(), killer()));
    (void)done2;
    CHECK(err2 == std::errc::operation_canceled);
}

TEST_CASE("lifetime: ids keep their event channel serving, a qp keeps its id") {
    const std::string ip = test_addr();
    io_context io;
    auto events = std::make_unique<cm_channel>(io);
    auto listener = std::make_unique<cm_id>(*events);
    const sockaddr_in at = listen_anywhere(*listener, ip);
    verbs::context dev = listener->device();
    verbs::protection_domain pd(dev);
    channel comp(io, dev);
    cq c(comp);
    auto connector = std::make_unique<cm_id>(*events);
    events.reset(); // the ids still need it: it keeps watching and routing
    io.run(resolve(*connector, at));
    auto q = std::make_unique<qp>(connector->make_qp(pd, c, c));
    // rdma_cm moves an IB/RoCE QP to INIT at once; an iWARP QP stays in RESET until the iWARP
    // CM connects it (and siw's ibv_query_qp reports RESET whatever the state).
    CHECK(q->native_qp().state() == (rdma_device().iwarp ? IBV_QPS_RESET : IBV_QPS_INIT));
    connector.reset(); // the qp holds the rdma_cm_id: rdma_destroy_qp comes first
    CHECK(q->qp_num() != 0);
    q.reset();
    listener.reset();
}

// One side disconnects while the other has receives posted and awaited: the other side's id
// answers the DREQ, its QP goes to the error state and every posted receive resumes flushed.
// Run with the connector disconnecting, then with the listener disconnecting.
TEST_CASE_FIXTURE(listening, "disconnect from either side mid-stream: the other side's pending "
                             "receives resume flushed, none hangs") {
    bool client_leaves = true;
    SUBCASE("the client leaves") {
        client_leaves = true;
    }
    SUBCASE("the server leaves") {
        client_leaves = false;
    }
    CAPTURE(client_leaves);
    region server_in(pd, 4 * 64), client_in(pd, 4 * 64), out(pd, 64);
    fill(out.bytes, 5);
    int flushed_on_stayer = 0;
    int delivered = 0;
    bool stayer_connected = false;

    // The side that stays: 4 receives posted before it connects (or accepts), the first
    // gets a message, the other 3 must be flushed by the peer's disconnect.
    auto stay = [&](cm_id& id, qp& q, region& in, bool connector) -> task<void> {
        auto r0 = q.recv(in.local(0, 64));
        auto r1 = q.recv(in.local(64, 64));
        auto r2 = q.recv(in.local(128, 64));
        auto r3 = q.recv(in.local(192, 64));
        r0.post(), r1.post(), r2.post(), r3.post();
        if (connector)
            co_await id.connect({}, wait_options(10s));
        else
            co_await id.accept_connection({}, wait_options(10s));
        stayer_connected = true;
        co_await r0;
        ++delivered;
        for (auto* r : {&r1, &r2, &r3}) {
            try {
                (void)co_await *r;
                FAIL("a receive completed without a message");
            } catch (const completion_error& e) {
                // The peer's disconnect flushed it: connection_reset, told apart from a
                // failed request by its code, still a flush by its status.
                CHECK(e.status() == IBV_WC_WR_FLUSH_ERR);
                CHECK(e.code() == std::errc::connection_reset);
                CHECK(dynamic_cast<const connection_reset*>(&e) != nullptr);
                CHECK(std::string(e.what()).find("the connection was closed") != std::string::npos);
                ++flushed_on_stayer;
            }
        }
        co_await id.disconnected(wait_options(10s));
    };
    // The side that leaves: one message, then disconnect with a receive of its own posted
    // (flushed by its own disconnect).
    auto leave = [&](cm_id& id, qp& q, region& in, bool connector) -> task<void> {
        auto mine = q.recv(in.local(0, 64));
        mine.post();
        if (connector)
            co_await id.connect({}, wait_options(10s));
        else
            co_await id.accept_connection({}, wait_options(10s));
        // Mid-stream: both sides established first. On iWARP the accepting side is
        // established before the connecting one, and siw fails a connect whose peer has
        // closed the stream before its MPA reply was processed (CONNECT_ERROR, EINVAL).
        for (int i = 0; i < 1000 && !stayer_connected; ++i) // as long as a connect may take
            co_await sleep_for(io, 10ms);
        REQUIRE(stayer_connected);
        co_await q.send(out.local(0, 64));
        co_await id.disconnect(wait_options(10s));
        try {
            (void)co_await mine;
            FAIL("the leaver's receive completed");
        } catch (const completion_error& e) {
            CHECK(e.status() == IBV_WC_WR_FLUSH_ERR); // flushed by its own disconnect
            CHECK(e.code() == std::errc::connection_reset);
        }
    };
    auto server = [&]() -> task<void> {
        cm_id conn = co_await listener.accept(wait_options(10s));
        qp q = conn.make_qp(pd, cq_server, cq_server);
        if (client_leaves)
            co_await stay(conn, q, server_in, false);
        else
            co_await leave(conn, q, server_in, false);
    };
    auto client = [&]() -> task<void> {
        cm_id id(events);
        co_await resolve(id, at);
        qp q = id.make_qp(pd, cq_client, cq_client);
        if (client_leaves)
            co_await leave(id, q, client_in, true);
        else
            co_await stay(id, q, client_in, true);
    };
    io.run(when_all(server(), client()));
    CHECK(delivered == 1);
    CHECK(flushed_on_stayer == 3);
}

TEST_CASE_FIXTURE(
    listening, "two coroutines await disconnected(): the first destroys the id, the second reads "
               "nothing freed") {
    int ended = 0;
    bool both_wait = false; // set once both server coroutines are waiting
    auto server = [&]() -> task<void> {
        cm_id accepted = co_await listener.accept(wait_options(10s));
        auto conn = std::make_unique<cm_id>(std::move(accepted));
        auto q = std::make_unique<qp>(conn->make_qp(pd, cq_server, cq_server));
        co_await conn->accept_connection({}, wait_options(10s));
        cm_id* id = conn.get();
        // Both are woken by the same DISCONNECTED event, in this order.
        // No timeout: a timer's cancellation would let them resume in either order.
        auto first = [&]() -> task<void> {
            co_await id->disconnected();
            ++ended;
            q.reset();
            conn.reset(); // the id's state goes with its last holder
        };
        auto second = [&]() -> task<void> {
            co_await id->disconnected();
            ++ended;
        };
        // Started after the two (when_all starts them in order): they wait by then.
        auto mark = [&]() -> task<void> {
            both_wait = true;
            co_return;
        };
        co_await when_all(first(), second(), mark());
    };
    auto client = [&]() -> task<void> {
        cm_id id(events);
        co_await resolve(id, at);
        qp q = id.make_qp(pd, cq_client, cq_client);
        co_await id.connect({}, wait_options(10s));
        // The disconnect only once both server coroutines wait (else the first could end at
        // once and free the id the second is about to await). Bounded: 20 s.
        for (int i = 0; i < 2000 && !both_wait; ++i)
            co_await sleep_for(io, 10ms);
        REQUIRE(both_wait);
        co_await id.disconnect(wait_options(10s));
    };
    io.run(when_all(server(), client()));
    CHECK(ended == 2);
}

TEST_CASE_FIXTURE(listening, "migrate: a listener's thread hands an accepted request to a worker "
                             "thread, whose channel then gets its events (accept, echo, "
                             "disconnect all on the worker)") {
    std::promise<cm_channel*> ready;
    std::promise<cm_id::in_transit> handed;
    std::uint32_t worker_echoed = 0;
    std::uint64_t worker_events = 0;
    bool worker_saw_disconnect = false;
    std::string worker_failed;
    bool worker_ready = false; // the worker's own: ready is set once, either way
    std::thread worker([&] {
        try {
            io_context wio;
            cm_channel wchannel(wio);
            worker_ready = true;
            ready.set_value(&wchannel);
            std::optional<cm_id::in_transit> moving(handed.get_future().get());
            auto serve = [&]() -> task<std::uint32_t> {
                cm_id conn(wchannel, std::move(*moving));
                verbs::context dev = conn.device();
                verbs::protection_domain pd(dev);
                channel comp(wio, dev);
                cq completions(comp);
                region in(pd, 4096);
                qp q = conn.make_qp(pd, completions, completions);
                auto r = q.recv(in.all());
                r.post();
                co_await conn.accept_connection({}, wait_options(10s));
                ibv_wc wc = co_await r;
                co_await q.send(in.local(0, wc.byte_len));
                co_await conn.disconnected(wait_options(10s));
                worker_saw_disconnect = conn.is_disconnected();
                co_return wc.byte_len;
            };
            worker_echoed = wio.run(serve());
            worker_events = wchannel.events();
        } catch (const std::exception& e) {
            worker_failed = e.what();
            // Failed before its channel was handed over: the main thread waits for it.
            if (!worker_ready) ready.set_value(nullptr);
        }
    });
    cm_channel* target = ready.get_future().get();
    if (target == nullptr) {
        worker.join();
        FAIL("the worker could not make its io_context and cm_channel: " << worker_failed);
    }
    cq& completions = cq_client;
    region out(pd, 4096), back(pd, 4096);
    fill(out.bytes, 31);
    auto hand_over = [&]() -> task<void> {
        cm_id conn = co_await listener.accept(wait_options(10s));
        handed.set_value(std::move(conn).migrate(*target));
        CHECK(!conn); // the handle went with the id
    };
    bool refused_with_qp = false;
    auto client = [&]() -> task<std::uint32_t> {
        cm_id id(events);
        co_await resolve(id, at);
        qp q = id.make_qp(pd, completions, completions);
        try {
            cm_id::in_transit no = std::move(id).migrate(*target);
        } catch (const std::system_error& e) {
            refused_with_qp = errc_of(e) == std::errc::device_or_resource_busy &&
                              std::string(e.what()).find("cm_id::migrate") != std::string::npos;
        }
        auto r = q.recv(back.all());
        r.post();
        co_await id.connect({}, wait_options(10s));
        co_await q.send(out.local(0, 1000));
        ibv_wc wc = co_await r;
        co_await id.disconnect(wait_options(10s));
        co_return wc.byte_len;
    };
    std::uint32_t echoed = 0;
    try {
        auto [done, len] = io.run(when_all(hand_over(), client()));
        (void)done;
        echoed = len;
    } catch (...) {
        handed = {}; // unblocks the worker (broken promise) before the join
        worker.join();
        throw;
    }
    worker.join();
    CHECK(worker_failed == "");
    CHECK(refused_with_qp);
    CHECK(worker_echoed == 1000);
    CHECK(echoed == 1000);
    CHECK(std::memcmp(back.bytes.data(), out.bytes.data(), 1000) == 0);
    CHECK(worker_saw_disconnect);
    // ESTABLISHED and DISCONNECTED of the migrated id came through the worker's channel.
    CHECK(worker_events >= 2);
    MESSAGE("worker channel events " << worker_events << ", listener's channel "
                                     << events.events());
}

// IB/RoCE only: iWARP has no RNR (a SEND that finds no receive posted ends the connection).
TEST_CASE_FIXTURE(
    listening, "a client that asks for endless RNR retries (rnr_retry_count 7) and never posts a "
               "receive: the accepting side's send still ends with RNR, bounded by its own count" *
                   doctest::test_suite(ringverbs::test::ib_roce_only)) {
    // IB CM hands each side the RNR retry count the *other* side sent (the server's QP gets the
    // REQ's); accept_connection moves its QP to RTS itself, with its own rnr_retry_count.
    region out(pd, 4096), in(pd, 4096);
    fill(out.bytes, 9);
    std::optional<completion_error> failure;
    bool timed_out = false;
    std::chrono::steady_clock::duration took{};
    std::uint32_t client_got = 0;
    auto server = [&]() -> task<void> {
        cm_id conn = co_await listener.accept(wait_options(10s));
        qp q = conn.make_qp(pd, cq_server, cq_server);
        auto r = q.recv(in.all());
        r.post();
        co_await conn.accept_connection({}, wait_options(10s));
        ibv_wc wc = co_await r; // the client's one message: the connection works
        client_got = wc.byte_len;
        const auto start = std::chrono::steady_clock::now();
        try {
            co_await q.send(out.local(0, 100), {}, wait_options(60s));
        } catch (const completion_error& e) {
            failure = e;
        } catch (const std::system_error& e) {
            timed_out = errc_of(e) == std::errc::timed_out;
        }
        took = std::chrono::steady_clock::now() - start;
        co_await conn.disconnect(wait_options(10s));
    };
    auto client = [&]() -> task<void> {
        cm_id id(events);
        co_await resolve(id, at);
        qp q = id.make_qp(pd, cq_client, cq_client); // and never a receive
        cm_conn_options endless;
        endless.rnr_retry_count = 7;
        co_await id.connect({}, wait_options(10s), endless);
        co_await q.send(out.local(0, 64));
        co_await id.disconnected(wait_options(120s));
    };
    io.run(when_all(server(), client()));
    CHECK(client_got == 64);
    CHECK_FALSE(timed_out);
    REQUIRE(failure.has_value());
    CHECK(failure->status() == IBV_WC_RNR_RETRY_EXC_ERR);
    MESSAGE("the accepting side's send: RNR gave up after "
            << std::chrono::duration_cast<std::chrono::milliseconds>(took).count() << " ms");
}

// Review (issue 22 follow-up), finding 3: a failed channel fails each of its ids, and failing
// a listening id runs the user's request handler, which may destroy and make ids of the same
// channel while the channel walks its list of them.
TEST_CASE("a failed channel fails every id, though the request handler destroys and makes ids "
          "of that channel while it is told; an id made on it afterwards fails at once") {
    const std::string ip = test_addr();
    io_context io;
    cm_channel events(io);
    cm_id listener(events);
    listener.listen(sa(addr_at(ip, 0)));
    const std::uint16_t port = listener.local_port();
    // Listed after the listener, each waiting for disconnected(): the failure ends the waits.
    constexpr std::size_t listed = 3;
    std::vector<std::unique_ptr<cm_id>> ids;
    for (std::size_t i = 0; i < listed; ++i)
        ids.push_back(std::make_unique<cm_id>(events));
    std::vector<int> ended(listed, -1);
    // The rdma_cm file, put back by the handler so that ids can be made and destroyed there.
    const int saved = ::dup(events.fd());
    REQUIRE(saved >= 0);
    std::vector<std::unique_ptr<cm_id>> made;
    int told = 0, told_error = 0;
    listener.on_request([&](cm_id request, int error) {
        ++told;
        if (request) return; // not expected: the channel fails before it reads the request
        told_error = error;
        ::dup2(saved, events.fd());
        ids.back().reset();         // the last id listed: freed under the walk
        for (int i = 0; i < 8; ++i) // the list grows (and moves)
            made.push_back(std::make_unique<cm_id>(events));
    });
    auto wait_disconnected = [&](std::size_t i) -> task<void> {
        try {
            co_await ids[i]->disconnected(wait_options(20s));
            ended[i] = 0;
        } catch (const std::system_error& e) {
            ended[i] = e.code().value();
        }
    };
    std::optional<silent_peer> peer;
    auto breaker = [&]() -> task<void> {
        co_await sleep_for(io, 10ms); // the waits are under way
        // Break the channel for real (as in connection_test): its fd number names an eventfd,
        // so librdmacm's next rdma_get_cm_event fails. A request to the listener wakes it.
        const int efd = ::eventfd(0, EFD_CLOEXEC);
        REQUIRE(efd >= 0);
        REQUIRE(::dup2(efd, events.fd()) == events.fd());
        ::close(efd);
        peer.emplace(ip, port);
    };
    io.run(when_all(wait_disconnected(0), wait_disconnected(1), wait_disconnected(2), breaker()));
    ::close(saved);
    MESSAGE("channel error " << events.error() << "; handler told " << told << " time(s), error "
                             << told_error << "; waits ended with " << ended[0] << ", " << ended[1]
                             << ", " << ended[2]);
    REQUIRE(events.error() != 0);
    CHECK(told == 1);
    CHECK(told_error == events.error());
    CHECK(ended[0] == events.error());
    CHECK(ended[1] == events.error());
    CHECK(ended[2] == ECANCELED); // destroyed by the handler while it waited
    // Ids made on the dead channel (by the handler, and now): a step fails at once with the
    // channel's errno instead of waiting for an event nobody reads.
    made.push_back(std::make_unique<cm_id>(events));
    const sockaddr_in to = addr_at(ip, port);
    int refused = 0;
    for (auto& id : made) {
        cm_id& one = *id; // a reference for the coroutine below (its frame keeps none of ours)
        auto step = [&]() -> task<int> {
            try {
                co_await one.resolve_addr(sa(to), wait_options(5s));
            } catch (const std::system_error& e) {
                co_return e.code().value();
            }
            co_return 0;
        };
        if (io.run(step()) == events.error()) ++refused;
    }
    CHECK(refused == int(made.size()));
}
