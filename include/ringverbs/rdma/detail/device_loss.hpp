// device_loss: a device that went away (removed, unplugged, or failed for good) ends every
// await on it, so that nothing waits for completions that will never come.
#pragma once

#include <ringverbs/config.hpp>

#include <infiniband/verbs.h>

#include <cstddef>

namespace ringverbs::detail {

// Tells every cq, qp and srq of the runtime made on `device` (through this ibv_context or any
// other of the same device: matched by name), and every device_events watching it, that the
// device is gone; each is told on its own io_context's thread (io_context::post,
// made under the registry's lock) when that loop next runs:
// - a qp ends what it owes at once (QP to ERR and RESET, its CQs polled, the rest made up with
//   device_lost_vendor_err: those awaits end with ENODEV) and refuses every later post (ENODEV);
// - a cq's next() waiters, and every later next() once the completions polled before are taken,
//   end with ENODEV; its qps are told as above;
// - an srq fails its low_water() waiters and its receives owed (ENODEV), and refuses posts;
// - a device_events ends its next() waiters, once its queued events are taken, with ENODEV.
// `cause` (a string literal: "RDMA_CM_EVENT_DEVICE_REMOVAL", "IBV_EVENT_DEVICE_FATAL", ...)
// goes into the error texts. Idempotent: what was told already is not told again. Called by
// rdma_cm's DEVICE_REMOVAL (the cm layer) and by device_events. Returns how many objects were
// told (posted to).
std::size_t device_lost(ibv_context* device, const char* cause) noexcept;

// device_events' part (device_events.cpp): the watchers of `device` are told.
std::size_t device_events_lost(ibv_context* device, const char* cause) noexcept;

} // namespace ringverbs::detail
