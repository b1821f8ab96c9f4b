// uring_hooks: the io_uring call an io_context makes when its submission ring is full, made
// through a function pointer so that a test can make submission fail (a full ring that
// cannot be drained) and check that no wait is left half started.
#pragma once

#include <ringverbs/config.hpp>

#include <liburing.h>

namespace ringverbs::detail {

struct uring_hooks {
    // io_uring_submit, as io_context::get_sqe calls it to make room.
    int (*submit)(io_uring* ring) noexcept;
};

// How many times io_context::get_sqe submits to make room in a full submission ring while the
// kernel refuses (EBUSY or EAGAIN: its completion ring full) before it gives up and throws
// "io_uring_submit" (tests count on it to starve a request of its SQE).
inline constexpr int get_sqe_submit_attempts = 1001;

// The table in force (one per process); defaults to liburing. Change it only while no
// io_context runs on another thread.
uring_hooks& io_uring_hooks() noexcept;

} // namespace ringverbs::detail
