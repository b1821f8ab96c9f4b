// rnr_peer: a misbehaving echo client written on raw librdmacm and libibverbs, without
// ringverbs. It connects, sends one message, and never posts a receive: the server's echo
// meets receiver-not-ready NAKs until its RNR retries run out. Used by echo_test.py (rnr_peer).
//
//   rnr_peer ADDRESS PORT SECONDS   (stays connected and silent that long, then exits 0)
//
// Prints "sent" once its message is on the wire; exits 1 with the failing call on an error.
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>
#include <rdma/rdma_verbs.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <unistd.h>

namespace {

int fail(const char* call) {
    std::fprintf(stderr, "rnr_peer: %s: %s\n", call, std::strerror(errno));
    return 1;
}

} // namespace

int main(int argc, char** argv) {
    if (argc != 4) {
        std::fprintf(stderr, "usage: rnr_peer ADDRESS PORT SECONDS\n");
        return 2;
    }
    rdma_addrinfo hints{};
    hints.ai_port_space = RDMA_PS_TCP;
    rdma_addrinfo* found = nullptr;
    if (rdma_getaddrinfo(argv[1], argv[2], &hints, &found) != 0) return fail("rdma_getaddrinfo");
    ibv_qp_init_attr attr{};
    attr.cap.max_send_wr = 1;
    attr.cap.max_recv_wr = 1;
    attr.cap.max_send_sge = 1;
    attr.cap.max_recv_sge = 1;
    attr.sq_sig_all = 1;
    rdma_cm_id* id = nullptr;
    if (rdma_create_ep(&id, found, nullptr, &attr) != 0) return fail("rdma_create_ep");
    rdma_freeaddrinfo(found);
    char message[64];
    std::memset(message, 'r', sizeof message);
    ibv_mr* mr = rdma_reg_msgs(id, message, sizeof message);
    if (mr == nullptr) return fail("rdma_reg_msgs");
    rdma_conn_param param{};
    param.retry_count = 7;
    param.rnr_retry_count = 7;
    if (rdma_connect(id, &param) != 0) return fail("rdma_connect");
    if (rdma_post_send(id, nullptr, message, sizeof message, mr, 0) != 0)
        return fail("rdma_post_send");
    ibv_wc wc{};
    if (rdma_get_send_comp(id, &wc) <= 0) return fail("rdma_get_send_comp");
    if (wc.status != IBV_WC_SUCCESS) {
        std::fprintf(stderr, "rnr_peer: send: %s\n", ibv_wc_status_str(wc.status));
        return 1;
    }
    std::printf("sent\n");
    std::fflush(stdout);
    sleep(static_cast<unsigned>(std::atoi(argv[3]))); // never a receive
    rdma_disconnect(id);
    rdma_dereg_mr(mr);
    rdma_destroy_ep(id);
    return 0;
}
