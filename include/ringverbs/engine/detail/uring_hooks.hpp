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

// The table in force (one per process); defaults to liburing. Change it only while no
// io_context runs on another thread.
uring_hooks& io_uring_hooks() noexcept;

} // namespace ringverbs::detail
