// Connects two RC queue pairs of the test device to each other, on any transport.
//
// InfiniBand and RoCE: by hand (verbs::connect_loopback: INIT, RTR, RTS with each other's QP
// number and the device's GID), nothing to keep.
// iWARP (siw, irdma in iWARP mode, cxgb4): an iWARP QP reaches RTS only through the iWARP
// connection manager, so the pair is connected with librdmacm on the device's own IPv4 address
// ($RINGVERBS_ADDR): a listening id and a connecting id, each given one of the two QPs by number
// (the kernel looks the QP up by that number; it needs not be made by rdma_create_qp). The ids
// own the connection: it lives as long as the returned `pair_link` (destroying it disconnects,
// and the QPs go to the error state), so keep the link while the QPs are used.
#pragma once

#include "rdma_test_device.hpp"

#include <ringverbs/verbs/queue_pair.hpp>

#include <memory>

namespace ringverbs::test {

// Keeps an iWARP pair's connection (empty on InfiniBand and RoCE).
class pair_link {
  public:
    pair_link() noexcept;
    pair_link(pair_link&&) noexcept;
    pair_link& operator=(pair_link&&) noexcept;
    ~pair_link();
    // Disconnects now (iWARP: the QPs go to the error state, their work is flushed).
    void reset() noexcept;

    struct ids;
    explicit pair_link(std::unique_ptr<ids> held) noexcept;

  private:
    std::unique_ptr<ids> ids_;
};

// a and b: RC QPs in RESET on the test device (rdma_device()). `remote_rights`: what the peer
// may do to each (remote write, read, atomics). `send_side`: timeouts and RNR retries (IB and
// RoCE only: iWARP has neither RNR nor these knobs).
// Throws std::system_error naming the verb that failed.
[[nodiscard]] pair_link connect_pair(verbs::queue_pair& a, verbs::queue_pair& b,
                                     verbs::access remote_rights = verbs::access::none,
                                     const verbs::rts_params& send_side = {});

} // namespace ringverbs::test
