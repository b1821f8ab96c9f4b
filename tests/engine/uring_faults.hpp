// Faults between the engine and the real io_uring, for the engine's and the rdma layer's tests:
// a submission ring left (nearly) full, a stale slot, submissions refused. Never a mock: the
// ring is the kernel's, detail::uring_hooks only fails some of the io_uring_submit calls.
#pragma once

#include <ringverbs/engine/detail/operation.hpp>
#include <ringverbs/engine/detail/uring_hooks.hpp>
#include <ringverbs/engine/io_context.hpp>

#include <liburing.h>

#include <cerrno>

namespace test {

// Takes SQEs of `io`'s submission ring (NOPs nobody waits for) until `left` are free.
inline void fill_sq(ringverbs::io_context& io, unsigned left) noexcept {
    io_uring* ring = ringverbs::detail::loop(io).native_ring();
    while (io_uring_sq_space_left(ring) > left) {
        io_uring_sqe* sqe = io_uring_get_sqe(ring);
        io_uring_prep_nop(sqe);
        io_uring_sqe_set_data64(sqe, ringverbs::detail::ignored_user_data);
    }
}

// The next `count` io_uring submissions fail with EBUSY (the completion ring full, as the
// kernel says), while it lives; later ones go through. One at a time.
class refuse_submits {
  public:
    explicit refuse_submits(int count) noexcept {
        left_ = count;
        saved_ = ringverbs::detail::io_uring_hooks().submit;
        ringverbs::detail::io_uring_hooks().submit = [](io_uring* ring) noexcept {
            return left_-- > 0 ? -EBUSY : saved_(ring);
        };
    }
    ~refuse_submits() { ringverbs::detail::io_uring_hooks().submit = saved_; }
    refuse_submits(const refuse_submits&) = delete;
    refuse_submits& operator=(const refuse_submits&) = delete;

  private:
    static inline int left_ = 0;
    static inline decltype(ringverbs::detail::uring_hooks::submit) saved_ = nullptr;
};

// Leaves exactly one SQE free in `io`'s submission ring (the rest taken by NOPs nobody waits
// for) and makes that free slot stale, as a slot the ring used before is: it holds a NOP naming
// this object, so a submission of the slot before anyone prepared it again is counted.
// (io_uring_get_sqe does not clear a slot; the test gives it back through the ring's tail.)
struct one_stale_sqe : ringverbs::detail::operation {
    int submitted_stale = 0;
    explicit one_stale_sqe(ringverbs::io_context& io) noexcept {
        on_cqe = [](operation* self, int, unsigned) noexcept {
            ++static_cast<one_stale_sqe*>(self)->submitted_stale;
        };
        fill_sq(io, 1);
        io_uring* ring = ringverbs::detail::loop(io).native_ring();
        io_uring_sqe* stale = io_uring_get_sqe(ring);
        io_uring_prep_nop(stale);
        io_uring_sqe_set_data(stale, static_cast<operation*>(this));
        --ring->sq.sqe_tail; // free again, its content left as it is
    }
};

} // namespace test
