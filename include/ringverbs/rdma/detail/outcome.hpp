// The one mapping of a failed work completion to what its await throws, used by qp::request,
// recv_ring::next and srq::request alike.
#pragma once

#include <ringverbs/config.hpp>

#include <infiniband/verbs.h>

#include <string>

namespace ringverbs::detail {

// Throws, for `wc` (status not IBV_WC_SUCCESS) of the request `what` names ("the receive
// (ibv_post_recv) on qp 17", "recv_ring::next"):
// - std::system_error(ENODEV) when the runtime made it up because the device went away
//   (device_lost_vendor_err): the request never completed, its buffer is free again;
// - std::system_error(EIO) when the runtime made it up because the device never flushed it
//   (never_flushed_vendor_err: the QP was reset by qp_options::flush_timeout's bound);
// - std::system_error(the channel's errno) when the runtime made it up because a completion
//   channel of the QP's CQs failed (channel_failed_vendor_err): the QP was reset;
// - connection_reset when `closed` (the flush of a connection that ended: the qp's
//   flushed_by_closed_connection);
// - completion_error otherwise.
// A timeout or stop that ended the wait is the caller's to report first.
[[noreturn]] void throw_failed_completion(const ibv_wc& wc, const std::string& what, bool closed);

} // namespace ringverbs::detail
