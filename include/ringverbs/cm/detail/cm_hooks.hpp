// cm_hooks: rdma_cm calls made through function pointers so that a test can put a fault or a
// delay between the runtime and the real call, on a real device: the rdma_connect of iWARP's
// connect thread (a thread the scheduler runs late), rdma_create_qp (a request whose peer went
// before its QP was made); and connect()'s settle step on siw, which a test can turn off.
#pragma once

#include <ringverbs/config.hpp>

#include <rdma/rdma_cma.h>

#include <atomic>

namespace ringverbs::detail {

struct cm_hooks {
    // rdma_connect, as the connect thread of an iWARP id calls it (detail::blocking_connect);
    // 0, or -1 with errno set, like rdma_connect. Atomic: read on that thread.
    std::atomic<int (*)(rdma_cm_id* id, rdma_conn_param* param) noexcept> connect;
    // rdma_create_qp, as cm_id::create_qp calls it (on the id's owner thread); 0, or -1 with
    // errno set.
    std::atomic<int (*)(rdma_cm_id* id, ibv_pd* pd, ibv_qp_init_attr* init) noexcept> create_qp;
    // Whether connect() settles a connection on siw before it returns (its zero-length RDMA
    // READ, src/cm/connection.cpp); a test turns it off to show what it prevents.
    std::atomic<bool> settle_on_siw;
};

// The table in force (one per process); defaults to librdmacm. A test that replaces an entry
// restores it only once every connect thread that may have read it has returned.
cm_hooks& rdma_cm_hooks() noexcept;

} // namespace ringverbs::detail
