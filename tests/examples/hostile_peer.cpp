// hostile_peer: a client that misbehaves on purpose, on raw librdmacm and libibverbs (no
// ringverbs, so that it can do what the library would not). tests/examples/hostile_test.py runs
// each mode against reverse_server and echo_server next to a well-behaved client.
//
//   hostile_peer MODE ADDRESS PORT [ARG [ARG2]]
//
//   silent SECONDS  sends its connect request, then never reads another rdma_cm event (so
//                   never sends the RTU: librdmacm sends it while processing the
//                   CONNECT_RESPONSE), for SECONDS; then exits without cleaning up
//   vanish          sends its connect request and exits at once (mid-handshake)
//   flood N [K]     N connect requests at once from one process (or from processes of K each),
//                   then handles what comes for up to 20 s (established ones are
//                   disconnected); prints what they got
//   write-imm       connects, then an RDMA WRITE WITH IMMEDIATE of 16 KiB to an address and
//                   rkey it made up, and one of 0 bytes (each consumes a receive at the server);
//                   exits 3 on iWARP, which has no such opcode
//   oversized BYTES connects and sends one message of BYTES (larger than the server's receives)
//   after-dreq      connects, sends one message, disconnects, then keeps posting sends
//   private-data    connects with 56 bytes of garbage as private data (after trying 200, which
//                   the kernel must refuse), sends one message, disconnects
//   hog N SECONDS   connects one after the other until it holds N connections or three in a
//                   row were refused (the server out of resources, or busy), holds them for
//                   SECONDS without sending anything, then exits without cleaning up
//
// Prints "local port N" once its first id has a port (the server's log names the peer by it),
// then a line of what happened. Exits 0 when the mode ran, 1 naming the call that failed
// unexpectedly, 2 on bad usage, 3 when the device cannot do what the mode needs.
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>
#include <rdma/rdma_verbs.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <vector>

namespace {

int fail(const char* call) {
    std::fprintf(stderr, "hostile_peer: %s: %s\n", call, std::strerror(errno));
    return 1;
}

void print_port(rdma_cm_id* id) {
    std::printf("local port %u\n", static_cast<unsigned>(ntohs(rdma_get_src_port(id))));
    std::fflush(stdout);
}

// The next event on `ch` within `ms` (nullptr on timeout).
rdma_cm_event* next_event(rdma_event_channel* ch, int ms) {
    pollfd p{ch->fd, POLLIN, 0};
    if (::poll(&p, 1, ms) <= 0) return nullptr;
    rdma_cm_event* ev = nullptr;
    if (rdma_get_cm_event(ch, &ev) != 0) return nullptr;
    return ev;
}

bool expect(rdma_event_channel* ch, rdma_cm_event_type want) {
    rdma_cm_event* ev = next_event(ch, 5000);
    if (ev == nullptr) return false;
    const bool ok = ev->event == want;
    if (!ok) std::fprintf(stderr, "hostile_peer: got %s\n", rdma_event_str(ev->event));
    rdma_ack_cm_event(ev);
    return ok;
}

ibv_qp_init_attr small_qp() {
    ibv_qp_init_attr attr{};
    attr.qp_type = IBV_QPT_RC;
    attr.cap.max_send_wr = 8;
    attr.cap.max_recv_wr = 8;
    attr.cap.max_send_sge = 1;
    attr.cap.max_recv_sge = 1;
    attr.sq_sig_all = 1;
    return attr;
}

// An id on `ch` with its address and route resolved and a qp (librdmacm's default PD and CQs).
// Says which step failed (on stderr) and gives nullptr then.
rdma_cm_id* prepared_id(rdma_event_channel* ch, const sockaddr_in& to) {
    rdma_cm_id* id = nullptr;
    if (rdma_create_id(ch, &id, nullptr, RDMA_PS_TCP) != 0) {
        fail("rdma_create_id");
        return nullptr;
    }
    if (rdma_resolve_addr(id, nullptr, (sockaddr*)&to, 2000) != 0 ||
        !expect(ch, RDMA_CM_EVENT_ADDR_RESOLVED) || rdma_resolve_route(id, 2000) != 0 ||
        !expect(ch, RDMA_CM_EVENT_ROUTE_RESOLVED)) {
        fail("rdma_resolve_addr / rdma_resolve_route");
        return nullptr;
    }
    ibv_qp_init_attr attr = small_qp();
    if (rdma_create_qp(id, nullptr, &attr) != 0) {
        fail("rdma_create_qp");
        return nullptr;
    }
    return id;
}

rdma_conn_param conn_param() {
    rdma_conn_param p{};
    p.responder_resources = 1;
    p.initiator_depth = 1;
    p.retry_count = 7;
    p.rnr_retry_count = 7;
    return p;
}

// A connected endpoint (synchronous librdmacm), or nullptr.
rdma_cm_id* connected(const char* address, const char* port, const void* data = nullptr,
                      std::uint8_t data_len = 0, bool say_port = true) {
    rdma_addrinfo hints{};
    hints.ai_port_space = RDMA_PS_TCP;
    rdma_addrinfo* found = nullptr;
    if (rdma_getaddrinfo(address, port, &hints, &found) != 0) return nullptr;
    ibv_qp_init_attr attr = small_qp();
    rdma_cm_id* id = nullptr;
    const int rc = rdma_create_ep(&id, found, nullptr, &attr);
    rdma_freeaddrinfo(found);
    if (rc != 0) return nullptr;
    rdma_conn_param p = conn_param();
    p.private_data = data;
    p.private_data_len = data_len;
    if (rdma_connect(id, &p) != 0) {
        const int e = errno;
        rdma_destroy_ep(id);
        errno = e;
        return nullptr;
    }
    if (say_port) print_port(id);
    return id;
}

// Waits for one send-side completion, 5 s at most (siw never completes a send posted after its
// connection ended): its status, or -1.
int send_status(rdma_cm_id* id) {
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    ibv_wc wc{};
    while (std::chrono::steady_clock::now() < end) {
        const int n = ibv_poll_cq(id->send_cq, 1, &wc);
        if (n < 0) return -1;
        if (n == 1) return wc.status;
        usleep(100);
    }
    return -1;
}

int silent_or_vanish(const sockaddr_in& to, bool vanish, int seconds) {
    rdma_event_channel* ch = rdma_create_event_channel();
    if (ch == nullptr) return fail("rdma_create_event_channel");
    rdma_cm_id* id = prepared_id(ch, to);
    if (id == nullptr) return fail("resolve / rdma_create_qp");
    rdma_conn_param p = conn_param();
    if (rdma_connect(id, &p) != 0) return fail("rdma_connect");
    print_port(id);
    if (vanish) {
        std::printf("vanished after the request\n");
        std::fflush(stdout);
        _exit(0);
    }
    std::printf("request sent; silent for %d s\n", seconds);
    std::fflush(stdout);
    sleep(static_cast<unsigned>(seconds));
    _exit(0); // no cleanup: the kernel ends what is left
}

// What the requests of a flood got, summed over its processes (shared memory when forked).
struct flood_counts {
    std::atomic<int> established{0}, rejected{0}, busy{0}, other{0}, unprepared{0};
};

// One process's share of a flood: n requests on one event channel, sent at once, then what
// comes for up to 20 s. Counts into c; 0, or 1 when a call failed.
int flood_share(const sockaddr_in& to, int n, flood_counts& c, bool say_port) {
    rdma_event_channel* ch = rdma_create_event_channel();
    if (ch == nullptr) return fail("rdma_create_event_channel");
    std::vector<rdma_cm_id*> ids;
    for (int i = 0; i < n; ++i) {
        rdma_cm_id* id = prepared_id(ch, to);
        if (id == nullptr) {
            std::fprintf(stderr, "hostile_peer: flood: request %d of %d could not be prepared\n",
                         i + 1, n);
            c.unprepared += n - i;
            return 1;
        }
        ids.push_back(id);
    }
    if (say_port) print_port(ids.front());
    for (rdma_cm_id* id : ids) {
        rdma_conn_param p = conn_param();
        if (rdma_connect(id, &p) != 0) return fail("rdma_connect");
    }
    int answered = 0;
    const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (answered < n && std::chrono::steady_clock::now() < end) {
        rdma_cm_event* ev = next_event(ch, 1000);
        if (ev == nullptr) continue;
        if (ev->event == RDMA_CM_EVENT_ESTABLISHED) {
            ++answered;
            ++c.established;
            rdma_disconnect(ev->id);
        } else if (ev->event == RDMA_CM_EVENT_REJECTED) {
            ++answered;
            ++c.rejected;
            const auto* d = static_cast<const char*>(ev->param.conn.private_data);
            if (d != nullptr && ev->param.conn.private_data_len >= 5 &&
                std::memcmp(d, "busy:", 5) == 0)
                ++c.busy;
        } else if (ev->event != RDMA_CM_EVENT_DISCONNECTED &&
                   ev->event != RDMA_CM_EVENT_TIMEWAIT_EXIT) {
            ++answered;
            ++c.other;
        }
        rdma_ack_cm_event(ev);
    }
    for (rdma_cm_id* id : ids) {
        rdma_destroy_qp(id);
        rdma_destroy_id(id);
    }
    rdma_destroy_event_channel(ch);
    return 0;
}

// n requests at once; from one process, or split over processes of at most per_process each
// (libsiw refuses the object whose queue lands at mmap key 144 of a context, with errno 0: a
// process on librdmacm's shared context gets about 36 QPs with their CQs; README, iWARP notes).
int flood(const sockaddr_in& to, int n, int per_process) {
    void* shared = mmap(nullptr, sizeof(flood_counts), PROT_READ | PROT_WRITE,
                        MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (shared == MAP_FAILED) return fail("mmap");
    auto* c = new (shared) flood_counts;
    int processes = 1, failed = 0;
    if (per_process <= 0 || per_process >= n) {
        failed = flood_share(to, n, *c, true);
    } else {
        processes = (n + per_process - 1) / per_process;
        std::vector<pid_t> children;
        for (int i = 0; i < processes; ++i) {
            const int share = std::min(per_process, n - i * per_process);
            const pid_t pid = fork();
            if (pid < 0) {
                const int e = errno;
                for (pid_t child : children) // none of the flood goes on without us
                    kill(child, SIGKILL);
                for (pid_t child : children)
                    waitpid(child, nullptr, 0);
                errno = e;
                return fail("fork");
            }
            if (pid == 0) _exit(flood_share(to, share, *c, false));
            children.push_back(pid);
        }
        std::printf("flood: %d processes started\n", processes);
        std::fflush(stdout);
        for (pid_t pid : children) {
            int st = 0;
            if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st) != 0) ++failed;
        }
    }
    std::printf("flood: %d requests from %d process(es): %d established, %d rejected (%d busy), "
                "%d other, %d not prepared; %d process(es) failed\n",
                n, processes, c->established.load(), c->rejected.load(), c->busy.load(),
                c->other.load(), c->unprepared.load(), failed);
    std::fflush(stdout);
    return failed != 0 ? 1 : 0;
}

int write_imm(const char* address, const char* port) {
    rdma_cm_id* id = connected(address, port);
    if (id == nullptr) return fail("connect");
    std::vector<char> buf(16384, 'w');
    ibv_mr* mr = rdma_reg_write(id, buf.data(), buf.size());
    if (mr == nullptr) return fail("rdma_reg_write");
    int statuses[2];
    for (int i = 0; i < 2; ++i) {
        ibv_sge sge{reinterpret_cast<std::uintptr_t>(buf.data()), i == 0 ? 16384u : 0u, mr->lkey};
        ibv_send_wr wr{};
        ibv_send_wr* bad = nullptr;
        wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
        wr.imm_data = htonl(0xBAD0 + i);
        wr.sg_list = i == 0 ? &sge : nullptr;
        wr.num_sge = i == 0 ? 1 : 0;
        wr.send_flags = IBV_SEND_SIGNALED;
        wr.wr.rdma.remote_addr = 0x1000; // made up: the server never told us a region
        wr.wr.rdma.rkey = 0x1234;
        if (const int rc = ibv_post_send(id->qp, &wr, &bad); rc != 0) {
            if (id->verbs->device->transport_type == IBV_TRANSPORT_IWARP) {
                // iWARP's RDMAP has no write with immediate (libsiw refuses the opcode).
                std::printf("write-imm: not supported on this iWARP device (ibv_post_send: %d)\n",
                            rc);
                std::fflush(stdout);
                return 3;
            }
            return fail("ibv_post_send");
        }
        statuses[i] = send_status(id);
    }
    std::printf("write-imm: 16 KiB: %s; 0 bytes: %s\n",
                statuses[0] < 0 ? "no completion" : ibv_wc_status_str(ibv_wc_status(statuses[0])),
                statuses[1] < 0 ? "no completion" : ibv_wc_status_str(ibv_wc_status(statuses[1])));
    std::fflush(stdout);
    rdma_disconnect(id);
    rdma_dereg_mr(mr);
    rdma_destroy_ep(id);
    return 0;
}

int oversized(const char* address, const char* port, std::size_t bytes) {
    rdma_cm_id* id = connected(address, port);
    if (id == nullptr) return fail("connect");
    std::vector<char> buf(bytes, 'o');
    ibv_mr* mr = rdma_reg_msgs(id, buf.data(), buf.size());
    if (mr == nullptr) return fail("rdma_reg_msgs");
    if (rdma_post_send(id, nullptr, buf.data(), buf.size(), mr, 0) != 0)
        return fail("rdma_post_send");
    const int st = send_status(id);
    std::printf("oversized: %zu bytes: %s\n", bytes,
                st < 0 ? "no completion" : ibv_wc_status_str(ibv_wc_status(st)));
    std::fflush(stdout);
    rdma_disconnect(id);
    rdma_dereg_mr(mr);
    rdma_destroy_ep(id);
    return 0;
}

int after_dreq(const char* address, const char* port) {
    rdma_cm_id* id = connected(address, port);
    if (id == nullptr) return fail("connect");
    char msg[64];
    std::memset(msg, 'd', sizeof msg);
    ibv_mr* mr = rdma_reg_msgs(id, msg, sizeof msg);
    if (mr == nullptr) return fail("rdma_reg_msgs");
    if (rdma_post_send(id, nullptr, msg, sizeof msg, mr, 0) != 0) return fail("rdma_post_send");
    const int first = send_status(id);
    rdma_disconnect(id);
    int posted = 0, flushed = 0;
    int unanswered = 0;
    for (int i = 0; i < 50; ++i) {
        if (rdma_post_send(id, nullptr, msg, sizeof msg, mr, 0) != 0) break;
        ++posted;
        const int st = send_status(id);
        if (st == IBV_WC_WR_FLUSH_ERR) ++flushed;
        if (st < 0 && ++unanswered == 2) break; // siw: posts after the end never complete
    }
    std::printf("after-dreq: first send %s; %d sends after the DREQ, %d flushed, %d never "
                "completed\n",
                first < 0 ? "no completion" : ibv_wc_status_str(ibv_wc_status(first)), posted,
                flushed, unanswered);
    std::fflush(stdout);
    rdma_dereg_mr(mr);
    rdma_destroy_ep(id);
    return 0;
}

int private_data(const char* address, const char* port) {
    unsigned char junk[200];
    for (std::size_t i = 0; i < sizeof junk; ++i)
        junk[i] = static_cast<unsigned char>(i * 37 + 11);
    if (rdma_cm_id* id = connected(address, port, junk, 200); id != nullptr) {
        std::printf("private-data: 200 bytes went out (the kernel should refuse them)\n");
        rdma_disconnect(id);
        rdma_destroy_ep(id);
    }
    rdma_cm_id* id = connected(address, port, junk, 56);
    if (id == nullptr) return fail("connect with 56 bytes of private data");
    char msg[32];
    std::memset(msg, 'p', sizeof msg);
    ibv_mr* mr = rdma_reg_msgs(id, msg, sizeof msg);
    if (mr == nullptr) return fail("rdma_reg_msgs");
    if (rdma_post_send(id, nullptr, msg, sizeof msg, mr, 0) != 0) return fail("rdma_post_send");
    const int st = send_status(id);
    std::printf("private-data: connected with 56 bytes of garbage; send %s\n",
                st < 0 ? "no completion" : ibv_wc_status_str(ibv_wc_status(st)));
    std::fflush(stdout);
    rdma_disconnect(id);
    rdma_dereg_mr(mr);
    rdma_destroy_ep(id);
    return 0;
}

// Holds as many connections as the server gives it, up to n, for `seconds`: a client that
// takes what a server has (its locked memory, its QPs) and keeps it.
int hog(const char* address, const char* port, int n, int seconds) {
    std::vector<rdma_cm_id*> held;
    int refused = 0, in_a_row = 0;
    while (static_cast<int>(held.size()) < n && in_a_row < 3) {
        rdma_cm_id* id = connected(address, port, nullptr, 0, held.empty() && refused == 0);
        if (id == nullptr) {
            if (errno != ECONNREFUSED && errno != ECONNRESET) return fail("hog: connect");
            ++refused;
            ++in_a_row;
            usleep(200 * 1000);
            continue;
        }
        in_a_row = 0;
        held.push_back(id);
    }
    std::printf("hog: %zu connections held, %d refused; holding them %d s\n", held.size(), refused,
                seconds);
    std::fflush(stdout);
    sleep(static_cast<unsigned>(seconds));
    _exit(0); // no cleanup: the kernel ends what is left
}

} // namespace

int main(int argc, char** argv) {
    if (argc < 4) {
        std::fprintf(stderr, "usage: hostile_peer MODE ADDRESS PORT [ARG]\n");
        return 2;
    }
    const std::string mode = argv[1];
    const char* address = argv[2];
    const char* port = argv[3];
    const int arg = argc > 4 ? std::atoi(argv[4]) : 0;
    sockaddr_in to{};
    to.sin_family = AF_INET;
    to.sin_port = htons(static_cast<std::uint16_t>(std::atoi(port)));
    if (inet_pton(AF_INET, address, &to.sin_addr) != 1) {
        std::fprintf(stderr, "hostile_peer: not an IPv4 address: %s\n", address);
        return 2;
    }
    if (mode == "silent") return silent_or_vanish(to, false, arg > 0 ? arg : 5);
    if (mode == "vanish") return silent_or_vanish(to, true, 0);
    if (mode == "flood") return flood(to, arg > 0 ? arg : 1000, argc > 5 ? std::atoi(argv[5]) : 0);
    if (mode == "write-imm") return write_imm(address, port);
    if (mode == "oversized") return oversized(address, port, arg > 0 ? arg : 65536);
    if (mode == "after-dreq") return after_dreq(address, port);
    if (mode == "private-data") return private_data(address, port);
    if (mode == "hog")
        return hog(address, port, arg > 0 ? arg : 64, argc > 5 ? std::atoi(argv[5]) : 8);
    std::fprintf(stderr, "hostile_peer: unknown mode %s\n", mode.c_str());
    return 2;
}
