// mmap_keys: a guard against libsiw's collision of a valid mmap key with its "invalid key"
// marker, taken before the first CQ, QP or SRQ of each ibv_context.
//
// libsiw (rdma-core's providers/siw, 44 and later) maps every CQ, SQ, RQ and SRQ queue with a
// key the kernel returns, and treats the key SIW_INVAL_UOBJ_KEY (0x90000: page offset 144) as a
// failure: it destroys the object it just made and returns NULL with errno 0. ib_core hands out
// the lowest free page offsets of each context, so the object whose queue starts at page 144
// always lands on that key: one create of every context fails (at the 144th one-page CQ, the
// 35th QP of 64/64 receives and sends, ...), and so does every later one, since its queue
// starts there again. Not a limit: the same object on another context works.
// The guard: the first object of a siw context is a CQ of 32768 entries (257 pages, about
// 1 MiB of kernel memory), which covers page offsets 0..256, so that no later queue starts at
// 144. Other devices are not touched (one ibv_query_device per context, remembered).
#pragma once

#include <ringverbs/config.hpp>

#include <infiniband/verbs.h>

#include <string>

namespace ringverbs::verbs::detail {

// Before creating a CQ, QP or SRQ on `ctx`. Thread-safe; never throws (a guard that cannot be
// made is said to the diagnostics sink, and the creates go on without it).
void prepare_for_queues(ibv_context* ctx) noexcept;

// Before ibv_close_device(ctx): destroys its guard. Thread-safe.
void forget_context(ibv_context* ctx) noexcept;

// The device called `device_name` went away: the guard CQs of all its contexts are destroyed
// and their records dropped. A guard's mapping would keep the context's file open after its
// owner closed it (librdmacm closes its own contexts without telling us), and the removal
// waits for that file.
void forget_device(const char* device_name) noexcept;

// Before librdmacm re-reads its device list (which closes, without telling us, its context of
// every device that went away and that no id uses, whether or not a DEVICE_REMOVAL told us):
// the records of every device no longer listed are dropped, their guard CQs destroyed while
// their contexts are still open. Else the record would name a freed context (and the guard's
// mapping would keep that device's removal waiting).
void forget_missing_devices() noexcept;

// What a failed create on `ctx` adds to its message (empty if nothing): errno 0 on siw is the
// collision above.
std::string create_failure_note(ibv_context* ctx, int saved_errno);

} // namespace ringverbs::verbs::detail
