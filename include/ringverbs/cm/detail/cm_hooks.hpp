// cm_hooks: the rdma_cm call that iWARP's connect thread makes, through a function pointer so
// that a test can delay what follows it (a thread the scheduler runs late), on a real device.
#pragma once

#include <ringverbs/config.hpp>

#include <rdma/rdma_cma.h>

#include <atomic>

namespace ringverbs::detail {

struct cm_hooks {
    // rdma_connect, as the connect thread of an iWARP id calls it (detail::blocking_connect);
    // 0, or -1 with errno set, like rdma_connect. Atomic: read on that thread.
    std::atomic<int (*)(rdma_cm_id* id, rdma_conn_param* param) noexcept> connect;
};

// The table in force (one per process); defaults to librdmacm. A test that replaces an entry
// restores it only once every connect thread that may have read it has returned.
cm_hooks& rdma_cm_hooks() noexcept;

} // namespace ringverbs::detail
