// The operation state shared by every awaitable: what the io_context calls back when the
// kernel delivers a CQE, and what another thread pushes to hand work to the owning thread.
#pragma once

#include <ringverbs/config.hpp>

#include <cstdint>

namespace ringverbs::detail {

// One in-flight io_uring request. Its address is the SQE's user_data; the object lives (in
// the awaiting coroutine's frame, or in an object the io_context owns) until the kernel has
// delivered the last CQE it owes: the one without IORING_CQE_F_MORE. The call goes through a
// function pointer, not a virtual function, so that an operation state is a plain aggregate
// that the compiler can lay out inside the awaiter.
struct operation {
    void (*on_cqe)(operation* self, int res, unsigned flags) noexcept = nullptr;
};

// user_data of requests whose CQE nobody waits for (cancel requests, linked timeouts): the
// io_context drops their CQEs. Nothing of ours is written by the kernel for them.
inline constexpr std::uint64_t ignored_user_data = 0;

// A CQE taken out of the completion ring before its handler could run (io_context::get_sqe
// making room): the three fields the handler needs.
struct set_aside_cqe {
    std::uint64_t user_data;
    int res;
    unsigned flags;
};

// A unit of work handed to the io_context's thread from any thread (cross-thread post, a
// std::stop_token fired elsewhere). Intrusive: the node lives in its owner, so pushing never
// allocates. `run` is called on the io_context's thread.
struct remote_node {
    remote_node* next = nullptr;
    void (*run)(remote_node* self) noexcept = nullptr;
};

// Work an io_context runs in the turn it was queued, after the CQEs were reaped and before
// coroutines resume, higher priority first: completion channels that fired or that spin.
// Coroutines it makes ready therefore resume in the pollers' priority order. Intrusive, owned
// by its queuer, which must dequeue it (io_context::dequeue_poller) before it dies.
struct poller {
    void (*run)(poller* self) noexcept = nullptr;
    int priority = 0;
    poller* next = nullptr;
    bool queued = false;
};

} // namespace ringverbs::detail
